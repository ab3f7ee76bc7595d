"""What the GPU lease check (`das_jax.bench.gpu_lease_check`) runs and what it costs, host
code only (no jax): its shapes (`FULL` on one H200, `SMOKE` on the CPU), the estimate of a full
run's seconds from counts and stated GPU figures (`estimate_seconds`, `FIGURES`), and the HLO
heuristic of whether a layer scan copies each layer's weights (`weight_copy_heuristic`).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from das_jax.speculation.gpu_cost import H200, QWEN2_7B, derive

BUDGET_S = 480.0

# Stated GPU figures (assumptions, not measurements; a lease's JSON measures each of them) that
# the estimate multiplies the counts by. Seconds.
FIGURES = {
    "startup_s": 30.0,       # python + jax import, CUDA init, random 7B bf16 params (one jit)
    "compile_s": {"engine": 15.0,         # a 7B verify / prefill program (one scan body, GEMM
                                          # autotuning of its ~10 shapes; measured 1.4-3.7 s)
                  "engine_unrolled": 60.0,  # the same with the layer loop unrolled (43 s)
                  "copy": 3.0,            # prompt sharing, compaction (no weights)
                  "train_kernel": 60.0,   # gradient kernel, T=4096, remat full (~4x verify)
                  "update": 10.0,         # the optimizer update of 7.6B params (elementwise)
                  "other": 0.3},          # small eager ops (zeros, casts, init)
    "step_vs_model": 2.0,    # a verify step at 2x the h200-7b model's time (pessimistic)
    "train_step_s": 2.5,     # 3x (6 x 7.6e9 x 4096 FLOP x 4/3 remat at 0.3 x 989 TFLOP/s: 0.84 s)
    "host_step_s": 0.01,     # host time of one generate step (das on this CPU: ~10 ms)
    "hlo_text_s": 5.0,       # as_text() of one 7B program and the heuristic
    "lower_s": 5.0,          # tracing the train kernel again for the cuDNN check (no compile)
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes of one run. verify: (B rows, N slots, W width, A attended positions) per
    program on a `cache_len`-position cache; share_width: prompt positions copied per row;
    gather_to: rows after compaction; gen_*: generate's requests (problems x samples, prompt
    tokens, new tokens), slots and compiled draft widths; cost_source: the das policy's prior;
    layer_programs: the verify programs timed again with the unrolled layer loop; host_*: the
    host-loop part's rows (one run per entry, groups of host_samples), prompt and new tokens;
    paged_case: (B, KVH, G, K, page, kv_len) of the paged-attention kernel check, at each of
    paged_widths (query tokens per row); paged_tunings: the Triton kernel's launch shapes timed
    there ((pages_per_block, split_pages, max_splits, num_warps, num_stages) each, the
    fastest kept for the verify steps; `paged_attention.GpuKernelTuning`)."""

    model: str
    dtype: str
    cache_len: int
    verify: tuple
    repeats: int = 10
    share_rows: int = 32
    share_width: int = 1024
    gather_to: int = 16
    train_len: int = 4096
    gen_problems: int = 4
    gen_samples: int = 8
    gen_prompt: int = 1040
    gen_new: int = 128
    gen_slots: int = 32
    gen_widths: tuple = (1, 8)
    cost_source: str = "h200-7b"
    ab_timeout_s: int = 240
    layer_programs: tuple = (0, 1)
    host_rows: tuple = (32, 128)
    host_samples: int = 8
    host_prompt: int = 256
    host_new: int = 200
    paged_case: tuple = (32, 4, 7, 128, 16, 16384)
    paged_widths: tuple = (1, 8)
    paged_tunings: tuple = ((1, 1 << 20, 1, 4, 2), (1, 64, 16, 4, 2), (2, 64, 16, 4, 2),
                            (4, 64, 16, 4, 2), (8, 64, 16, 4, 2), (4, 32, 32, 4, 2),
                            (4, 16, 64, 4, 2), (4, 128, 8, 4, 2), (4, 64, 16, 8, 2),
                            (4, 64, 16, 4, 3), (8, 32, 32, 8, 3))
    profile_top: int = 40
    profile_programs: tuple = (0, 2)


