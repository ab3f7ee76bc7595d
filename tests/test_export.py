"""`das-jax export`: params -> an HF model directory that das-jax's own loader reads back to the
same params and transformers runs with the same logits and greedy tokens; a tiny training run
exported through the CLI; the one-line errors.

The tiny run uses configs/tiny.yaml with a tiny random model and a real character-level HF
tokenizer patched in for the model load (as tests/test_run_log.py does), so its tokenizer files
are exported too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from das_jax.cli import main
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.sampling import SamplingParams
from das_jax.models import ModelConfig, RopeScaling, Tokenizer, forward, init_params, load
from das_jax.models import export as hf_export
from das_jax.rl import console_log, model_loading
from das_jax.rl.checkpoint import CheckpointManager
from das_jax.rl.rewards import REWARD_FUNCTIONS
from das_jax.testing import CharTokenizer

TINY_YAML = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;?!'\"+-*/=$%()\n"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ("what is 12 + 7?", "tom has 3 apples and buys 4 more.", "a")
TOL = 1e-4


def char_tokenizer() -> Tokenizer:
    """A real HF fast tokenizer (the `tokenizers` library): <unk>=0, </s>=1 (eos), then one id
    per character of CHARS (lower-cased input), with a chat template."""
    from tokenizers import Regex, Tokenizer as RawTokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.normalizer = normalizers.Lowercase()
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    hf.chat_template = TEMPLATE
    return Tokenizer.from_hf(hf)


TOK = char_tokenizer()
LLAMA = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                    max_position_embeddings=256)
FLAVOURS = {
    "llama-tied": LLAMA,
    "llama-untied-llama3-rope": dataclasses.replace(
        LLAMA, tie_word_embeddings=False, rope_scaling=RopeScaling(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16)),
    "qwen2-qkv-bias": dataclasses.replace(
        LLAMA, architecture="Qwen2ForCausalLM", attention_bias=True, tie_word_embeddings=False,
        rope_theta=1e6, rms_norm_eps=1e-6),
    "llama-attention-bias": dataclasses.replace(LLAMA, attention_bias=True),
    "qwen3-qk-norm": dataclasses.replace(
        LLAMA, architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=12,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
}


def random_params(config: ModelConfig, seed: int = 0):
    """init_params with random norm weights and biases too (ones / zeros would hide a swap)."""
    params = init_params(config, jax.random.PRNGKey(seed), scale=0.3)
    rng = np.random.default_rng(seed)
    layers = dict(params["layers"])
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "bq", "bk", "bv"):
        if name in layers:
            base = 0.0 if name.startswith("b") else 1.0
            layers[name] = jnp.asarray(base + 0.2 * rng.standard_normal(layers[name].shape),
                                       jnp.float32)
    params = dict(params, layers=layers)
    params["final_norm"] = jnp.asarray(1 + 0.2 * rng.standard_normal(params["final_norm"].shape),
                                       jnp.float32)
    return params


def assert_params_equal(a, b):
    fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape, path
        np.testing.assert_array_equal(x, y, err_msg=str(path))


def bf16(params):
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32),
                                  params)


# ----- the model side: params -> HF directory -> params ------------------------------------------

@pytest.mark.parametrize("flavour", FLAVOURS)
def test_round_trip_through_das_jax_loader(tmp_path, flavour):
    config = FLAVOURS[flavour]
    params = random_params(config)
    files = hf_export.save_hf_model(tmp_path, config, params, TOK, "float32")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    loaded_config, loaded, tok = load(str(tmp_path))
    assert loaded_config == config
    assert ("lm_head" in loaded) == (not config.tie_word_embeddings)
    assert_params_equal(loaded, params)
    assert tok.eos_token_ids == TOK.eos_token_ids and tok.chat_template == TEMPLATE
    assert tok.encode(PROMPTS[1]) == TOK.encode(PROMPTS[1])


def test_exported_files_are_readable_like_any_new_file(tmp_path):
    """Every exported file gets the mode a new file gets (safetensors alone wrote 0600)."""
    config = FLAVOURS["llama-tied"]
    files = hf_export.save_hf_model(tmp_path / "out", config, random_params(config), TOK,
                                    "float32")
    (tmp_path / "new").write_text("x")
    want = (tmp_path / "new").stat().st_mode & 0o777
    assert {f: (tmp_path / "out" / f).stat().st_mode & 0o777 for f in files} == \
        {f: want for f in files}


def test_bfloat16_and_sharded_round_trip(tmp_path):
    config = FLAVOURS["qwen2-qkv-bias"]
    params = random_params(config, seed=1)
    files = hf_export.save_hf_model(tmp_path, config, params, TOK, "bfloat16",
                                    max_shard_bytes=20_000)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(shards):05d}.safetensors")
               for f in shards)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors import safe_open
    with safe_open(str(tmp_path / shards[0]), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    _, loaded, _ = load(str(tmp_path))
    assert_params_equal(loaded, bf16(params))


def test_params_that_do_not_fit_the_config_are_refused(tmp_path):
    params = random_params(LLAMA)
    other = dataclasses.replace(LLAMA, num_layers=3)
    with pytest.raises(hf_export.ExportError, match=r"param layers/attn_norm has shape "
                       r"\(2, 32\), the model config needs \(3, 32\)"):
        hf_export.save_hf_model(tmp_path, other, params, TOK)
    with pytest.raises(hf_export.ExportError, match="missing lm_head"):
        hf_export.save_hf_model(tmp_path, dataclasses.replace(LLAMA, tie_word_embeddings=False),
                                params, TOK)
    with pytest.raises(hf_export.ExportError, match="not a transformers tokenizer"):
        hf_export.save_hf_model(tmp_path, LLAMA, params, CharTokenizer())
    assert not list(tmp_path.iterdir())   # refused before anything was written


def transformers_model(path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def transformers_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def das_jax_logits(config, params, ids) -> np.ndarray:
    tokens = jnp.asarray([ids], jnp.int32)
    logits, _ = forward(config, params, tokens, jnp.arange(len(ids), dtype=jnp.int32)[None])
    return np.asarray(logits[0])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_transformers_logits_match(tmp_path, flavour):
    config = FLAVOURS[flavour]
    params = random_params(config, seed=2)
    hf_export.save_hf_model(tmp_path, config, params, TOK, "float32")
    model = transformers_model(tmp_path)
    assert type(model).__name__ == config.architecture
    ids = list(np.random.default_rng(0).integers(2, 64, size=23))
    np.testing.assert_allclose(transformers_logits(model, ids),
                               das_jax_logits(config, params, ids), atol=TOL, rtol=0)


# ----- a tiny training run through the CLI -------------------------------------------------------

def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    root = logging.getLogger("das_jax")
    if console_log._console_handler is not None:
        root.removeHandler(console_log._console_handler)
        console_log._console_handler = None
    root.setLevel(logging.NOTSET)
    root.propagate = True


@pytest.fixture
def stub_model(monkeypatch):
    """The run's model load and the export's config + tokenizer read, patched to the tiny model
    and the character tokenizer."""
    params = random_params(LLAMA, seed=3)
    # a fresh copy per load: the trainer owns (and donates) the params it is given
    monkeypatch.setattr(model_loading, "load_model", lambda config: (
        LLAMA, jax.tree_util.tree_map(jnp.copy, params), TOK))
    monkeypatch.setattr(model_loading, "load_model_spec", lambda config: (LLAMA, TOK))


def distinct_chars_reward(prompts, completions, **kwargs):
    """Varies within a group (a random model never solves the arithmetic), so steps train."""
    return [len(set(str(c))) / 8 for c in completions]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step tiny run with a checkpoint after each step, trained with a reward registered by
    the test (gone again when the run is exported: the export does not need it)."""
    run = tmp_path_factory.mktemp("export") / "run"
    with pytest.MonkeyPatch.context() as mp:
        params = random_params(LLAMA, seed=3)
        mp.setattr(model_loading, "load_model", lambda config: (
            LLAMA, jax.tree_util.tree_map(jnp.copy, params), TOK))
        mp.setitem(REWARD_FUNCTIONS, "distinct_chars", distinct_chars_reward)
        rc, _, err = run_cli(
            ["train", "--config", str(TINY_YAML), "--no-progress",
             "--set", f"output_dir={run}", "--set", "drafter=none",
             "--set", "data.chat=false", "--set", "data.num_problems=2",
             "--set", "grpo.reward_funcs=[distinct_chars]",
             "--set", "rollout.max_new_tokens=8", "--set", "train.steps=2",
             "--set", "train.save_every=1", "--set", "train.log_samples=0"])
    root = logging.getLogger("das_jax")
    root.removeHandler(console_log._console_handler)
    console_log._console_handler = None
    assert rc == 0, err
    return run


