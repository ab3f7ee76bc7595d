"""The error of a GRPO run that cannot start or resume (a user error: the CLI prints it as one
line and exits with code 2)."""
from __future__ import annotations


class TrainError(ValueError):
    """A run that cannot start or resume (names the problem and the fix)."""
