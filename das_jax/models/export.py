"""das-jax params -> a Hugging Face model directory (the inverse of the HF-directory loader).

`save_hf_model(out, config, params, tokenizer, dtype)` writes what `transformers`'
`AutoModelForCausalLM.from_pretrained(out)` / `AutoTokenizer.from_pretrained(out)`, vLLM and
lm-eval read:

    config.json                      the source model's architecture (`LlamaForCausalLM`,
                                     `Qwen2ForCausalLM` or `Qwen3ForCausalLM`) from `ModelConfig`
    generation_config.json           bos / eos (every stop id das-jax uses) / pad ids
    model.safetensors                the weights, HF names and `[out, in]` layout; above
      or model-0000i-of-0000n.safetensors + model.safetensors.index.json   `max_shard_bytes`
    tokenizer.json, tokenizer_config.json (with the chat template)

The weights are `params_from_hf_tensors` run backwards: das-jax keeps einsum-ready `[in, ...out]`
tensors stacked over layers; HF keeps one `[out, in]` matrix per layer. Q/K rows need no
permutation: the GGUF loader already undid llama.cpp's rotary permutation, so das-jax params are
in HF's rotary layout whatever the source. A tied model writes no `lm_head.weight`; Qwen2 writes
its q/k/v biases, Qwen3 its q/k norms. Loading the directory back with `das_jax.models.load`
gives the same params (in the exported dtype).

This module imports no jax: params may be numpy or jax arrays.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

import numpy as np

from das_jax.models.config import ModelConfig
from das_jax.models.errors import ModelLoadError

EXPORT_DTYPES = ("float32", "bfloat16")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000 ** 3   # transformers' former default max_shard_size ("5GB")
# Keys transformers writes into tokenizer_config.json that describe how the tokenizer was loaded
# here, not the tokenizer itself.
_LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only", "name_or_path", "_commit_hash")


class ExportError(ModelLoadError):
    """Params that do not fit the model config, or a tokenizer that cannot be written as HF files
    (the message names the tensor or the tokenizer and the fix)."""


def _file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"unsupported export dtype {dtype!r}; use float32 or bfloat16")
    if dtype == "bfloat16":
        # deferred import: ml_dtypes (a jax dependency; numpy has no bfloat16 of its own)
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32)


# ----- weights ------------------------------------------------------------------------------------

def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor the model's HF checkpoint holds, in the order they
    are written (embedding, layers, final norm, lm_head when untied)."""
    c = config
    D, H, KVH, K, F, V = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                          c.intermediate_size, c.vocab_size)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "self_attn.q_proj.weight"] = (H * K, D)
        out[p + "self_attn.k_proj.weight"] = (KVH * K, D)
        out[p + "self_attn.v_proj.weight"] = (KVH * K, D)
        if c.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (H * K,)
            out[p + "self_attn.k_proj.bias"] = (KVH * K,)
            out[p + "self_attn.v_proj.bias"] = (KVH * K,)
        out[p + "self_attn.o_proj.weight"] = (D, H * K)
        if c.attention_bias and c.architecture != "Qwen2ForCausalLM":
            # HF's Llama / Qwen3 `attention_bias` also gives o_proj a bias; das-jax has none (0).
            out[p + "self_attn.o_proj.bias"] = (D,)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (K,)
            out[p + "self_attn.k_norm.weight"] = (K,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        out[p + "mlp.gate_proj.weight"] = (F, D)
        out[p + "mlp.up_proj.weight"] = (F, D)
        out[p + "mlp.down_proj.weight"] = (D, F)
    out["model.norm.weight"] = (D,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    return out


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    L, D, H, KVH, K, F = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                          c.intermediate_size)
    shapes = {"attn_norm": (L, D), "mlp_norm": (L, D), "wq": (L, D, H, K), "wk": (L, D, KVH, K),
              "wv": (L, D, KVH, K), "wo": (L, H, K, D), "w_gate": (L, D, F), "w_up": (L, D, F),
              "w_down": (L, F, D)}
    if c.attention_bias:
        shapes.update(bq=(L, H, K), bk=(L, KVH, K), bv=(L, KVH, K))
    if c.qk_norm:
        shapes.update(q_norm=(L, K), k_norm=(L, K))
    return shapes


def check_params(config: ModelConfig, params: Mapping[str, Any], source: str = "params") -> None:
    """Checks that `params` has exactly the leaves and shapes of `config`'s das-jax layout.

    Raises:
      ExportError: a missing or unexpected leaf, or a leaf of another shape (names it and
        `source`).
    """
    c = config
    want: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.hidden_size),
                                        "final_norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        want["lm_head"] = (c.vocab_size, c.hidden_size)
    want.update({f"layers/{k}": s for k, s in _layer_shapes(c).items()})
    have: dict[str, tuple[int, ...]] = {}
    if not isinstance(params, Mapping):
        raise ExportError(f"{source}: params are a {type(params).__name__}, not a dict of arrays")
    for k, v in params.items():
        if k == "layers" and isinstance(v, Mapping):
            have.update({f"layers/{n}": tuple(np.shape(a)) for n, a in v.items()})
        else:
            have[k] = tuple(np.shape(v))
    fix = (f"they were not trained from this model ({c.architecture}, {c.num_layers} layers, "
           f"hidden {c.hidden_size}, vocab {c.vocab_size}); export with the run's own model.source")
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:4])}"] if missing else []) + (
            [f"unexpected {', '.join(extra[:4])}"] if extra else [])
        raise ExportError(f"{source}: the params do not fit the model config ({'; '.join(parts)}): "
                          f"{fix}")
    for k, s in want.items():
        if have[k] != s:
            raise ExportError(f"{source}: param {k} has shape {have[k]}, the model config needs "
                              f"{s}: {fix}")


