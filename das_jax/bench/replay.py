"""Trace replay: predict rollout time per drafter by simulating the engine on recorded rollouts.

A *trace* (JSON lines) holds recorded rollouts: a header line

    {"type": "header", "model": ..., "cost_model": {"c_base", "c_tok", "c_kv"},
     "engine": {"max_slots", "max_cache_len", "draft_widths"}, "max_new_tokens": ...,
     "das": {the config's das: section}, "overheads": {"prefill_s_per_token", "host_s_per_step"}}

then one line per rollout: {"epoch", "temperature", "problem_id", "sample_index", "prompt_ids",
"token_ids", "finish_reason"}, in the order the engine received the requests.

`simulate` runs `Engine.generate`'s own host scheduler (`das_jax.engine.run_schedule`) without
a model, through a `TraceExecutor` in place of the engine's device executor:

* the scheduling is the engine's code, not a copy: continuous batching over `max_slots` rows in
  batch buckets, admission in the policy's `admission_order`, every admitted row emitting its
  first (prefill) token, compaction into the smallest bucket once the queue is empty, the same
  cache-length, attended-length (`kv_len`) and step-shape buckets;
* per step, the real drafter objects and the real policy (`das_jax.rollout.build_speculation`,
  from the trace's `das:` settings) are asked for budgets, drafts and the width W by the same
  calls, and are fed the emitted tokens (`append`, `end`, `observe`; `advance_epoch` between
  epochs);
* acceptance is exact: speculation never changes the sampled tokens, so the target token at every
  position is the recorded one, and a draft is accepted up to its first disagreement with the
  recorded continuation;
* a step's time is the cost model t(N, K) = c_base + c_tok*N + c_kv*K (`CostModel.predict_step`)
  at the step shape the engine computes (`schedule.step_shape_fn`).

Modelling assumptions (what the prediction leaves out or approximates):

1. The cost model is linear in the token slots N and the attended positions K; the real step
   cost on a CPU is not (different matmul kernels per M), so the decode prediction is only as
   good as the fit (`bench rollout` prints predicted / measured next to every measured time).
2. Prefill is modelled as `prefill_s_per_token` per prompt token slot the engine's prefill
   computes (`scheduler.prefill_layout` of each admission call), and the executor's own host
   work (packing a step's arrays, dispatch) as `host_s_per_step` per forward pass; both are
   fitted from the measured plain (`none`) run of the first epoch. The scheduler's, drafter's
   and policy's host work is measured: the replay runs the engine's own host code on this
   machine: the work between steps (`GenerateStats.host_s`) counts as exposed, the work the
   engine runs during a step (`overlap_s`: the drafter's deferred appends) only beyond the
   step's predicted time (`exposed_overlap_s`).
3. Tokens past a recorded stop token are unknown, so a draft that runs past the end of a rollout
   is accepted only up to the end; the engine counts the same (only committed tokens). A
   rollout ends at its recorded end with its recorded finish reason, or at max_new_tokens.
4. The simulated policy plans with a frozen cost model (the trace's coefficients); in the real
   engine the DAS policy refines its cost model online from measured step times, so a real DAS run
   may choose other widths than the replay (forward passes then differ slightly). With a frozen
   cost model in both (the tests do this) they match exactly.
5. Paper scale (`--scale paper`, `paper_workload`): the trace's rollouts are stretched into
   long-tailed rollouts (see `paper_workload`); their token content is built from recorded
   rollouts of the same problem, so it keeps the recorded redundancy between siblings and epochs,
   which is what the drafters exploit. Absolute acceptance at 16K tokens is therefore an
   extrapolation; the relative cost of speculation (the cost model) is given by flags.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import queue
import threading
import time
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

# The engine's own host scheduler and result types: the simulation runs the engine's loop.
# Importing EngineConfig imports jax; that is fine here (not at CLI parse time).
from das_jax.config import ConfigError, apply_overrides, config_from_dict
from das_jax.engine import (EngineConfig, GenerateStats, Limits, PagedRows, Prefilled, PromptRows,
                            StepInput, StepOutput, prefill_layout, run_schedule)
from das_jax.errors import UserError
from das_jax.json_values import is_int, is_number
from das_jax.rollout import build_speculation
from das_jax.speculation import CostModel
from das_jax.speculation.cost_file import cost_coefficients, is_seconds


class FrozenCostModel(CostModel):
    """A cost model that ignores observations (the replay plans with fixed coefficients)."""

    def observe_step(self, num_tokens, attended_kv, seconds, refit=True, width=None,
                     read_kv=None, wide_rows=0, branch_rows=0):
        pass

    def observe_compile(self, seconds):
        pass

    @classmethod
    def of(cls, coef: dict) -> "FrozenCostModel":
        return cls(c_base=float(coef["c_base"]), c_tok=float(coef["c_tok"]),
                   c_kv=float(coef.get("c_kv", 0.0)))


@dataclasses.dataclass(frozen=True)
class TraceRollout:
    """One recorded rollout."""

    epoch: int
    problem_id: Hashable
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str = "stop"
    temperature: float = 0.0

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "temperature": self.temperature, "problem_id": self.problem_id,
                "sample_index": self.sample_index, "prompt_ids": list(self.prompt_ids),
                "token_ids": list(self.token_ids), "finish_reason": self.finish_reason}


@dataclasses.dataclass
class Trace:
    header: dict
    rollouts: list[TraceRollout]

    def groups(self) -> dict[float, dict[int, list[TraceRollout]]]:
        """temperature -> epoch -> rollouts (in recorded request order)."""
        out: dict[float, dict[int, list[TraceRollout]]] = {}
        for r in self.rollouts:
            out.setdefault(r.temperature, {}).setdefault(r.epoch, []).append(r)
        return {t: dict(sorted(e.items())) for t, e in sorted(out.items())}

    def temperature(self, wanted: float | None = None) -> float:
        """The recorded temperature equal to `wanted` (within 1e-9), or the lowest recorded
        one for None. ValueError naming the ones it holds when none is equal."""
        temps = sorted({r.temperature for r in self.rollouts})
        found = temps[:1] if wanted is None else [t for t in temps if abs(t - wanted) < 1e-9]
        if not found:
            raise ValueError(f"the trace holds no rollouts at temperature {wanted:g}; it holds "
                             f"{', '.join(f'{t:g}' for t in temps)}")
        return found[0]


def write_trace(path, header: dict, rollouts: Iterable[TraceRollout]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"type": "header", **header}) + "\n")
        for r in rollouts:
            f.write(json.dumps(r.to_json()) + "\n")


def _trace_lines(path) -> list[bytes]:
    """The raw lines of a trace file, gunzipped when the name ends in `.gz`.

    Raises:
      UserError: the file is missing, a directory, unreadable or not gzip (one line with the
        fix)."""
    fix = ("pass a trace written by `das-jax bench rollout` (DIR/trace.jsonl) or the shipped "
           "docs/traces/gsm8k-smollm2-135m.jsonl.gz")
    try:
        if not str(path).endswith(".gz"):
            with open(path, "rb") as f:
                return f.read().splitlines()
        with gzip.open(path, "rb") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"trace {path}: no such file; {fix}") from None
    except IsADirectoryError:
        raise UserError(f"trace {path}: is a directory, not a trace file; {fix}") from None
    except (OSError, EOFError) as e:   # gzip.BadGzipFile is an OSError
        if isinstance(e, OSError) and e.errno is not None:      # permissions, I/O errors
            raise UserError(f"trace {path}: cannot read it ({e.strerror or e}); {fix}") from None
        raise UserError(f"trace {path}: not a readable gzip file ({e}); is it a trace written "
                        "by `bench rollout`, compressed with gzip?") from None


def _is_token_ids(v) -> bool:
    return isinstance(v, list) and all(is_int(t) and t >= 0 for t in v)


def _check_header(obj: dict, where: str) -> dict:
    """The header line's fields that a trace may hold, each checked when present (a command
    that needs an absent one says so itself); returns the header without "type"."""
    fix = "record the trace again with `das-jax bench rollout`"

    def bad(key, want):
        return UserError(f"{where}: header {key!r} must be {want}, got {obj_get(key)!r}; {fix}")

    def obj_get(key):
        cur = obj
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        return cur

    if "model" in obj and not (isinstance(obj["model"], str) and obj["model"].strip()):
        raise UserError(f"{where}: header 'model' must be a model source (a name or path, "
                        f"as a string), got {obj['model']!r}; set it in the header (e.g. "
                        '"model": "smollm2-135m-instruct") or ' + fix)
    if "cost_model" in obj:
        try:
            cost_coefficients(obj["cost_model"], f"{where}: header",
                              "pass --cost-model cpu|h100-7b|h200-7b|PATH.json, or " + fix,
                              prefix="cost_model.")
        except ValueError as e:
            raise UserError(str(e)) from None
    if "max_new_tokens" in obj and not (is_int(obj["max_new_tokens"])
                                        and obj["max_new_tokens"] >= 1):
        raise bad("max_new_tokens", "an integer >= 1")
    eng = obj.get("engine")
    if eng is not None:
        if not isinstance(eng, dict):
            raise bad("engine", "an object {max_slots, max_cache_len, draft_widths}")
        for k in ("max_slots", "max_cache_len"):
            if k in eng and not (is_int(eng[k]) and eng[k] >= 1):
                raise bad(f"engine.{k}", "an integer >= 1 (pass --batch / --slots to replay "
                          "other slots)" if k == "max_slots" else "an integer >= 1")
        if "draft_widths" in eng:
            w = eng["draft_widths"]
            if not (isinstance(w, list) and w and all(is_int(x) and x >= 1 for x in w)
                    and 1 in w):
                raise bad("engine.draft_widths", "a list of integers >= 1 that includes 1 "
                          "(or pass --draft-widths 1,4,8)")
    for key in ("das", "drafter_kwargs"):
        if key in obj and not isinstance(obj[key], dict):
            raise bad(key, "an object (the config's das: section)")
    ov = obj.get("overheads")
    if ov is not None:
        if not (isinstance(ov, dict) and all(is_seconds(v) for v in ov.values())):
            raise bad("overheads", "an object of finite numbers >= 0 (seconds; or pass "
                      "--no-overheads)")
    return {k: v for k, v in obj.items() if k != "type"}


def read_trace(path, *, need_header: bool = True) -> Trace:
    """The trace at `path` (`write_trace`'s JSON lines; gzip-compressed when the name ends in
    `.gz`): the one trace reader of every command (`bench replay`, `bench drafter --trace`,
    `draft-head fit / replay`, `plan --lengths`). Every line's structure is checked here: the
    header's fields that are present (`_check_header`), and each rollout's epoch and
    sample_index (integers >= 0), problem_id (string or integer), prompt_ids / token_ids (lists
    of token ids >= 0, the prompt not empty), temperature (a finite number >= 0) and
    finish_reason (a string). `need_header=False` (the drafter and head commands): a trace
    without a header line, and rollouts without sample_index (0), are accepted.

    Raises:
      UserError: one line naming the file (and line) and what is wrong, with the fix.
    """
    fix = "pass a trace written by `das-jax bench rollout` (DIR/trace.jsonl)"
    header: dict = {}
    rollouts = []
    for i, raw in enumerate(_trace_lines(path)):
        where = f"trace {path}:{i + 1}"
        try:
            line = raw.decode("utf-8")
            obj = json.loads(line) if line.strip() else None
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: invalid UTF-8 at byte {e.start} of the line, so not a "
                            f"rollout trace; {fix}") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg}), so not a rollout trace; {fix}"
                            ) from None
        except RecursionError:
            raise UserError(f"{where}: not a rollout trace: JSON nested too deeply; {fix}"
                            ) from None
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise UserError(f"{where}: not a rollout trace: the line is a JSON "
                            f"{type(obj).__name__}, not an object; {fix}")
        if obj.get("type") == "header":
            header = _check_header(obj, where)
            continue
        rollouts.append(_rollout(obj, where, need_header, fix))
    if not header and need_header:
        raise UserError(f"trace {path}: no header line (type=header) with the cost model; {fix}")
    if not rollouts:
        raise UserError(f"trace {path}: holds no rollouts; {fix}")
    return Trace(header, rollouts)


def _rollout(obj: dict, where: str, need_sample_index: bool, fix: str) -> TraceRollout:
    """One checked rollout line (see `read_trace`)."""

    def bad(key, want):
        if key not in obj:
            return UserError(f"{where}: not a rollout trace line: it has no {key} ({want}); "
                             f"{fix}")
        got = repr(obj[key])
        if len(got) > 60:
            got = got[:57] + "..."
        return UserError(f"{where}: not a rollout trace line: {key} must be {want}, got {got}"
                         f"; {fix}")
    for key in ("epoch", "sample_index"):
        if key == "sample_index" and key not in obj and not need_sample_index:
            continue
        if not (is_int(obj.get(key)) and obj[key] >= 0):
            raise bad(key, "an integer >= 0")
    pid = obj.get("problem_id")
    if not (isinstance(pid, str) or is_int(pid)):
        raise bad("problem_id", "a string or an integer")
    for key in ("prompt_ids", "token_ids"):
        if not _is_token_ids(obj.get(key)):
            raise bad(key, "a list of token ids (integers >= 0)")
    if not obj["prompt_ids"]:
        raise bad("prompt_ids", "a non-empty list of token ids")
    temp = obj.get("temperature", 0.0)
    if not (is_number(temp) and np.isfinite(temp) and temp >= 0):
        raise bad("temperature", "a finite number >= 0")
    reason = obj.get("finish_reason", "stop")
    if not isinstance(reason, str):
        raise bad("finish_reason", "a string (stop, length)")
    return TraceRollout(epoch=obj["epoch"], problem_id=pid,
                        sample_index=obj.get("sample_index", 0),
                        prompt_ids=tuple(obj["prompt_ids"]), token_ids=tuple(obj["token_ids"]),
                        finish_reason=reason, temperature=float(temp))


@dataclasses.dataclass
class SimStats(GenerateStats):
    """What one simulated `generate` call did (the engine's `GenerateStats`; times in seconds):
    decode_s is the cost model's prediction of the verify steps; host_s the measured host work
    of the engine's scheduler, drafter and policy on this machine (draft_s / policy_s are part
    of it); prefill_s 0 (priced by `device_s` from prefill_tokens). device_sync_s (realtime
    only): the host's wake-ups after the slept steps' ends (`SimulatedDevice`), in neither the
    host nor the device time."""

    device_sync_s: float = 0.0

    def device_s(self, overheads: dict | None = None) -> float:
        """Predicted time of the executor's calls: the verify steps (cost model) and, with
        `overheads`, the prefill (`prefill_s_per_token` x prefill tokens) and the executor's own
        host time per step (`host_s_per_step`: packing a step's arrays, dispatch)."""
        o = overheads or {}
        return (self.decode_s + float(o.get("prefill_s_per_token", 0.0)) * self.prefill_tokens
                + float(o.get("host_s_per_step", 0.0)) * self.forward_passes)

    def predicted_s(self, overheads: dict | None = None) -> float:
        """Predicted wall time: device time plus the exposed host time (the host work between
        steps, and the work overlapped with a step beyond the step's predicted time)."""
        return self.device_s(overheads) + self.host_s + self.exposed_overlap_s

    def summary(self, overheads: dict | None = None) -> dict:
        rows = sum(s.active for s in self.steps)
        slots = sum(s.step_shape()[0] for s in self.steps)
        return {"forward_passes": self.forward_passes, "generated_tokens": self.generated_tokens,
                "drafted_tokens": self.drafted_tokens,
                "accepted_draft_tokens": self.accepted_draft_tokens,
                "acceptance_length": self.acceptance_length, "decode_s": self.decode_s,
                "draft_s": self.draft_s, "policy_s": self.policy_s,
                "prefill_tokens": self.prefill_tokens, "prefill_calls": self.prefill_calls,
                "preemptions": self.preemptions,
                "mean_live_rows": rows / max(self.forward_passes, 1),
                "token_slots": slots,
                "live_token_slots": rows + sum(s.drafted for s in self.steps),
                "device_s": self.device_s(overheads), "host_s": self.host_s + self.overlap_s,
                "overlapped_host_s": self.overlap_s,
                "exposed_host_s": self.host_s + self.exposed_overlap_s,
                "device_sync_s": self.device_sync_s,
                "host_us_per_row": 1e6 * (self.host_s + self.overlap_s) / max(rows, 1),
                "total_s": self.predicted_s(overheads),
                "predicted_s": self.predicted_s(overheads)}


class SimulatedDevice:
    """The accelerator of a `realtime` replay: one thread that runs each step by sleeping until
    the step's end (its start plus the cost model's seconds) and then signals it, while the
    host runs the work it overlaps with the step and then waits for that signal, as an engine
    waits for a device step's outputs.

    `run` returns (exposed, sync) seconds: exposed, the host's overlapped work past the step's
    end (what the device waited for); sync, how long after the later of the step's end and
    the host's work the host resumed (the signal's and the OS timer's latency, ~0.1-0.4 ms on
    a VM: not host work, reported apart as `device_sync_s`). One thread serves every step, so
    no thread start is paid per step."""

    def __init__(self):
        self._deadlines: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="simulated-device",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (deadline := self._deadlines.get()) is not None:
            wait = deadline - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            self._done.set()

    def run(self, seconds: float, overlap=None) -> tuple[float, float]:
        """One step of `seconds` (>= 0), the callable `overlap` (or None; it may return the
        seconds of work it did) run on this thread meanwhile; returns (exposed, sync) seconds
        (class docstring): exposed is at most the overlap's work."""
        start = time.perf_counter()
        end = start + seconds
        self._done.clear()
        self._deadlines.put(end)
        work = 0.0
        if overlap is not None:
            t0 = time.perf_counter()
            spent = overlap()
            work = time.perf_counter() - t0 if spent is None else float(spent)
        host_done = time.perf_counter()
        self._done.wait()
        resumed = time.perf_counter()
        # at most the work itself: a preemption before it started (the device thread's wake-up
        # taking the GIL, another process) is not host work
        return min(max(0.0, host_done - end), work), max(0.0, resumed - max(end, host_done))

    def close(self) -> None:
        """Stops the thread (after its current step)."""
        self._deadlines.put(None)
        self._thread.join()


class TraceExecutor:
    """The replay's `scheduler.StepExecutor`: recorded rollouts instead of a model.

    Speculation never changes the sampled tokens, so the target token at every position is the
    recorded one: a row's draft is accepted up to its first disagreement with the recorded
    continuation (and never past the recorded end, where the row ends with its recorded
    finish reason). A verify step takes `cost_model.predict_step(num_tokens, attended_kv)`
    seconds; a prefill takes 0 here (its padded tokens are counted, `SimStats.predicted_s`
    prices them). Log-probs are 0. On a paged cache (`engine_config.kv_cache: paged`) a step's
    KV term is the pages its rows hold (`kv_read_page`, `schedule.pages_read_kv`), as the GPU
    and TPU kernels read them (the device the cost model describes), not the bucket.
    """

    def __init__(self, rollouts: Sequence[TraceRollout], engine_config: EngineConfig,
                 cost_model: CostModel, min_prompt_bucket: int | None = None,
                 realtime: bool = False):
        self.rollouts = rollouts
        self.ec = engine_config
        self.cost_model = cost_model
        self.realtime = realtime
        self.exposed_overlap_s = 0.0   # overlapped host work past its steps' predicted ends
        self.device_sync_s = 0.0       # realtime: wake-ups after the steps' ends
        self.device: SimulatedDevice | None = None
        self.min_prompt_bucket = min_prompt_bucket or engine_config.min_prompt_bucket
        self.kv_read_page = (int(engine_config.page_size)
                             if getattr(engine_config, "kv_cache", "dense") == "paged" else None)
        for i, r in enumerate(rollouts):
            if not r.token_ids:
                raise ValueError(f"trace rollout {i} (problem {r.problem_id!r}) has no tokens; "
                                 "a recorded rollout holds at least its first token")
        # every recorded rollout's tokens in one array (rollout ri at start_R[ri], len_R[ri])
        self.len_R = np.array([len(r.token_ids) for r in rollouts], np.int64)
        self.start_R = np.cumsum(self.len_R) - self.len_R
        self.tokens_T = np.concatenate([np.asarray(r.token_ids, np.int32) for r in rollouts])
        self.reason_R = np.array([r.finish_reason or "stop" for r in rollouts])

    def _end(self, ri: int, upto: int) -> str:
        r = self.rollouts[ri]
        return (r.finish_reason or "stop") if upto >= len(r.token_ids) else ""

    def start(self, batch: int, cache_len: int) -> None:
        self.S = cache_len
        self.prompt_rows = PromptRows(batch)   # the engine's prompt sharing, same decisions

    def prompt_of(self, request_id: int) -> tuple[int, ...]:
        """The token ids an admission of `request_id` prefills (its recorded prompt)."""
        return tuple(self.rollouts[request_id].prompt_ids)

    def prefill(self, request_ids, rows, batch) -> Prefilled:
        rows = np.asarray(rows)
        prompts = [self.prompt_of(i) for i in request_ids]
        computed = list(range(len(prompts)))
        share = getattr(self.ec, "share_prompts", False)
        if share:   # the engine's order: row copies, then the prefill, then the bookkeeping
            shared, sources, computed, _ = self.prompt_rows.split(prompts, rows)
            if shared:
                self._share(rows[shared], sources, [prompts[k] for k in shared])
        if computed:
            self._place(rows[computed], [prompts[k] for k in computed])
        if share:
            self.prompt_rows.admit(rows, prompts)
        tokens = 0
        if computed:
            tokens = prefill_layout([prompts[k] for k in computed], self.ec.batch_buckets,
                                    self.min_prompt_bucket, self.S,
                                    packed_batch=batch).tokens
        return Prefilled([self.rollouts[i].token_ids[0] for i in request_ids],
                         [0.0] * len(request_ids), 0.0, tokens,
                         [self._end(i, 1) for i in request_ids])

    def _share(self, rows, src_rows, prompts) -> None:
        """Rows `rows` take the prompts rows `src_rows` hold (the engine's row copy)."""

    def _place(self, rows, prompts) -> None:
        """Rows `rows` are prefilled with `prompts`."""

    def compact(self, live, new_batch) -> None:
        self.prompt_rows.compact(live, new_batch)

    def verify(self, st: StepInput) -> StepOutput:
        ri_A, g_A = np.asarray(st.request_ids), np.asarray(st.generated)
        n_draft_A = np.asarray(st.n_draft_B)[st.live].astype(np.int64)
        # The pending token is rec[g - 1]; the target token after it is rec[g], so draft token i
        # is accepted while it equals rec[g + i] (and the prefix before it was accepted), and
        # never past the recorded end.
        acc_A, rec_AxK1 = self._accepted(ri_A, g_A, st.drafts_AxK, n_draft_A)
        won_A = None
        if st.n_alt_B is not None and st.alt_AxK is not None:   # a two-branch token tree
            n_alt_A = np.asarray(st.n_alt_B)[st.live].astype(np.int64)
            acc_alt_A, rec_alt = self._accepted(ri_A, g_A, st.alt_AxK, n_alt_A)
            won_A = acc_alt_A > acc_A
            acc_A = np.maximum(acc_A, acc_alt_A)
            if rec_alt.shape[1] > rec_AxK1.shape[1]:
                rec_AxK1 = rec_alt
        n_A = acc_A + 1
        done_A = g_A + n_A >= self.len_R[ri_A]
        ends = np.where(done_A, self.reason_R[ri_A], "")
        seconds = float(self.cost_model.predict_step(st.num_tokens, st.attended_kv,
                                                     read_kv=st.read_kv))
        self._run_step(seconds, st.overlap)
        return StepOutput(rec_AxK1, np.zeros(rec_AxK1.shape, np.float32), n_A.astype(np.int32),
                          seconds, ends, won_A=won_A)

    def _accepted(self, ri_A, g_A, drafts_AxK, n_draft_A):
        """(accepted drafts per row, the recorded tokens `[A, K + 1]` from each row's pending
        position on): draft token i is accepted while it equals the recorded token after the
        accepted prefix, and never past the recorded end."""
        lim_A = np.minimum(n_draft_A, self.len_R[ri_A] - g_A - 1)
        K = drafts_AxK.shape[1]
        col = np.arange(K + 1)[None, :]
        pos_AxK1 = np.minimum(self.start_R[ri_A, None] + g_A[:, None] + col,
                              len(self.tokens_T) - 1)
        rec_AxK1 = self.tokens_T[pos_AxK1]
        miss_AxK = (drafts_AxK != rec_AxK1[:, :K]) | (col[:, :K] >= lim_A[:, None])
        acc_A = np.where(miss_AxK.any(axis=1), miss_AxK.argmax(axis=1), K) if K else \
            np.zeros(len(ri_A), np.int64)
        return acc_A, rec_AxK1


    def _run_step(self, seconds: float, overlap) -> None:
        """The device's time for a step of `seconds` and the host work `overlap` runs during
        it: priced (overlap past `seconds` is exposed), or with `realtime` lived on a
        `SimulatedDevice` (the overlap's work past the step's end is exposed; the wake-up
        after it is `device_sync_s`)."""
        if not self.realtime:
            if overlap is not None:
                self.exposed_overlap_s += max(0.0, overlap() - seconds)
            return
        if self.device is None:
            self.device = SimulatedDevice()
        exposed, sync = self.device.run(seconds, overlap)
        self.exposed_overlap_s += exposed
        self.device_sync_s += sync

    def close(self) -> None:
        """Stops the `SimulatedDevice` thread of a `realtime` replay (if one was started)."""
        if self.device is not None:
            self.device.close()
            self.device = None

    def decode(self, st: StepInput, steps: int, budget_A: np.ndarray,
               stop_ids: np.ndarray) -> StepOutput:
        """Up to `steps` plain decode steps (the engine's `DeviceExecutor.decode`): row j emits
        its recorded tokens until its recorded end, a stop token or budget_A[j]; every step the
        call runs costs a width-1 step of the whole call's shape (stopped rows are computed
        too)."""
        ri_A, g_A = np.asarray(st.request_ids), np.asarray(st.generated)
        col = np.arange(steps)[None, :]
        pos_AxK = np.minimum(self.start_R[ri_A, None] + g_A[:, None] + col,
                             len(self.tokens_T) - 1)
        rec_AxK = self.tokens_T[pos_AxK]
        n_A = np.minimum(np.minimum(self.len_R[ri_A] - g_A, budget_A), steps)
        if len(stop_ids):
            hit = np.isin(rec_AxK, stop_ids) & (col < n_A[:, None])
            n_A = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, n_A)
        done_A = g_A + n_A >= self.len_R[ri_A]
        ends = np.where(done_A, self.reason_R[ri_A], "")
        ran = int(n_A.max(initial=1))
        step_s = float(self.cost_model.predict_step(st.num_tokens, st.attended_kv,
                                                    read_kv=st.read_kv))
        self._run_step(ran * step_s, st.overlap)
        return StepOutput(rec_AxK, np.zeros(rec_AxK.shape, np.float32), n_A.astype(np.int32),
                          ran * step_s, ends)


