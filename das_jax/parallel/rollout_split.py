"""Rollouts split across processes: which process generates which GRPO group, and the gather of
every process's share into the whole batch.

With P processes (`jax.distributed`, one per GPU or per host), each process generates only its
share of a step's groups (a group: the `num_generations` samples of one prompt, kept whole so
its advantages and its siblings' drafts stay on one process), scores it, and the shares are
gathered (`gather_rows`) so that every process holds the same whole batch, in the order one
process would have generated it, for the SPMD update.

Assignment (`GroupSplit.assign`): every process computes the same assignment from the same
replicated state (the problem ids of the step, each problem's recent completion lengths and its
owner, all updated from the gathered batch), so no message is needed. Groups are taken longest
predicted first (a problem's predicted length: the mean of its recent completion lengths, or the
mean over all problems for one never seen); each goes to the process that generated the problem
last (its drafter holds the problem's rollout history: `das_jax.drafter.SuffixDrafter`), unless
that process would then carry more than (1 + `slack`) x the mean load, in which case it goes to
the least-loaded process (longest-processing-time first, Graham 1969, "Bounds on
multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2)) and the problem moves there.
"""
from __future__ import annotations

import collections
from typing import Hashable, Sequence

import numpy as np


def assign_groups(predicted: np.ndarray, owners: np.ndarray, processes: int,
                  slack: float = 0.1) -> np.ndarray:
    """int64 `[G]`: the process of each group.

    Args:
      predicted: float `[G]` predicted tokens of each group (a load unit; > 0).
      owners: int `[G]` the process that holds each group's history (-1: none).
      processes: P >= 1.
      slack: a group stays with its owner while the owner's load is <= (1 + slack) x the mean
        load over processes.

    Groups are placed longest first (ties: lower index first); deterministic.
    """
    predicted = np.asarray(predicted, np.float64)
    owners = np.asarray(owners, np.int64)
    G = len(predicted)
    out = np.zeros(G, np.int64)
    if processes <= 1 or G == 0:
        return out
    cap = (1.0 + slack) * predicted.sum() / processes
    load = np.zeros(processes)
    for g in np.argsort(-predicted, kind="stable"):
        p = int(owners[g])
        if not (0 <= p < processes and load[p] + predicted[g] <= cap):
            p = int(np.argmin(load))        # the least loaded (lowest index on ties)
        out[g] = p
        load[p] += predicted[g]
    return out


class GroupSplit:
    """The replicated state of the assignment (module docstring): each problem's owner process
    and its recent completion lengths (at most `history` per problem).

    Args:
      processes: P.
      slack: see `assign_groups`.
      history: completion lengths kept per problem.
    """

    def __init__(self, processes: int, slack: float = 0.1, history: int = 64):
        self.processes = processes
        self.slack = slack
        self.history = history
        self.owner: dict[Hashable, int] = {}
        self.lengths: dict[Hashable, collections.deque] = {}

    def predicted(self, problem_id: Hashable, default: float) -> float:
        lens = self.lengths.get(problem_id)
        return float(np.mean(lens)) if lens else default

    def assign(self, problem_ids: Sequence[Hashable], group_size: int) -> np.ndarray:
        """int64 `[G]`: the process of each group (one per entry of `problem_ids`, each of
        `group_size` samples)."""
        known = [np.mean(v) for v in self.lengths.values() if v]
        default = float(np.mean(known)) if known else 1.0
        predicted = np.array([max(self.predicted(p, default), 1.0) * group_size
                              for p in problem_ids])
        owners = np.array([self.owner.get(p, -1) for p in problem_ids], np.int64)
        return assign_groups(predicted, owners, self.processes, self.slack)

    def observe(self, problem_ids: Sequence[Hashable], procs: np.ndarray,
                lengths_GxS: np.ndarray) -> None:
        """Records where each group ran and its completion lengths (int `[G, S]`)."""
        for p, proc, lens in zip(problem_ids, procs, np.asarray(lengths_GxS)):
            self.owner[p] = int(proc)
            self.lengths.setdefault(p, collections.deque(maxlen=self.history)).extend(
                int(n) for n in lens)

    def state_dict(self) -> dict:
        return {"processes": self.processes,
                "problems": [[p, self.owner.get(p, -1), list(self.lengths.get(p, ()))]
                             for p in dict.fromkeys(list(self.owner) + list(self.lengths))]}

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()`; owners are dropped when the process count changed (the
        drafters' histories are per process)."""
        same = int(state.get("processes", -1)) == self.processes
        self.owner, self.lengths = {}, {}
        for p, owner, lens in state.get("problems", ()):
            p = tuple(p) if isinstance(p, list) else p
            if same and owner >= 0:
                self.owner[p] = int(owner)
            self.lengths[p] = collections.deque((int(n) for n in lens), maxlen=self.history)


def gather_rows(local: dict[str, np.ndarray], rows_of: Sequence[np.ndarray],
                total: int) -> dict[str, np.ndarray]:
    """The whole batch from every process's share.

    Args:
      local: name -> this process's array `[R_p, ...]` (rows in the order of its
        `rows_of[process_index]`); trailing dimensions may differ between processes (padded with
        0 to the largest).
      rows_of: per process, int `[R_p]` the global row index of each of its rows.
      total: rows of the whole batch.

    Returns:
      name -> `[total, ...]` array, identical on every process. One process: `local` reordered.
    """
    import jax   # deferred: jax (this module's assignment is plain numpy)
    from jax.experimental import multihost_utils

    P = len(rows_of)
    R = max(len(r) for r in rows_of)
    out: dict[str, np.ndarray] = {}
    for name, arr in local.items():
        arr = np.asarray(arr)
        if P == 1 or jax.process_count() == 1:
            full = np.zeros((total,) + arr.shape[1:], arr.dtype)
            full[rows_of[0]] = arr
            out[name] = full
            continue
        # agree on the trailing shape, then gather [P, R, ...] padded shares
        dims = np.asarray(multihost_utils.process_allgather(
            np.asarray(arr.shape[1:] or (0,), np.int64)))
        tail = tuple(int(d) for d in dims.max(axis=0)) if arr.ndim > 1 else ()
        pad = np.zeros((R,) + tail, arr.dtype)
        pad[(slice(0, len(arr)),) + tuple(slice(0, d) for d in arr.shape[1:])] = arr
        every = np.asarray(multihost_utils.process_allgather(pad))     # [P, R, ...]
        full = np.zeros((total,) + tail, arr.dtype)
        for p, rows in enumerate(rows_of):
            full[rows] = every[p, :len(rows)]
        out[name] = full
    return out
