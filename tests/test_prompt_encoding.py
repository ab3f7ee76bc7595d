"""Prompts are tokenised as the model's tokenizer does.

Raw (non-chat) prompts get the special tokens the tokenizer's post-processor is configured to add
(a Llama-style tokenizer prepends BOS: ``"w7 w8 w9"`` -> ``[1, 11, 12, 13]``, as transformers
gives); the chat path has exactly one BOS. Every place that encodes prompts (generate CLI with
and without --chat, the trainer with ``data.chat`` true or false, the rollout bench) goes through
``Tokenizer.encode_prompt``.
"""
from __future__ import annotations

import pathlib
import re

import jax
import pytest

from das_jax.models import ModelConfig, Tokenizer, init_params

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB = 40
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]  # w7 -> 11


def _save(path, *, bos_post_processor: bool, template: str | None):
    from tokenizers import Tokenizer as RawTokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos_post_processor:  # Llama-style: "<s> $A"
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", pad_token="<pad>")
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(path)
    return path


TEMPLATE_WITH_BOS = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                     "{% endfor %}{% if add_generation_prompt %}w0 {% endif %}")
TEMPLATE_NO_BOS = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                   "{% endfor %}{% if add_generation_prompt %}w0 {% endif %}")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("llama"), bos_post_processor=True, template=TEMPLATE_WITH_BOS)


def test_raw_prompt_gets_bos_like_transformers(llama_dir):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_hf_dir(llama_dir)
    hf = AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    assert tok.encode_prompt("w7 w8 w9") == [1, 11, 12, 13]
    assert hf("w7 w8 w9")["input_ids"] == [1, 11, 12, 13]
    for text in ["w7 w8 w9", "", "w1", "w0 <s> w2", "<s> w3"]:
        assert tok.encode_prompt(text) == hf(text)["input_ids"], text
    assert tok.prepends_bos()


def test_chat_path_has_exactly_one_bos(llama_dir, tmp_path):
    tok = Tokenizer.from_hf_dir(llama_dir)
    ids = tok.chat_prompt_ids("w5 w6")
    assert ids[0] == 1 and ids[1] != 1 and ids.count(1) == 1
    # the template's BOS is kept once even if the rendered text starts with one more
    assert tok.encode_prompt("<s><s> w5", chat=True) == [1, 9]
    assert tok.encode_prompt("<s> w5", chat=True) == [1, 9]
    # a template that writes no BOS: the one the tokenizer would add
    tok2 = Tokenizer.from_hf_dir(_save(tmp_path / "nobos-template", bos_post_processor=True,
                                       template=TEMPLATE_NO_BOS))
    ids2 = tok2.chat_prompt_ids("w5 w6")
    assert ids2[0] == 1 and ids2.count(1) == 1
    assert ids2 == ids


def test_tokenizer_without_bos_post_processor_adds_nothing(tmp_path):
    from transformers import AutoTokenizer

    path = _save(tmp_path / "chatml", bos_post_processor=False, template=TEMPLATE_NO_BOS)
    tok = Tokenizer.from_hf_dir(path)
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert not tok.prepends_bos()
    assert tok.encode_prompt("w7 w8 w9") == hf("w7 w8 w9")["input_ids"] == [11, 12, 13]
    ids = tok.chat_prompt_ids("w5")
    ref = hf.apply_chat_template([{"role": "user", "content": "w5"}], add_generation_prompt=True,
                                 tokenize=True, return_dict=False)
    assert ids == list(ref) and 1 not in ids


CFG = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_trainer_raw_prompts_get_bos(llama_dir, tmp_path):
    from das_jax.config import config_from_dict
    from das_jax.data import Problem
    from das_jax.rl.trainer import GRPOTrainer

    tok = Tokenizer.from_hf_dir(llama_dir)
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    problems = [Problem("p0", "w7 w8 w9", "1")]
    for chat in (False, True):
        cfg = config_from_dict({
            "output_dir": str(tmp_path / f"run-{chat}"), "drafter": "none",
            "data": {"kind": "arithmetic", "chat": chat, "instruction": ""},
            "rollout": {"max_new_tokens": 4, "max_slots": 2, "max_cache_len": 64},
            "grpo": {"num_generations": 2, "prompts_per_step": 1, "micro_batch_size": 2},
            "train": {"steps": 1},
        })
        trainer = GRPOTrainer(cfg, model=(CFG, params, tok), problems=problems,
                              reward_fns=[lambda p, c, **k: [0.0] * len(c)])
        ids = trainer.prompt_ids["p0"]
        if chat:
            assert ids == tok.chat_prompt_ids("w7 w8 w9")
        else:
            assert ids == [1, 11, 12, 13, *tok.encode("\n")][: len(ids)] and ids[:4] == [1, 11, 12, 13]
        assert ids[0] == 1 and ids.count(1) == 1


def test_generate_cli_raw_prompt_gets_bos(llama_dir, monkeypatch, capsys):
    import das_jax.models as models_pkg
    from das_jax.cli import main
    from das_jax.engine import generate as gen

    tok = Tokenizer.from_hf_dir(llama_dir)
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    monkeypatch.setattr(models_pkg, "load", lambda *a, **k: (CFG, params, tok), raising=False)
    seen = []
    real = gen.Engine.generate

    def spy(self, requests, *a, **k):
        seen.extend(r.prompt_ids for r in requests)
        return real(self, requests, *a, **k)

    monkeypatch.setattr(gen.Engine, "generate", spy)
    for extra, expect in (([], (1, 11, 12, 13)), (["--chat"], tuple(tok.chat_prompt_ids("w7 w8 w9")))):
        seen.clear()
        rc = main(["generate", "--model", "tiny", "--prompt", "w7 w8 w9", "--max-new-tokens", "1",
                   "--temperature", "0", "--max-cache-len", "64", "--max-slots", "1",
                   "--draft-widths", "1", "--json", *extra])
        assert rc == 0, capsys.readouterr().err
        assert seen == [expect]
        assert seen[0][0] == 1 and seen[0].count(1) == 1


def test_no_prompt_encoding_bypasses_encode_prompt():
    """Every prompt in the package is encoded by Tokenizer.encode_prompt / chat_prompt_ids."""
    root = pathlib.Path(__file__).resolve().parents[1] / "das_jax"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "tokenizer.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"tokenizer\.encode\(|\.hf\.encode\(", line):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, offenders