def hf_tensor_getter(config: ModelConfig, params: Mapping[str, Any]
                     ) -> Callable[[str], np.ndarray]:
    """`get(hf_name) -> float32 np.ndarray` in HF layout, computed from `params` on demand (one
    tensor at a time, so a large model is never held twice in HF layout).

    Args:
      config: the model config.
      params: das-jax params (`das_jax.models.transformer` layout; numpy or jax arrays of any
        float dtype), checked with `check_params` first.

    Raises:
      ExportError: params that do not fit `config`.
      KeyError (from `get`): a name not in `hf_tensor_shapes(config)`.
    """
    check_params(config, params)
    c = config
    D, H, KVH, K = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    layers = params["layers"]

    def layer(name: str, i: int) -> np.ndarray:
        return np.asarray(layers[name][i], dtype=np.float32)

    per_layer: dict[str, Callable[[int], np.ndarray]] = {
        "input_layernorm.weight": lambda i: layer("attn_norm", i),
        "post_attention_layernorm.weight": lambda i: layer("mlp_norm", i),
        "self_attn.q_proj.weight": lambda i: layer("wq", i).reshape(D, H * K).T,
        "self_attn.k_proj.weight": lambda i: layer("wk", i).reshape(D, KVH * K).T,
        "self_attn.v_proj.weight": lambda i: layer("wv", i).reshape(D, KVH * K).T,
        "self_attn.o_proj.weight": lambda i: layer("wo", i).reshape(H * K, D).T,
        "self_attn.o_proj.bias": lambda i: np.zeros((D,), np.float32),
        "self_attn.q_proj.bias": lambda i: layer("bq", i).reshape(H * K),
        "self_attn.k_proj.bias": lambda i: layer("bk", i).reshape(KVH * K),
        "self_attn.v_proj.bias": lambda i: layer("bv", i).reshape(KVH * K),
        "self_attn.q_norm.weight": lambda i: layer("q_norm", i),
        "self_attn.k_norm.weight": lambda i: layer("k_norm", i),
        "mlp.gate_proj.weight": lambda i: layer("w_gate", i).T,
        "mlp.up_proj.weight": lambda i: layer("w_up", i).T,
        "mlp.down_proj.weight": lambda i: layer("w_down", i).T,
    }
    shapes = hf_tensor_shapes(config)

    def get(name: str) -> np.ndarray:
        if name not in shapes:
            raise KeyError(name)
        if name == "model.embed_tokens.weight":
            out = np.asarray(params["embed"], np.float32)
        elif name == "model.norm.weight":
            out = np.asarray(params["final_norm"], np.float32)
        elif name == "lm_head.weight":
            out = np.asarray(params["lm_head"], np.float32)
        else:
            _, _, i, rest = name.split(".", 3)   # model.layers.<i>.<rest>
            out = per_layer[rest](int(i))
        return np.ascontiguousarray(out)

    return get