class PagedTraceExecutor(PagedRows, TraceExecutor):
    """`TraceExecutor` on a paged KV cache (`engine_config.kv_cache: paged`): the engine's
    page pool bookkeeping (`engine.paged_rows.PagedRows`, as `PagedExecutor`) admits requests
    by free pages, shares a group's prompt pages, frees a finished row's pages and preempts
    the row admitted last when the pool (`kv_pages`, from `rollout.kv_memory_gb`) runs short;
    a preempted request is resumed by prefilling its prompt and the tokens it had committed
    (counted as prefill tokens). Steps are priced by the pages their rows read."""

    def start(self, batch: int, cache_len: int) -> None:
        super().start(batch, cache_len)
        self.start_pool(self.ec.paging(batch, cache_len), batch, cache_len)

    def request_prompt(self, request_id: int) -> tuple[int, ...]:
        return TraceExecutor.prompt_of(self, request_id)

    def shares_prompts(self) -> bool:
        return bool(getattr(self.ec, "share_prompts", False))

    def prefill(self, request_ids, rows, batch, resumed: dict | None = None) -> Prefilled:
        self.begin_admission(rows, resumed)
        try:
            return super().prefill(request_ids, rows, batch)
        finally:
            self.end_admission(request_ids, rows, resumed)

    def _share(self, rows, src_rows, prompts) -> None:
        self.share_prompts(rows, src_rows, prompts)

    def _place(self, rows, prompts) -> None:
        self.place_prompts(rows, prompts)

    def compact(self, live, new_batch) -> None:
        self.compact_pool(live, new_batch)
        super().compact(live, new_batch)

    def verify(self, st: StepInput) -> StepOutput:
        self.pool.ensure(st.live, st.cache_len_B[st.live] + 1 + st.n_draft_B[st.live])
        return super().verify(st)

    def decode(self, st: StepInput, steps: int, budget_A: np.ndarray,
               stop_ids: np.ndarray) -> StepOutput:
        self.pool.ensure(st.live, st.cache_len_B[st.live] + np.minimum(int(steps), budget_A))
        return super().decode(st, steps, budget_A, stop_ids)


