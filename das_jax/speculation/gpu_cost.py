"""Step-cost models of a 7B bf16 model on H100 SXM and H200, derived from published figures.

The cost model (`cost_model.CostModel`) is t(N, K) = c_base + c_tok * N + c_kv * K for a verify
step that computes N token slots attending K cached positions in total. Each coefficient is
derived here from the model's shapes and the GPU's datasheet figures, not fitted or invented.

Model: Qwen2-7B (the shape of DeepSeek-R1-Distill-Qwen-7B, the DAS paper's math model), from its
`config.json` (huggingface.co/Qwen/Qwen2-7B): 28 layers, hidden 3584, MLP 18944, 28 query heads
and 4 KV heads of 128, vocab 152064, untied embeddings, bf16 weights and KV cache.

* Weights streamed per step: every layer's q/k/v/o projections (with q/k/v biases), the gated
  MLP (3 x 3584 x 18944) and the norms, plus the lm_head (152064 x 3584): 7.07 G parameters,
  14.14 GB in bf16 (the input embedding reads only N rows). `weight_bytes` computes it.
* FLOPs per token slot: 2 per multiply-accumulate over the same matmul weights: 14.14 GFLOP.
  (Attention FLOPs are charged to the KV term below.)
* KV bytes per cached position per row: 28 layers x (K and V) x 4 heads x 128 x 2 bytes =
  57,344 B. With grouped-query attention (7 query heads per KV head), scoring one position
  costs 4 x 28 x 28 x 128 = 0.40 MFLOP per query token against 57 KB read: 7 FLOP/byte for a
  plain decode row, 112 FLOP/byte for a 16-token draft row -- below the ridge point of both GPUs
  (989 TFLOP/s / 3.35 TB/s = 295 FLOP/B on H100; 206 on H200), so the KV term is a bandwidth
  term.

GPU figures (NVIDIA datasheets; H100: nvidia.com/en-us/data-center/h100, H200:
nvidia.com/en-us/data-center/h200; dense = the datasheet's sparse figure / 2):

| GPU      | HBM bandwidth | dense bf16 Tensor Core |
|----------|---------------|------------------------|
| H100 SXM | 3.35 TB/s     | 989 TFLOP/s            |
| H200     | 4.8 TB/s      | 989 TFLOP/s (same GH100 die, same clocks) |

Stated utilisations (assumptions, each with its basis):

* HBM efficiency 0.90 of the datasheet bandwidth for long streaming reads (weights, KV): a
  device-to-device copy measured ~4.3 TB/s on the H200 lent to this project
  (0.9 x 4.8), and a CUDA-graph decode step of Llama-3.1-8B (16 GB of bf16 weights) is
  reported at 5.1 ms on an H100 SXM, i.e. ~0.94 of 3.35 TB/s.
* Tensor Core utilisation 0.60 of dense peak for the verify GEMMs (M = N tokens from tens to a
  few thousand, K/N = 3584..18944): a large bf16 matmul measured ~790 TFLOP/s (0.80) on the
  lent H200; skinnier M and the non-GEMM work (norms, rotary, SiLU) bring it down.
* Fixed per-step overhead 0.5 ms: about 28 x ~15 = 420 kernels back to back in one compiled
  XLA executable (~1 us of launch gap each when not graph-captured per kernel) plus one host
  round trip for the sampled tokens.
* Logits: float32 [N, 152064] written and read twice by the sampler (softmax, inverse CDF),
  3 x 608 KB per token slot, charged to c_tok at the HBM efficiency.

Resulting coefficients (`PRESETS`, recomputed by `derive`):

    c_base = weight_bytes / (0.9 BW) + 0.5 ms
    c_tok  = 2 * matmul_params / (0.6 * 989 TFLOP/s) + 3 * 4 * vocab / (0.9 BW)
    c_kv   = kv_bytes_per_position / (0.9 BW)

| model    | c_base  | c_tok    | c_kv     | N where c_tok * N = c_base |
|----------|---------|----------|----------|----------------------------|
| h100-7b  | 5.19 ms | 24.4 us  | 19.0 ns  | ~212 token slots           |
| h200-7b  | 3.77 ms | 24.2 us  | 13.3 ns  | ~156 token slots           |

Regimes: below ~200 token slots a step is memory-bound (weights), above it compute-bound (token
slots); at long contexts the KV term dominates both (256 rows x 4K positions = 1M positions =
20 ms on H100 against 5 ms of weights). A linear sum (not a max) of the memory and compute terms
assumes no overlap between streaming the weights and the math: exact in both limits, at most 2x
pessimistic at the ridge point.

`cpu` holds the coefficients fitted on the project's 2-core CPU with SmolLM2-135M in float32
(`PRESETS["cpu"]`): a compute-bound regime, where each verified token slot costs a sizeable
fraction of a step.
"""
from __future__ import annotations

