"""GGUF round trip: a tiny HF model written as GGUF (llama.cpp's Q/K permutation for llama; F32 and
Q8_0 tensors) loads into the same params / logits as the safetensors original."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from das_jax.models import ModelLoadError, forward, load  # noqa: E402
from das_jax.models.loaders.gguf_file import permute_qk, unpermute_qk  # noqa: E402
from test_models_hf import VOCAB, hf_logits, padded_batch, save_tiny  # noqa: E402

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        stem, suffix = rest.rsplit(".", 1)
        return f"blk.{i}.{_HF_TO_GGUF[stem]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def tiny_gguf_vocab():
    """VOCAB byte-level tokens: 4 control tokens, 94 single characters, 2 merged pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    chars = [bytes_to_unicode()[b] for b in range(33, 127)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"] + chars + ["ab", "abc"]
    types = [3] * 4 + [1] * (len(tokens) - 4)
    assert len(tokens) == VOCAB
    return tokens, types, ["a b", "ab c"]


def write_gguf(model, path, arch: str, quantize: bool) -> None:
    """Writes `model` as llama.cpp's convert script would (permuted Q/K for llama)."""
    cfg = model.config
    H, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokens, types, merges = tiny_gguf_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(3)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                        "{% endif %}")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = permute_qk(data, H)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = permute_qk(data, KVH)
        if quantize and data.ndim == 2 and data.shape[1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_permutation_inverse():
    x = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(x, 6), 6), x)
    assert not np.array_equal(permute_qk(x, 6), x)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_gguf_f32_round_trip(tmp_path, kind):
    model = save_tiny(kind, tmp_path / "hf", seed=11)
    write_gguf(model, tmp_path / "m.gguf", kind, quantize=False)
    c_hf, p_hf, _ = load(str(tmp_path / "hf"))
    c_gg, p_gg, tok = load(str(tmp_path / "m.gguf"))
    assert c_gg.architecture == c_hf.architecture
    assert c_gg.tie_word_embeddings == c_hf.tie_word_embeddings
    assert (c_gg.num_heads, c_gg.num_kv_heads, c_gg.head_dim, c_gg.vocab_size) == (
        c_hf.num_heads, c_hf.num_kv_heads, c_hf.head_dim, c_hf.vocab_size)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p_hf), jax.tree_util.tree_leaves(p_gg)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    if kind != "llama":  # llama's llama3 rope scaling is not representable in GGUF metadata
        tokens, valid, positions = padded_batch(3)
        ours, _ = forward(c_gg, p_gg, jnp.asarray(tokens), jnp.asarray(positions),
                          valid_BxT=jnp.asarray(valid))
        np.testing.assert_allclose(np.asarray(ours)[valid],
                                   hf_logits(model, tokens, valid, positions)[valid], atol=1e-4, rtol=0)
    # The tokenizer and chat template come from the GGUF metadata.
    assert tok.eos_token_ids == (2,) and tok.pad_token_id == 3 and tok.vocab_size == VOCAB
    assert tok.encode("abc!") == [99, 4]
    assert tok.decode([99, 4, 2]) == "abc!"
    assert tok.chat_prompt_ids("ab")[:1] == [1]


def test_gguf_q8_0_round_trip(tmp_path):
    model = save_tiny("llama", tmp_path / "hf", seed=12)
    write_gguf(model, tmp_path / "q8.gguf", "llama", quantize=True)
    reader = gguf.GGUFReader(str(tmp_path / "q8.gguf"))
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}
    _, p_hf, _ = load(str(tmp_path / "hf"))
    _, p_q8, _ = load(str(tmp_path / "q8.gguf"))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p_hf), jax.tree_util.tree_leaves(p_q8)):
        a, b = np.asarray(a), np.asarray(b)
        # Q8_0: per 32-block scale max|x|/127, rounding error <= scale / 2.
        bound = np.abs(a).max() / 127 / 2 * 1.01 + 1e-7
        assert np.abs(a - b).max() <= bound, path
        assert np.abs(a - b).max() < 5e-4, path


def test_truncated_gguf(tmp_path):
    model = save_tiny("qwen2", tmp_path / "hf", seed=13)
    write_gguf(model, tmp_path / "m.gguf", "qwen2", quantize=False)
    data = (tmp_path / "m.gguf").read_bytes()
    for n, name in ((len(data) - 1000, "tail.gguf"), (200, "head.gguf")):
        (tmp_path / name).write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match=rf"{name}.*(truncated|corrupt).*re-download or re-convert"):
            load(str(tmp_path / name))


def test_unsupported_gguf_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'"):
        load(str(tmp_path / "gpt2.gguf"))