def restored(run, step):
    with CheckpointManager(run, read_only=True) as m:
        return m.restore_params(step)[0]


def das_jax_greedy(params, prompts_ids, max_new_tokens=16):
    engine = Engine(LLAMA, params, eos_token_ids=list(TOK.eos_token_ids),
                    engine_config=EngineConfig(max_slots=4, max_cache_len=128))
    outs, _ = engine.generate(
        [Request(tuple(ids), problem_id=f"p{i}", sample_index=0)
         for i, ids in enumerate(prompts_ids)],
        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    return [list(o.token_ids) for o in outs]


def test_export_of_a_run_loads_in_transformers_with_das_jax_greedy_tokens(
        run_dir, tmp_path, stub_model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "exported"
    rc, stdout, err = run_cli(["export", str(run_dir), str(out)])
    assert rc == 0, err
    assert "exported step 2 of" in stdout and "LlamaForCausalLM" in stdout
    params = restored(run_dir, 2)
    assert_params_equal(load(str(out))[1], params)          # float32: the run's model.dtype
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers_model(out)
    prompts_ids = []
    for prompt in PROMPTS:
        ids = hf_tok(prompt)["input_ids"]
        assert ids == TOK.encode_prompt(prompt)
        prompts_ids.append(ids)
    chat = [{"role": "user", "content": PROMPTS[0]}]
    assert hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        TOK.apply_chat_template(chat)
    np.testing.assert_allclose(transformers_logits(model, prompts_ids[1]),
                               das_jax_logits(LLAMA, params, prompts_ids[1]), atol=TOL, rtol=0)
    ours = das_jax_greedy(params, prompts_ids)
    for ids, expected in zip(prompts_ids, ours):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=16, do_sample=False)
        assert gen[0, len(ids):].tolist() == expected


def test_export_step_and_dtype(run_dir, tmp_path, stub_model):
    out = tmp_path / "step1"
    rc, stdout, err = run_cli(["export", str(run_dir), str(out), "--step", "1", "--dtype",
                               "bfloat16"])
    assert rc == 0, err
    assert "exported step 1 of" in stdout and "bfloat16" in stdout
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    step1 = restored(run_dir, 1)
    assert_params_equal(load(str(out))[1], bf16(step1))
    assert not np.array_equal(np.asarray(step1["embed"]), np.asarray(restored(run_dir, 2)["embed"]))
    # --overwrite replaces a model exported before
    rc, stdout, err = run_cli(["export", str(run_dir), str(out), "--overwrite"])
    assert rc == 0, err
    assert "exported step 2 of" in stdout
    assert_params_equal(load(str(out))[1], restored(run_dir, 2))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]   # no temp dir left