import dataclasses
import os

from das_jax.speculation.cost_file import load_cost_model

__all__ = ["ModelShape", "GPUSpec", "QWEN2_7B", "H100_SXM", "H200", "derive", "PRESETS",
           "resolve_cost_model"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shapes (bytes_per_param: 2 for bf16)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qkv_bias: bool = True
    bytes_per_param: int = 2

    def matmul_params(self) -> int:
        """Weights every token slot multiplies (projections, MLP, lm_head)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * self.intermediate
        return self.layers * per_layer + self.vocab * d

    def weight_bytes(self) -> int:
        """Bytes of weights one step streams: matmul weights, q/k/v biases, norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        extra = self.layers * ((q + 2 * kv) * self.qkv_bias + 2 * self.hidden) + self.hidden
        return (self.matmul_params() + extra) * self.bytes_per_param

    def kv_bytes_per_position(self) -> int:
        """K and V of one cached position of one row, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures: HBM bandwidth (bytes/s) and dense bf16 Tensor Core FLOP/s."""

    name: str
    hbm_bytes_per_s: float
    bf16_dense_flops: float


QWEN2_7B = ModelShape(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                      head_dim=128, vocab=152064)
H100_SXM = GPUSpec("H100 SXM", 3.35e12, 989.4e12)
H200 = GPUSpec("H200", 4.8e12, 989.4e12)

HBM_EFFICIENCY = 0.90
TENSOR_UTILISATION = 0.60
STEP_OVERHEAD_S = 0.5e-3
LOGIT_PASSES = 3          # float32 logits written once, read twice by the sampler


def derive(model: ModelShape, gpu: GPUSpec, hbm_efficiency: float = HBM_EFFICIENCY,
           tensor_utilisation: float = TENSOR_UTILISATION,
           step_overhead_s: float = STEP_OVERHEAD_S) -> dict:
    """{"c_base", "c_tok", "c_kv"} in seconds for `model` on `gpu` (module docstring)."""
    bw = gpu.hbm_bytes_per_s * hbm_efficiency
    flops = gpu.bf16_dense_flops * tensor_utilisation
    return {"c_base": model.weight_bytes() / bw + step_overhead_s,
            "c_tok": 2 * model.matmul_params() / flops + LOGIT_PASSES * 4 * model.vocab / bw,
            "c_kv": model.kv_bytes_per_position() / bw}


PRESETS: dict[str, dict] = {
    "cpu": {"c_base": 0.025, "c_tok": 1.5e-3, "c_kv": 6e-6},
    "h100-7b": derive(QWEN2_7B, H100_SXM),
    "h200-7b": derive(QWEN2_7B, H200),
}


def resolve_cost_model(spec: str) -> dict:
    """{"c_base", "c_tok", "c_kv"} for a preset name (`PRESETS`) or a cost-model file path.

    Raises:
      ValueError: one line naming `spec` and the valid choices (or what is wrong with the file).
    """
    if spec in PRESETS:
        return dict(PRESETS[spec])
    if spec.endswith(".json") or os.path.sep in spec or os.path.exists(spec):
        return load_cost_model(spec)
    raise ValueError(f"unknown cost model {spec!r}; valid: {', '.join(PRESETS)} or the path of "
                     "a cost-model .json file")
