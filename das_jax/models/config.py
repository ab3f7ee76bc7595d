"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 decoder family.

The config is hashable so it can be a static argument of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class ModelConfigError(ValueError):
    """A model config that cannot describe a valid model (names the field and the fix)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as found in HF configs (`rope_scaling` / `rope_parameters`).

    rope_type: "linear" (positions divided by `factor`) or "llama3" (Llama-3.1 wavelength-dependent
    scaling, Meta's `apply_scaling`).
    """

    rope_type: str = "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ContractionPolicy:
    """How the model's contractions are computed (a static, hashable part of `ModelConfig`).

    mode: "fast" (plain `jnp.einsum`, the default) or "exact": every contraction feeding a
      token's logits is shape-invariant across batch buckets, draft widths, attended-length and
      prefill buckets (`das_jax.models.contraction`), so rollouts are token-identical with and
      without speculation.
    kv_block: keys per attention block in exact mode (attention reduces over fixed-size blocks).
    max_probe_rows: largest row count the exact-mode probe tries (a power of two).
    """

    mode: str = "fast"
    kv_block: int = 128
    max_probe_rows: int = 64

    def __post_init__(self):
        if self.mode not in ("fast", "exact"):
            raise ModelConfigError(f"contraction mode must be 'fast' or 'exact', got {self.mode!r}")
        for name in ("kv_block", "max_probe_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 2 or v & (v - 1):
                raise ModelConfigError(f"contraction {name} must be a power of two >= 2, got {v!r}")

    @property
    def exact(self) -> bool:
        return self.mode == "exact"


#: `ModelConfig.layer_loop` values.
LAYER_LOOPS = ("scan", "unroll")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (Llama family with switches).

    Attributes:
      architecture: HF architecture name, one of `SUPPORTED_ARCHITECTURES`.
      vocab_size: V, number of token ids.
      hidden_size: D, residual width.
      intermediate_size: F, SwiGLU hidden width.
      num_layers: L.
      num_heads: H, query heads.
      num_kv_heads: KVH, key/value heads (GQA); must divide H.
      head_dim: K, per-head width (default D // H).
      rope_theta: RoPE base.
      rope_scaling: optional `RopeScaling`.
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: the LM head reuses the embedding matrix.
      layer_loop: how the forward runs the stacked layers (`LAYER_LOOPS`): "scan" (one
        `lax.scan`, each layer's weights a dynamic slice of the stacked arrays: compiles once per
        program whatever L) or "unroll" (a Python loop, each layer's weights a static slice:
        L copies of the layer in the program, longer compiles; for backends whose matmul
        kernels copy a dynamic slice of their operand, see `das_jax.models.layer_loop`).
      attention_bias: q/k/v projections have biases (Qwen2).
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3).
      max_position_embeddings: the model's trained context length (informational).
      contraction: `ContractionPolicy` (fast by default; the engine sets exact mode).
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    contraction: ContractionPolicy = ContractionPolicy()
    layer_loop: str = "scan"

    def __post_init__(self):
        if self.layer_loop not in LAYER_LOOPS:
            raise ModelConfigError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got "
                                   f"{self.layer_loop!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {self.architecture!r}; das-jax supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}: grouped-query attention needs KV heads to divide query heads")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    # ----- derived quantities -------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """Query heads per KV head (G = H / KVH)."""
        return self.num_heads // self.num_kv_heads

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies, float32 `[head_dim // 2]`, after scaling (HF semantics)."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        rs = self.rope_scaling
        if rs is None or rs.rope_type == "default":
            pass
        elif rs.rope_type == "linear":
            inv_freq = inv_freq / rs.factor
        elif rs.rope_type == "llama3":
            low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
            high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv_freq = np.where(medium, smoothed, scaled)
        else:
            raise ModelConfigError(
                f"unsupported rope_scaling type {rs.rope_type!r}; supported: linear, llama3")
        return inv_freq.astype(np.float32)

    def num_params(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
        h, kvh = self.num_heads, self.num_kv_heads
        per_layer = d * (h + 2 * kvh) * k + h * k * d + 3 * d * f + 2 * d
        if self.attention_bias:
            per_layer += (h + 2 * kvh) * k
        if self.qk_norm:
            per_layer += 2 * k
        total = self.vocab_size * d + self.num_layers * per_layer + d
        if not self.tie_word_embeddings:
            total += self.vocab_size * d
        return total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Builds a config from an HF `config.json` dict.

        Raises:
          ModelConfigError: unsupported architecture, missing keys, or head sizes that do not divide
            (the message names `source`).
        """
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {
            "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        }.get(hf.get("model_type", ""), hf.get("model_type", "<missing>"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: unsupported architecture {arch!r}; das-jax supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            head_dim = hf.get("head_dim")
            if head_dim is None:
                if hidden % heads:
                    raise ModelConfigError(
                        f"{source}: hidden_size={hidden} is not divisible by num_attention_heads="
                        f"{heads} and no head_dim is given; fix the config")
                head_dim = hidden // heads
            rope = hf.get("rope_scaling") or None
            params = hf.get("rope_parameters") or {}
            theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
            if rope is None and params.get("rope_type", "default") not in ("default", None):
                rope = params
            scaling = None
            if rope:
                rtype = rope.get("rope_type", rope.get("type", "default"))
                if rtype != "default":
                    scaling = RopeScaling(
                        rope_type=rtype, factor=float(rope.get("factor", 1.0)),
                        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                        original_max_position_embeddings=int(
                            rope.get("original_max_position_embeddings", 8192)))
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rope_theta=float(theta),
                rope_scaling=scaling,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            )
        except KeyError as e:
            raise ModelConfigError(f"{source}: required key {e.args[0]!r} is missing") from None
        except ModelConfigError as e:
            if str(e).startswith(source):
                raise
            raise ModelConfigError(f"{source}: {e}") from None