def simulate(rollouts: Sequence[TraceRollout], engine_config: EngineConfig, max_new_tokens: int,
             cost_model: CostModel, drafter=None, policy=None, min_prompt_bucket: int | None = None,
             progress=None, realtime: bool = False) -> SimStats:
    """Replays one `Engine.generate` call over recorded rollouts (see the module docstring):
    the engine's own host scheduler (`das_jax.engine.run_schedule`) driving a `TraceExecutor`, so
    the admission, emission, compaction, buckets and the calls on `drafter` and `policy` are the
    engine's by construction. Request ids are the indices into `rollouts`, as in the engine.
    `realtime`: each device step is slept on another thread for its predicted seconds while
    the host runs the step's overlapped work (`SimulatedDevice`), so the exposed host time is
    measured (the call takes the predicted wall time; the wake-ups after the steps' ends are
    `SimStats.device_sync_s`); otherwise it is priced.

    Raises:
      ValueError: a rollout without tokens.
    """
    paged = getattr(engine_config, "kv_cache", "dense") == "paged"
    executor = (PagedTraceExecutor if paged else TraceExecutor)(rollouts, engine_config,
                                                                cost_model, min_prompt_bucket,
                                                                realtime)
    try:
        _, stats = run_schedule(rollouts, executor, engine_config, Limits(max_new_tokens),
                                drafter, policy, progress, keep_tokens=False, stats=SimStats())
    finally:
        executor.close()
    stats.exposed_overlap_s = executor.exposed_overlap_s
    stats.device_sync_s = executor.device_sync_s
    return stats


