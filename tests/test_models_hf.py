"""Tiny random Llama / Qwen2 / Qwen3 saved by transformers, loaded by das_jax.models.loading:
logits equal transformers' (float32, 1e-4) with left/right padding and through the KV cache."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from das_jax.models import KVCache, Tokenizer, forward, load  # noqa: E402

torch.set_num_threads(2)
VOCAB = 100
TOL = 1e-4


def save_tiny_tokenizer(path) -> None:
    """A word-level tokenizer over VOCAB ids ("w0".."w95" + 4 specials) with a ChatML template."""
    from tokenizers import Tokenizer as RawTokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<pad>", additional_special_tokens=specials[1:3])
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                         "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> "
                         "assistant {% endif %}")
    tok.save_pretrained(path)


def _perturb(model, seed: int) -> None:
    """Random norm weights and biases (HF initialises them to 1 / 0, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def make_tiny(kind: str, seed: int = 0):
    """(HF model, config kwargs) for kind in llama | qwen2 | qwen3."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=True, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False, rope_theta=1e6)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model = model.float().eval()
    _perturb(model, seed)
    return model


def save_tiny(kind: str, path, *, shard: bool = False, seed: int = 0):
    model = make_tiny(kind, seed)
    model.save_pretrained(path, max_shard_size="20KB" if shard else "5GB")
    save_tiny_tokenizer(path)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model = save_tiny(request.param, path)
    config, params, tok = load(str(path))
    return request.param, path, model, config, params, tok


def padded_batch(seed: int = 0):
    """tokens [3, 10]: row 0 full, row 1 left-padded by 3, row 2 right-padded by 4."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, VOCAB, size=(3, 10)).astype(np.int32)
    valid = np.ones((3, 10), bool)
    valid[1, :3] = False
    valid[2, 6:] = False
    tokens[~valid] = 3  # pad id
    positions = np.clip(np.cumsum(valid, axis=1) - 1, 0, None).astype(np.int32)
    return tokens, valid, positions


def hf_logits(model, tokens, valid, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(valid, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def test_config_resolved(tiny):
    kind, path, model, config, params, tok = tiny
    assert config.vocab_size == VOCAB and config.num_layers == 2
    assert config.tie_word_embeddings == (kind == "llama")
    assert ("lm_head" in params) == (kind != "llama")
    assert config.attention_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    if kind == "llama":
        assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    if kind == "qwen3":
        assert config.head_dim == 24 and params["layers"]["wq"].shape == (2, 64, 4, 24)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))


def test_logits_match_transformers_with_padding(tiny):
    kind, path, model, config, params, tok = tiny
    tokens, valid, positions = padded_batch()
    ref = hf_logits(model, tokens, valid, positions)
    ours, _ = forward(config, params, jnp.asarray(tokens), jnp.asarray(positions),
                      valid_BxT=jnp.asarray(valid))
    ours = np.asarray(ours)
    assert ours.shape == ref.shape == (3, 10, VOCAB)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)
    # The padded rows give the same logits as the unpadded sequences.
    np.testing.assert_allclose(ours[1, 3:], np.asarray(forward(
        config, params, jnp.asarray(tokens[1:2, 3:]), jnp.arange(7, dtype=jnp.int32)[None])[0])[0],
        atol=TOL, rtol=0)


def test_kv_cache_chunks_equal_one_shot(tiny):
    kind, path, model, config, params, tok = tiny
    rng = np.random.default_rng(1)
    B, T = 2, 9
    tokens = jnp.asarray(rng.integers(4, VOCAB, size=(B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    full, _ = forward(config, params, tokens, positions)
    cache = KVCache.zeros(config, B, max_len=16)
    cache_len = jnp.zeros((B,), jnp.int32)
    chunks = []
    fwd = jax.jit(forward, static_argnums=0)
    for start, stop in ((0, 5), (5, 6), (6, 9)):
        logits, cache = fwd(config, params, tokens[:, start:stop], positions[:, start:stop],
                            cache, cache_len)
        cache_len = cache_len + (stop - start)
        chunks.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), np.asarray(full), atol=1e-5, rtol=0)
    ref = hf_logits(model, np.asarray(tokens), np.ones((B, T), bool), np.asarray(positions))
    np.testing.assert_allclose(np.asarray(full), ref, atol=TOL, rtol=0)


def test_jit_equals_eager(tiny):
    kind, path, model, config, params, tok = tiny
    tokens, valid, positions = padded_batch(2)
    args = (jnp.asarray(tokens), jnp.asarray(positions))
    eager, _ = forward(config, params, *args, valid_BxT=jnp.asarray(valid))
    jitted, _ = jax.jit(forward, static_argnums=0)(config, params, *args, valid_BxT=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(jitted)[valid], np.asarray(eager)[valid], atol=1e-5, rtol=0)


def test_tokenizer_from_dir(tiny):
    kind, path, model, config, params, tok = tiny
    assert isinstance(tok, Tokenizer)
    assert tok.encode("w0 w1 w95") == [4, 5, 99]
    assert tok.decode([4, 5, 2]) == "w0 w1"
    assert tok.eos_token_ids[0] == 2 and tok.pad_token_id == 3 and tok.vocab_size == VOCAB
    ids = tok.chat_prompt_ids("w3 w4")
    assert ids == tok.hf.apply_chat_template([{"role": "user", "content": "w3 w4"}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert ids[0] == 1 and tok.apply_chat_template([{"role": "user", "content": "w1"}]).startswith(
        "<|im_start|>")


def test_sharded_checkpoint_and_generation_config_eos(tmp_path):
    model = save_tiny("qwen2", tmp_path, shard=True, seed=3)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config, params, tok = load(str(tmp_path))
    assert tok.eos_token_ids == (2, 7)
    tokens, valid, positions = padded_batch(4)
    ours, _ = forward(config, params, jnp.asarray(tokens), jnp.asarray(positions),
                      valid_BxT=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(ours)[valid], hf_logits(model, tokens, valid, positions)[valid],
                               atol=TOL, rtol=0)


def test_bfloat16_params_and_checkpoint(tmp_path):
    """bf16 load of an fp32 checkpoint, and an fp32 load of a bf16 checkpoint (widened exactly)."""
    model = save_tiny("llama", tmp_path / "f32", seed=5)
    config, p32, _ = load(str(tmp_path / "f32"))
    _, p16, _ = load(str(tmp_path / "f32"), dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(p16))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    save_tiny_tokenizer(tmp_path / "bf16")
    _, pb, _ = load(str(tmp_path / "bf16"), dtype="float32")
    for a, b in zip(jax.tree_util.tree_leaves(p16), jax.tree_util.tree_leaves(pb)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    tokens, valid, positions = padded_batch(6)
    l32, _ = forward(config, p32, jnp.asarray(tokens), jnp.asarray(positions), valid_BxT=jnp.asarray(valid))
    l16, _ = forward(config, p16, jnp.asarray(tokens), jnp.asarray(positions), valid_BxT=jnp.asarray(valid))
    assert l16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(l16)[valid], np.asarray(l32)[valid], atol=0.05, rtol=0)
