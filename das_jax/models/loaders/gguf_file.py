"""Loader for a llama.cpp GGUF file (architectures llama, qwen2, qwen3).

Tensors are dequantized with `gguf.quants.dequantize` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants it implements) and renamed to HF names, so `params_from_hf_tensors` builds
the params exactly as for a safetensors checkpoint. For `llama`, llama.cpp's convert script permutes
the rows of Q and K (`LlamaModel.permute`: rotary pairs interleaved instead of HF's first-half /
second-half layout); `unpermute_qk` undoes it. qwen2/qwen3 are written unpermuted.
The config comes from the `<arch>.*` metadata, the tokenizer + chat template from `tokenizer.*`.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from das_jax.models.config import ModelConfig, ModelConfigError, RopeScaling
from das_jax.models.errors import ModelLoadError
from das_jax.models.loaders.gguf_reader import REDOWNLOAD as _REDOWNLOAD
from das_jax.models.loaders.gguf_reader import open_gguf, read_metadata
from das_jax.models.tokenizer import Tokenizer

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor-name stem -> HF module name (".weight" / ".bias" suffixes carry over).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """HF tensor name for a GGUF tensor name (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`), or None for tensors das-jax does not use
    (e.g. `rope_freqs.weight`)."""
    m = _BLOCK_RE.match(name)
    if m:
        stem = _BLOCK_NAMES.get(m.group(2))
        return None if stem is None else f"model.layers.{m.group(1)}.{stem}.{m.group(3)}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (HF -> GGUF) of a `[n_head * K, ...]` Q or K weight."""
    dim = weights.shape[0] // n_head // 2
    return (weights.reshape(n_head, 2, dim, *weights.shape[1:]).swapaxes(1, 2)
            .reshape(weights.shape))


def unpermute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk` (GGUF -> HF); `n_head` is H for Q and KVH for K."""
    dim = weights.shape[0] // n_head // 2
    return (weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(1, 2)
            .reshape(weights.shape))


def config_from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str], source: str) -> ModelConfig:
    """`ModelConfig` from GGUF metadata (`<arch>.block_count`, `embedding_length`, ...).

    Raises:
      ModelLoadError: unsupported architecture, a missing key, or rope scaling das-jax cannot express.
      ModelConfigError: inconsistent sizes.
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported GGUF architecture {arch!r}; das-jax supports "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = KeyError):
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise ModelLoadError(f"{source}: GGUF metadata key {arch}.{name!r} is missing; "
                                 f"{_REDOWNLOAD}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        kv_heads = max(kv_heads)
    head_dim = key("attention.key_length", None)
    if head_dim is None:
        head_dim = key("rope.dimension_count", None)
    if head_dim is None:
        if hidden % heads:
            raise ModelLoadError(f"{source}: embedding_length={hidden} is not divisible by "
                                 f"head_count={heads} and no attention.key_length is given")
        head_dim = hidden // heads
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens.count")
    if vocab is None:
        raise ModelLoadError(f"{source}: no vocabulary size (no {arch}.vocab_size and no "
                             f"tokenizer.ggml.tokens); {_REDOWNLOAD}")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(f"{source}: per-frequency RoPE factors (rope_freqs.weight, Llama-3.1 "
                             "style scaling) are not supported in GGUF; load the HF safetensors "
                             "checkpoint instead")
    scaling = None
    stype = meta.get(f"{arch}.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise ModelLoadError(f"{source}: unsupported GGUF rope scaling {stype!r} (only linear)")
        scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor", 1.0)))
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        max_position_embeddings=int(key("context_length", 8192)),
    )


def tensor_getter(reader, config: ModelConfig, arch: str, source: str) -> Callable[[str], np.ndarray]:
    """`get(hf_name) -> float32 array` (HF `[out, in]` layout), dequantizing lazily and undoing the
    llama Q/K permutation.

    Raises (from `get`):
      KeyError: no such tensor.
      ModelLoadError: the tensor's data cannot be dequantized (truncated file, unknown quant type).
    """
    # deferred import: gguf (not loaded by importing this module)
    from gguf import quants

    by_hf = {}
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf is not None:
            by_hf[hf] = t

    def get(name: str) -> np.ndarray:
        t = by_hf[name]
        try:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise ModelLoadError(f"{source}: tensor {t.name!r} uses quantization "
                                 f"{t.tensor_type.name}, which gguf cannot dequantize; re-convert "
                                 "to F16/Q8_0/Q4_0/Q4_1") from None
        except Exception as e:
            raise ModelLoadError(f"{source}: cannot read tensor {t.name!r} ({e}); {_REDOWNLOAD}") from None
        if arch == "llama" and name.endswith("weight"):
            if ".self_attn.q_proj." in name:
                w = unpermute_qk(w, config.num_heads)
            elif ".self_attn.k_proj." in name:
                w = unpermute_qk(w, config.num_kv_heads)
        return w

    return get


def eos_ids_from_metadata(meta: dict[str, Any]) -> list[int]:
    """End-of-generation ids named by the metadata (eos, eot, eom), in that order."""
    return [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]


def load_gguf(path: str, dtype):
    """Loads `(ModelConfig, params, Tokenizer)` from a GGUF file.

    Raises:
      ModelLoadError / WeightsError / ModelConfigError naming the file.
    """
    # deferred import: jax (not loaded by importing this module)
    from das_jax.models.convert import params_from_hf_tensors

    reader = open_gguf(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    try:
        config = config_from_gguf_metadata(meta, names, path)
    except ModelConfigError as e:
        raise ModelConfigError(f"{path}: {e}") from None
    params = params_from_hf_tensors(config, tensor_getter(reader, config, meta["general.architecture"],
                                                         path), dtype=dtype, source=path)
    tokenizer = Tokenizer.from_gguf(path, eos_ids_from_metadata(meta), reader=reader)
    return config, params, tokenizer