FULL = Shapes("qwen2-7b", "bfloat16", 17408,
              ((32, 32, 1, 16384), (32, 256, 8, 16384), (32, 32, 1, 2048), (8, 8, 1, 16384)))
SMOKE = Shapes("tiny", "float32", 64, ((4, 4, 1, 48), (4, 16, 4, 48), (4, 4, 1, 16), (2, 2, 1, 48)),
               share_rows=4, share_width=16, gather_to=2, train_len=64, cost_source="cpu",
               ab_timeout_s=180, layer_programs=(0,), host_rows=(4, 8), host_samples=4,
               host_prompt=12, host_new=24, paged_case=(4, 2, 2, 8, 4, 48), paged_widths=(1, 3),
               paged_tunings=((1, 1 << 20, 1, 4, 2), (2, 4, 4, 4, 2)))


def expected_counts(shapes: Shapes = FULL) -> dict:
    """The counts a full run reaches (the start-of-run estimate; a smoke measures its own):
    generate's two runs take `gen_new` steps of `gen_slots` rows each, attending at most 25%
    above prompt + new tokens (the attended-length bucket)."""
    steps = shapes.repeats + 1
    passes = 2 * shapes.gen_new
    kv = int(1.25 * (shapes.gen_prompt + shapes.gen_new))
    return {
        "verify": {"compiles": {"engine": len(shapes.verify), "other": 8},
                   "verify_steps": [steps] * len(shapes.verify)},
        "hlo": {"compiles": {"engine": 1, "other": 8}, "verify_steps": [steps],
                "subprocesses": 1, "hlo_texts": 1},
        "share": {"compiles": {"copy": 2}},
        "train": {"compiles": {"train_kernel": 2, "update": 1, "engine": 2, "copy": 1,
                               "other": 20}, "train_steps": 2, "lowerings": 1},
        "layers": {"compiles": {"engine": 1, "engine_unrolled": len(shapes.layer_programs),
                                "other": 8},
                   "verify_steps": [(2 * len(shapes.layer_programs) + 1) * steps],
                   "hlo_texts": 2 * len(shapes.layer_programs) + 1},
        "host": {"compiles": {"engine": 4 * len(shapes.host_rows), "other": 10},
                 "device_steps": [[4 * shapes.host_new * sum(shapes.host_rows), 0,
                                   4 * shapes.host_new * len(shapes.host_rows)]],
                 "host_steps": 4 * shapes.host_new * len(shapes.host_rows)},
        "profile": {"compiles": {"other": 2}, "verify_steps": [steps + 2]},
        "paged": {"compiles": {"engine": 3, "other": (3 + 2 * len(shapes.paged_tunings))
                               * len(shapes.paged_widths)},
                  "verify_steps": [3 * steps]},
        "generate": {"compiles": {"engine": 4, "copy": 1, "other": 5},
                     "device_steps": [[passes * shapes.gen_slots,
                                       passes * shapes.gen_slots * kv, passes]],
                     "host_steps": passes},
    }


def estimate_seconds(counts: dict, shapes: Shapes = FULL, figures: dict = FIGURES) -> dict:
    """Seconds of a full run on one H200: start-up + per part sum over kinds of count x figure.

    counts: {part: {"compiles": {kind: n}, "verify_steps": [calls of program i of
      `shapes.verify`], "device_steps": [[token slots, attended positions, steps]],
      "train_steps", "host_steps", "subprocesses", "hlo_texts", "lowerings": n}}.
    A verify step costs `step_vs_model` x the h200-7b model (c_base + c_tok N + c_kv B A).
    Returns {"seconds", "per_part": {part: s}, "budget_s", "fits", "figures"}."""
    c = derive(QWEN2_7B, H200)
    ratio = figures["step_vs_model"]
    per = {"startup": figures["startup_s"]}
    for part, k in counts.items():
        s = sum(n * figures["compile_s"].get(kind, figures["compile_s"]["other"])
                for kind, n in k.get("compiles", {}).items())
        for (B, N, _, A), n in zip(shapes.verify, k.get("verify_steps", [])):
            s += n * ratio * (c["c_base"] + c["c_tok"] * N + c["c_kv"] * B * A)
        for slots, positions, n in k.get("device_steps", []):
            s += ratio * (n * c["c_base"] + c["c_tok"] * slots + c["c_kv"] * positions)
        s += k.get("train_steps", 0) * figures["train_step_s"]
        s += k.get("host_steps", 0) * figures["host_step_s"]
        s += k.get("subprocesses", 0) * figures["startup_s"]
        s += k.get("hlo_texts", 0) * figures["hlo_text_s"]
        s += k.get("lowerings", 0) * figures["lower_s"]
        per[part] = s
    total = sum(per.values())
    return {"seconds": total, "per_part": per, "budget_s": BUDGET_S, "fits": total <= BUDGET_S,
            "figures": figures}