def save_safetensors(out: str | os.PathLike, config: ModelConfig, params: Mapping[str, Any],
                     dtype: str = "float32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
                     ) -> list[str]:
    """Writes the weights into directory `out` as HF safetensors: `model.safetensors`, or, when
    they exceed `max_shard_bytes`, `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`. Tensors are converted one shard at a time. Returns the
    written file names.

    Raises:
      ExportError: params that do not fit `config`, or an unsupported dtype.
      OSError: the files cannot be written (e.g. a full disk).
    """
    # deferred import: safetensors (not loaded by importing this module)
    from safetensors.numpy import save_file

    np_dtype = _numpy_dtype(dtype)
    get = hf_tensor_getter(config, params)
    shapes = hf_tensor_shapes(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map: dict[str, str] = {}
    for file, names in zip(files, shards):
        tensors = {name: get(name).astype(np_dtype) for name in names}
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        os.chmod(os.path.join(out, file), _file_mode())   # safetensors writes 0600
        del tensors
        weight_map.update({name: file for name in names})
    if n > 1:
        total = sum(int(np.prod(s)) * np_dtype.itemsize for s in shapes.values())
        _write_json(os.path.join(out, SAFETENSORS_INDEX),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
        files.append(SAFETENSORS_INDEX)
    return files


# ----- config.json / generation_config.json -------------------------------------------------------

def _ids(tokenizer) -> tuple[int | None, list[int], int | None]:
    """(bos id, eos ids, pad id) of a das-jax `Tokenizer` (or a test double)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = [int(i) for i in getattr(tokenizer, "eos_token_ids", ())]
    pad = getattr(tokenizer, "pad_token_id", None)
    return (None if bos is None else int(bos)), eos, (None if pad is None else int(pad))


def hf_config_dict(config: ModelConfig, dtype: str = "float32", tokenizer=None) -> dict[str, Any]:
    """The `config.json` of `config` in its HF architecture (what `ModelConfig.from_hf_dict`
    reads back to the same config). bos / eos / pad ids come from `tokenizer` when given.

    Raises:
      ExportError: an unsupported dtype.
    """
    _numpy_dtype(dtype)
    c = config
    hf: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": MODEL_TYPES[c.architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # transformers >= 5 reads `dtype`, older versions and vLLM `torch_dtype`
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if c.architecture == "Qwen2ForCausalLM":
        if not c.attention_bias:
            raise ExportError("a Qwen2ForCausalLM always has q/k/v biases, but this model config "
                              "has attention_bias=False; it cannot be written as Qwen2")
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
    else:
        hf.update(attention_bias=c.attention_bias)
        if c.architecture == "LlamaForCausalLM":
            hf.update(mlp_bias=False, pretraining_tp=1)
        else:
            hf.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=c.num_layers)
    rs = c.rope_scaling
    if rs is not None:
        scaling: dict[str, Any] = {"rope_type": rs.rope_type, "factor": rs.factor}
        if rs.rope_type == "llama3":
            scaling.update(low_freq_factor=rs.low_freq_factor,
                           high_freq_factor=rs.high_freq_factor,
                           original_max_position_embeddings=rs.original_max_position_embeddings)
        hf["rope_scaling"] = scaling
    if tokenizer is not None:
        hf.update(generation_config_dict(tokenizer))   # the same special ids
    return hf


def generation_config_dict(tokenizer) -> dict[str, Any]:
    """`generation_config.json`: bos, every eos id das-jax stops at, pad. No sampling settings
    (transformers then decodes greedily unless asked otherwise)."""
    bos, eos, pad = _ids(tokenizer)
    out: dict[str, Any] = {}
    if bos is not None:
        out["bos_token_id"] = bos
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad is not None:
        out["pad_token_id"] = pad
    return out


# ----- tokenizer ----------------------------------------------------------------------------------

def check_tokenizer(tokenizer):
    """The transformers tokenizer inside a das-jax `Tokenizer` (what `save_tokenizer` writes).

    Raises:
      ExportError: `tokenizer` holds none (e.g. a test double).
    """
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not callable(getattr(hf, "save_pretrained", None)):
        raise ExportError(f"the tokenizer ({type(tokenizer).__name__}) is not a transformers "
                          "tokenizer and cannot be written as tokenizer.json; load the model "
                          "from an HF directory or a GGUF file")
    return hf


def save_tokenizer(out: str | os.PathLike, tokenizer) -> list[str]:
    """Writes the tokenizer's HF files into `out`: `tokenizer.json` and `tokenizer_config.json`
    (the chat template inside it, which every transformers version reads), as
    `PreTrainedTokenizerFast`, a class every transformers version has. Returns the file names.

    Args:
      tokenizer: a das-jax `Tokenizer` (its `hf` is a transformers fast tokenizer).

    Raises:
      ExportError: the tokenizer has no transformers fast tokenizer to save.
      OSError: the files cannot be written.
    """
    hf = check_tokenizer(tokenizer)
    out = os.fspath(out)
    written = hf.save_pretrained(out, save_jinja_files=False)
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    for key in _LOAD_TIME_TOKENIZER_KEYS:
        cfg.pop(key, None)
    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    chat_template = getattr(tokenizer, "chat_template", None) or getattr(hf, "chat_template", None)
    if chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = chat_template
    _write_json(cfg_path, cfg)
    return sorted({os.path.basename(p) for p in written} | {"tokenizer_config.json"})


# ----- the whole directory ------------------------------------------------------------------------

def save_hf_model(out: str | os.PathLike, config: ModelConfig, params: Mapping[str, Any],
                  tokenizer, dtype: str = "float32",
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Writes a complete HF model directory (module docstring) into `out` (created if missing;
    existing files of the same names are replaced). Returns the written file names.

    Args:
      out: the directory.
      config: the model config (its architecture becomes config.json's).
      params: das-jax params of `config` (numpy or jax arrays, any float dtype).
      tokenizer: the model's das-jax `Tokenizer`.
      dtype: "float32" or "bfloat16": the weights' dtype on disk and config.json's dtype.
      max_shard_bytes: largest safetensors file before the weights are sharded.

    Raises:
      ExportError: params that do not fit `config`, an unsupported dtype, or a tokenizer that is
        not a transformers tokenizer (checked before anything is written).
      OSError: the directory cannot be written (e.g. a full disk).
    """
    out = os.fspath(out)
    _numpy_dtype(dtype)
    check_params(config, params)
    check_tokenizer(tokenizer)
    os.makedirs(out, exist_ok=True)
    files = save_tokenizer(out, tokenizer)
    _write_json(os.path.join(out, "config.json"), hf_config_dict(config, dtype, tokenizer))
    _write_json(os.path.join(out, "generation_config.json"), generation_config_dict(tokenizer))
    files += ["config.json", "generation_config.json"]
    files += save_safetensors(out, config, params, dtype, max_shard_bytes)
    return sorted(files)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


_EXPORT_NAMES = ("config.json", "generation_config.json", SAFETENSORS_INDEX, "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


def is_export_file(name: str) -> bool:
    """Whether a file name is one an HF model directory export writes."""
    return name in _EXPORT_NAMES or (name.startswith("model") and name.endswith(".safetensors"))
