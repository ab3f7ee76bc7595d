"""The errors of reading and writing training checkpoints (user errors: the CLI prints them as
one line and exits with code 2)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or does not match the model being restored."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint whose trees differ from the model/optimizer being restored."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint in a format this version does not read: an older version's pickled drafter
    state (never unpickled: a pickle can run code), or a newer schema version."""
