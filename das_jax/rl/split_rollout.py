"""A GRPO step's rollouts split across processes (`das_jax.parallel.rollout_split`): this process
generates and scores its groups, and the whole batch is gathered, identical on every process and
in the order one process would have generated it."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from das_jax.drafter import DRAFT_SOURCES
from das_jax.engine import GenerateStats, RequestOutput, StepRecord
from das_jax.parallel.rollout_split import GroupSplit, gather_rows
from das_jax.rl.rollout_batch import RolloutBatch
from das_jax.rollout import DataParallelStats

FINISH = ("", "stop", "length")
# GenerateStats counters gathered from every process (the rest are per process)
_STAT_FIELDS = ("forward_passes", "generated_tokens", "drafted_tokens", "accepted_draft_tokens",
                "prefill_s", "decode_s", "draft_s", "policy_s", "host_s", "overlap_s", "wall_s",
                "compile_s", "draft_model_s", "prefill_tokens", "prefill_calls")


# draft positions whose acceptance counts travel between processes (suffix drafts are at most
# max_depth - 1 tokens long; positions past this many are not carried)
_POSITIONS = 64


def _stats_vector(st: GenerateStats) -> np.ndarray:
    """float64 `[F + 2 + 2 * (_POSITIONS + S)]`: the counters, the steps' live rows and emitted
    tokens, then drafted / accepted counts per draft position and per source (S =
    len(DRAFT_SOURCES))."""
    active = sum(s.active for s in st.steps)
    emitted = sum(s.emitted for s in st.steps)
    acc = []
    for counts in (st.drafted_by_position, st.accepted_by_position):
        v = np.zeros(_POSITIONS)
        v[: min(len(counts), _POSITIONS)] = counts[:_POSITIONS]
        acc.append(v)
    for by in (st.drafted_by_source, st.accepted_by_source):
        acc.append(np.array([by.get(k, 0) for k in DRAFT_SOURCES], np.float64))
    return np.concatenate([[float(getattr(st, f)) for f in _STAT_FIELDS], [active, emitted],
                           *acc])


def _stats_of(vec: np.ndarray) -> GenerateStats:
    """Another process's `GenerateStats` from its vector; its steps are one summary record
    (its live rows and emitted tokens summed: the acceptance length comes out right)."""
    F, S = len(_STAT_FIELDS), len(DRAFT_SOURCES)
    pos = vec[F + 2:]
    st = GenerateStats(**{f: type(getattr(GenerateStats, f, 0.0))(v)
                          for f, v in zip(_STAT_FIELDS, vec)})
    trim = lambda v: [int(x) for x in v[: int(np.flatnonzero(v).max(initial=-1)) + 1]]  # noqa: E731
    st.drafted_by_position = trim(pos[:_POSITIONS])
    st.accepted_by_position = trim(pos[_POSITIONS: 2 * _POSITIONS])
    st.accepted_by_position += [0] * (len(st.drafted_by_position)
                                      - len(st.accepted_by_position))
    d_S, a_S = pos[2 * _POSITIONS: 2 * _POSITIONS + S], pos[2 * _POSITIONS + S:]
    st.drafted_by_source = {k: int(d_S[i]) for i, k in enumerate(DRAFT_SOURCES) if d_S[i]}
    st.accepted_by_source = {k: int(a_S[i]) for i, k in enumerate(DRAFT_SOURCES) if d_S[i]}
    st.steps = [StepRecord(batch=0, active=int(vec[F]), width=1, kv_len=0,
                           drafted=st.drafted_tokens, accepted=st.accepted_draft_tokens,
                           emitted=int(vec[F + 1]), seconds=st.decode_s)]
    return st


def split_rollout(trainer, split: GroupSplit, requests: Sequence[Any], rows: Sequence[Any],
                  group_size: int, params, sampling):
    """Generates this process's groups of `requests` (one per row of `rows`, groups of
    `group_size` consecutive rows), scores them, and gathers the whole `RolloutBatch`.

    Every process must call it with the same arguments (replicated `split` state, the same
    step's requests); the split state then records where each group ran.
    """
    P, me = jax.process_count(), jax.process_index()
    problem_ids = [rows[g * group_size].problem_id for g in range(len(rows) // group_size)]
    proc_G = split.assign(problem_ids, group_size)
    proc_N = np.repeat(proc_G, group_size)
    rows_of = [np.flatnonzero(proc_N == q) for q in range(P)]
    mine = rows_of[me]
    if len(mine):
        outputs, stats = trainer.rollouts.generate([requests[i] for i in mine], params,
                                                   sampling)
        local = trainer.score([rows[i] for i in mine], outputs, stats)
        rewards, reward_parts = local.rewards, local.reward_parts
    else:       # fewer groups than processes
        outputs, stats = [], GenerateStats()
        rewards = np.zeros(0, np.float32)
        reward_parts = {n: [] for n in trainer.reward_fn.names}
    lens = np.array([len(o.token_ids) for o in outputs], np.int32)
    T = int(lens.max(initial=1))
    tokens = np.zeros((len(mine), T), np.int32)
    logps = np.zeros((len(mine), T), np.float32)
    for j, o in enumerate(outputs):
        tokens[j, :lens[j]] = o.token_ids
        logps[j, :lens[j]] = o.logprobs
    parts = sorted(trainer.reward_fn.names)    # the same names on every process
    shares = {"tokens": tokens, "logprobs": logps, "lens": lens,
              "finish": np.array([FINISH.index(o.finish_reason) for o in outputs], np.int32),
              "rewards": np.asarray(rewards, np.float32)}
    shares.update({f"part:{k}": np.asarray(reward_parts[k], np.float32) for k in parts})
    full = gather_rows(shares, rows_of, len(rows))
    per_process = gather_rows({"stats": _stats_vector(stats)[None]},
                              [np.array([q]) for q in range(P)], P)["stats"]
    all_outputs = []
    for i, req in enumerate(requests):
        n = int(full["lens"][i])
        all_outputs.append(RequestOutput(req, full["tokens"][i, :n].tolist(),
                                         full["logprobs"][i, :n].astype(np.float64).tolist(),
                                         FINISH[int(full["finish"][i])]))
    own = dict(zip(mine.tolist(), outputs))
    for i, o in own.items():        # this process's outputs keep their counters
        all_outputs[i] = o
    split.observe(problem_ids, proc_G, full["lens"].reshape(-1, group_size))
    combined = DataParallelStats.combine(
        [stats if q == me else _stats_of(per_process[q]) for q in range(P)],
        assignment=[r.tolist() for r in rows_of])
    completions = [trainer.tokenizer.decode(o.token_ids) for o in all_outputs]
    return RolloutBatch(list(rows), [list(r.prompt_ids) for r in requests], all_outputs,
                        completions, full["rewards"],
                        {k: full[f"part:{k}"].tolist() for k in parts}, combined)