def assert_one_line_error(argv, *needles):
    rc, stdout, err = run_cli(argv)
    assert rc == 2, err
    *before, last = err.splitlines()
    assert last.startswith("das-jax export: error: "), err
    assert all(" ..." in line or ", done in " in line for line in before), err  # phase lines
    for needle in needles:
        assert needle in last, (needle, err)


def test_one_line_errors(run_dir, tmp_path, stub_model):
    out = str(tmp_path / "out")
    assert_one_line_error(["export", str(tmp_path / "nope"), out], "no such directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(["export", str(tmp_path / "empty"), out], "no config.yaml")
    no_ckpt = tmp_path / "no-ckpt"
    no_ckpt.mkdir()
    shutil.copy(run_dir / "config.yaml", no_ckpt / "config.yaml")
    assert_one_line_error(["export", str(no_ckpt), out], "no checkpoint", "train.save_every")
    assert_one_line_error(["export", str(run_dir), out, "--step", "7"],
                          "no checkpoint for step 7", "it has steps 1, 2")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert_one_line_error(["export", str(run_dir), str(full)], "is not empty", "--overwrite")
    assert_one_line_error(["export", str(run_dir), str(full), "--overwrite"],
                          "does not write (notes.txt)")
    assert (full / "notes.txt").read_text() == "mine"
    assert_one_line_error(["export", str(run_dir), str(run_dir)], "is the run directory")
    assert not Path(out).exists()


def test_an_out_that_cannot_be_created_is_refused_before_the_checkpoint_is_read(
        run_dir, tmp_path, stub_model, monkeypatch):
    """OUT under a file (`afile/sub`) or under a directory that cannot be written: refused by
    name before the checkpoint is read; a write that fails later names OUT, not the export's
    temporary directory beside it."""
    def not_read(*a, **k):
        raise AssertionError("the checkpoint was read")
    (tmp_path / "afile").write_text("x")
    with monkeypatch.context() as mp:
        mp.setattr(CheckpointManager, "restore_params", not_read)
        assert_one_line_error(["export", str(run_dir), str(tmp_path / "afile" / "sub")],
                              "afile/sub: cannot be created", "afile is a file")
        if os.geteuid() != 0:            # root writes anywhere
            locked = tmp_path / "locked"
            locked.mkdir(mode=0o500)
            assert_one_line_error(["export", str(run_dir), str(locked / "out")],
                                  "cannot be created", "is not writable")

    def fails(tmp, *a, **k):
        raise PermissionError(13, "Permission denied", str(tmp))
    monkeypatch.setattr(hf_export, "save_hf_model", fails)
    out = tmp_path / "out"
    assert_one_line_error(["export", str(run_dir), str(out)],
                          f"{out}: cannot write the exported model there (Permission denied)")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.export")]


def test_a_bad_model_source_in_the_run_config_is_named_before_the_checkpoint_is_read(
        run_dir, tmp_path, monkeypatch):
    """The run's config.yaml names a model source that does not exist: the error names the
    file and its model.source, and the checkpoint is not read."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["source"] = str(tmp_path / "no-such-model")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))

    def not_read(*a, **k):
        raise AssertionError("the checkpoint was read")
    monkeypatch.setattr(CheckpointManager, "restore_params", not_read)
    assert_one_line_error(["export", str(run), str(tmp_path / "out")],
                          f"{run / 'config.yaml'}: the run's model.source "
                          f"'{tmp_path / 'no-such-model'}': ", "no such file or directory")


def test_corrupt_checkpoint_is_one_line(run_dir, tmp_path, stub_model):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    state = run / "checkpoints" / "2" / "state"
    for f in state.rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    assert_one_line_error(["export", str(run), str(tmp_path / "out")],
                          f"checkpoint {run / 'checkpoints' / '2'} is corrupt: state/",
                          "does not match the checksum written at save",
                          "from a copy, or remove that step's directory",
                          "export another one with --step (steps there: 1, 2)")
    (run / "checkpoints" / "2" / "checksums.json").unlink()   # as an older version saved it
    assert_one_line_error(["export", str(run), str(tmp_path / "out")],
                          f"checkpoint {run / 'checkpoints' / '2'} is corrupt or unreadable (",
                          "restore them from a copy, or remove that step's directory",
                          "export another one with --step (steps there: 1, 2)")
    assert not (tmp_path / "out").exists()
    shutil.rmtree(state)
    assert_one_line_error(["export", str(run), str(tmp_path / "out")],
                          str(run / "checkpoints" / "2"))


# ----- the real SmolLM2 ---------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_export_greedy_equals_das_jax(smollm2_das, tmp_path):
    """SmolLM2-135M-Instruct as loaded (no training) -> a checkpoint -> `das-jax export` ->
    transformers' greedy continuation of one chat prompt equals das-jax's own, token for token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from conftest import SMOLLM2_PROMPTS
    from das_jax.config import Config, save_config
    config, params, tok = smollm2_das
    run = tmp_path / "run"
    run.mkdir()
    save_config(Config(output_dir=str(run)), run / "config.yaml")   # model: smollm2, float32
    with CheckpointManager(run) as m:
        m.save(0, params, {})
    out = tmp_path / "exported"
    rc, _, err = run_cli(["export", str(run), str(out)])
    assert rc == 0, err
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": SMOLLM2_PROMPTS[0]}]
    ids = list(hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    assert ids == tok.chat_prompt_ids(SMOLLM2_PROMPTS[0])
    engine = Engine(config, params, eos_token_ids=list(tok.eos_token_ids),
                    engine_config=EngineConfig(max_slots=1, max_cache_len=256))
    ours, _ = engine.generate([Request(tuple(ids), problem_id="p0", sample_index=0)],
                              SamplingParams(temperature=0.0, max_new_tokens=32))
    model = transformers_model(out)
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=32, do_sample=False)
    assert gen[0, len(ids):].tolist() == list(ours[0].token_ids)
    assert len(ours[0].token_ids) == 32      # no early stop: 32 tokens compared