def weight_copy_heuristic(hlo: str, params) -> dict:
    """A heuristic, labelled as such: in optimised HLO text, the `dynamic-slice`s (a layer scan)
    and static `slice`s (an unrolled loop) of a stacked layer weight (leading axis L) that are
    materialised (unfused,
    a fusion's root, or in a fusion that only moves data), i.e. each layer's weights copied
    before use; their bytes per iteration and per step (x L); `copy` ops of a whole stack; and
    dynamic-slice fusions (what the GPU flag makes: a GEMM reading the slice in place)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):   # per-layer buffers: no stack to slice
        layers = {}
    L = next(iter(layers.values())).shape[0] if layers else 0
    short = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
    stacks = {(short.get(x.dtype.name, x.dtype.name), int(np.prod(x.shape)))
              for x in layers.values()}
    item = {"bf16": 2, "f16": 2, "f32": 4}
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo))
    instr = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)"
                       r"\((?:\w+\[[\d,]*\]\S*\s+)?%?([\w.\-]*)")
    shapes, lines, comp = {}, [], None
    for line in hlo.splitlines():   # names are unique in a module: shape of every value
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith((" ", "HloModule")):
            comp = head.group(1)
        elif m := instr.match(line):
            root, name, dt, dims, op, arg = m.groups()
            shapes[name] = (dt, [int(d) for d in dims.split(",") if d])
            lines.append((comp, bool(root), dt, shapes[name][1], op, arg))
    ops: dict = {}
    for comp, *_, op, _ in lines:
        ops.setdefault(comp, set()).add(op)
    moves = {"parameter", "constant", "dynamic-slice", "bitcast", "reshape", "copy", "convert",
             "transpose", "broadcast", "slice"}
    out = dict(stack_dynamic_slices=0, stack_static_slices=0, materialised_slices=0, stack_copies=0,
               materialised_bytes_per_layer=0)
    for comp, root, dt, dims, op, arg in lines:
        odt, odims = shapes.get(arg, ("", []))
        if op not in ("copy", "dynamic-slice", "slice") or not odims or odims[0] != L or (
                odt, int(np.prod(odims))) not in stacks:
            continue
        if op == "copy":
            out["stack_copies"] += 1
            continue
        out["stack_dynamic_slices" if op == "dynamic-slice" else "stack_static_slices"] += 1
        if root or comp not in fused or ops[comp] <= moves:
            out["materialised_slices"] += 1
            out["materialised_bytes_per_layer"] += item.get(dt, 4) * int(np.prod(dims))
    out["per_step_copy_bytes"] = out["materialised_bytes_per_layer"] * L
    out["dynamic_slice_fusions"] = len(re.findall(
        r"dynamic_address_computation|dynamic_slice_fusion|DynamicSliceFusion", hlo))
    out["while_loops"] = len(re.findall(r"\bwhile\(", hlo))
    out["likely_per_layer_weight_copies"] = out["materialised_slices"] > 0
    out["heuristic"] = ("regex over the optimised HLO text: dynamic-slices of an [L, ...] layer "
                        "weight that are unfused, a fusion's root or in a data-movement-only "
                        "fusion count as materialised copies")
    return out
