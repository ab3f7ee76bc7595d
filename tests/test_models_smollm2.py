"""SmolLM2-135M-Instruct from the named source vs transformers loading the same GGUF (slow)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMOLLM2_PROMPTS
from das_jax.models import forward

pytestmark = pytest.mark.slow


def test_config(smollm2_das):
    config, params, tok = smollm2_das
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads,
            config.num_kv_heads, config.vocab_size, config.rope_theta, config.tie_word_embeddings) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152, 100000.0, True)
    assert "lm_head" not in params


def test_tokenizer_matches_transformers(smollm2_das, smollm2_hf):
    _, _, tok = smollm2_das
    hf_tok, _ = smollm2_hf
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids and tok.vocab_size == 49152
    for prompt in SMOLLM2_PROMPTS:
        ref = hf_tok.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tok.chat_prompt_ids(prompt) == list(ref)
        assert tok.encode(prompt) == hf_tok.encode(prompt, add_special_tokens=False)
        assert tok.decode(tok.encode(prompt)) == prompt
    sys_ref = hf_tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.chat_prompt_ids("Hi", system="Be brief.") == list(sys_ref)


def test_greedy_continuations_match_transformers(smollm2_das, smollm2_hf, smollm2_greedy_reference):
    """Teacher-forced das-jax argmax equals transformers' greedy token at every position."""
    import torch
    config, params, _ = smollm2_das
    _, hf_model = smollm2_hf
    total, max_diff, min_margin, lengths = 0, 0.0, np.inf, []
    for prompt_ids, cont in smollm2_greedy_reference:
        assert len(cont) >= 32
        seq = np.asarray(prompt_ids + cont, np.int32)[None]
        logits, _ = forward(config, params, jnp.asarray(seq), jnp.arange(seq.shape[1], dtype=jnp.int32)[None])
        logits = np.asarray(logits)[0]
        pred = logits[len(prompt_ids) - 1:-1].argmax(-1)
        mismatches = np.flatnonzero(pred != np.asarray(cont))
        assert mismatches.size == 0, f"argmax differs at continuation positions {mismatches.tolist()}"
        total += len(cont)
        lengths.append(len(cont))
        top2 = np.sort(logits[len(prompt_ids) - 1:-1], axis=-1)[:, -2:]
        min_margin = min(min_margin, float((top2[:, 1] - top2[:, 0]).min()))
        with torch.no_grad():
            ref = hf_model(torch.tensor(seq, dtype=torch.long)).logits[0].float().numpy()
        max_diff = max(max_diff, float(np.abs(ref - logits).max()))
    print(f"SmolLM2 parity: {total} positions agree (continuation lengths {lengths}), max |logit "
          f"diff| vs transformers {max_diff:.2e}, smallest top-2 logit margin {min_margin:.3f}")
    assert max_diff < 1e-2