def das_from_header(header: dict, overrides: Sequence[str] = ()):
    """The `das:` settings (`DASSection`) a trace was recorded with (its header's "das"; older
    traces hold "drafter_kwargs": window, max_depth, min_token_prob), with `das.a.b=v`
    overrides applied (`bench replay --set`). Raises ConfigError for invalid settings or an
    override outside `das.`."""
    for text in overrides:
        if not text.startswith("das."):
            raise ConfigError(f"--set {text}: a replay takes only das.* settings (e.g. "
                              "das.policy.source_calibration=false)")
    raw = {"das": header.get("das", header.get("drafter_kwargs", {}))}
    return config_from_dict(apply_overrides(raw, overrides)).das


def replay_epochs(epochs: dict[int, list[TraceRollout]], names: Sequence[str],
                  engine_config: EngineConfig, max_new_tokens: int, coef: dict,
                  das=None, overheads: dict | None = None,
                  log=None, realtime: bool = False) -> dict[str, list[dict]]:
    """Replays every epoch for every speculation name (each keeps its drafter/policy across
    epochs), built from the `das:` settings `das` (`DASSection`; default: its defaults) with a
    DAS policy planning on the frozen cost model `coef`.

    Returns name -> [per-epoch summary dicts].
    """
    out: dict[str, list[dict]] = {}
    for name in names:
        cm = FrozenCostModel.of(coef)
        drafter, policy = build_speculation(name, das, cm)
        rows = []
        for e, rolls in epochs.items():
            st = simulate(rolls, engine_config, max_new_tokens, cm, drafter, policy,
                          realtime=realtime)
            if drafter is not None:
                drafter.advance_epoch()
            s = st.summary(overheads)
            s["epoch"] = e
            rows.append(s)
            if log:
                log(f"  replay {name:14} epoch {e}: predicted {s['predicted_s']:.2f}s "
                    f"(decode {st.decode_s:.2f}s), {st.forward_passes} passes, "
                    f"accept len {st.acceptance_length:.2f}")
        out[name] = rows
    return out


# ----------------------------------------------------------------------------- paper scale

def paper_workload(trace: Trace, problems: int = 128, samples: int = 16, max_tokens: int = 16384,
                   epochs: int | None = None, median_len: float = 4000.0, sigma: float = 0.8,
                   eos_id: int | None = None, seed: int = 0,
                   temperature: float | None = None) -> dict[int, list[TraceRollout]]:
    """A paper-scale workload (DAS paper: 16K max tokens, long tail) resampled from a trace's
    rollouts at `temperature` (None: the trace's lowest; ValueError when it holds none at it).

    * Problems: `problems` synthetic problems, problem q built from recorded problem
      q mod (recorded problems) (prompts shared, ids distinct).
    * Lengths: a per-problem factor f_q ~ LogNormal(log(median_len), sigma) (fixed over epochs:
      a problem's rollouts are long every epoch, which is what DAS's length classes predict), times
      a per-rollout jitter LogNormal(0, 0.3); clipped to [32, max_tokens]; rollouts that hit the
      cap finish by "length" (the tail), the others end with the recorded stop token.
    * Tokens: rollout (q, s) of epoch e concatenates recorded rollouts of the same recorded problem
      and epoch (its own sample first, then siblings in a seeded random order, with replacement,
      stop tokens dropped) until the target length. This keeps the recorded within-group and
      across-epoch redundancy the drafters exploit (an approximation of real long rollouts).
    """
    rng = np.random.default_rng(seed)
    temp = trace.temperature(temperature)
    by_epoch = trace.groups()[temp]
    epoch_ids = list(by_epoch)[: epochs or len(by_epoch)]
    src_pids = list(dict.fromkeys(r.problem_id for r in by_epoch[epoch_ids[0]]))
    factor = np.exp(rng.normal(np.log(median_len), sigma, size=problems))
    out: dict[int, list[TraceRollout]] = {}
    for e in epoch_ids:
        by_pid: dict[Any, list[TraceRollout]] = {}
        for r in by_epoch[e]:
            by_pid.setdefault(r.problem_id, []).append(r)
        rolls = []
        for q in range(problems):
            src = by_pid[src_pids[q % len(src_pids)]]
            for s in range(samples):
                target = int(np.clip(factor[q] * np.exp(rng.normal(0, 0.3)), 32, max_tokens))
                own = src[s % len(src)]
                stop = own.token_ids[-1] if own.finish_reason == "stop" else eos_id
                pieces, n = [], 0
                cur = own
                while n < target:
                    body = list(cur.token_ids[:-1] if cur.finish_reason == "stop" else cur.token_ids)
                    if not body:
                        body = list(cur.token_ids)
                    pieces.extend(body)
                    n += len(body)
                    cur = src[int(rng.integers(len(src)))]
                toks = pieces[:target]
                reason = "length"
                if target < max_tokens and stop is not None:
                    toks = toks[:target - 1] + [int(stop)]
                    reason = "stop"
                rolls.append(TraceRollout(e, f"paper-{q}", s, own.prompt_ids, tuple(toks), reason,
                                          temp))
        out[e] = rolls
    return out
