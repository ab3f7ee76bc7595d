"""The rollout boundary: the speculation registry (a toy drafter added by registering it), the
`Rollout` interface (generate, calibrate, epochs, checkpoint state) built from a config, and the
import boundaries of the trainer and the benchmarks."""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import das_jax
from das_jax.config import DASSection, config_from_dict
from das_jax.drafter import Draft
from das_jax.engine import Engine, EngineConfig, FixedPolicy, Request, SamplingParams
from das_jax.rollout import (Rollout, SpeculationError, build_speculation, get_speculation,
                             register_speculation, rollout_from_config, speculation_names,
                             unregister_speculation)
from das_jax.speculation import CostModelConfig, DASConfig
from das_jax.testing import tiny_model_config, tiny_params

CFG = tiny_model_config()


# ------------------------------------------------------------------------------ a toy drafter
class RepeatLastDrafter:
    """Proposes the request's last token `k` times: all a new drafter needs is the protocol."""

    def __init__(self, confidence: float):
        self.confidence = confidence
        self.last: dict[int, int] = {}
        self.epochs = 0

    def begin(self, request_id, problem_id, prompt_ids):
        self.last[request_id] = int(prompt_ids[-1])

    def propose(self, request_id, max_tokens):
        toks = np.full(max_tokens, self.last[request_id], np.int32)
        return Draft(toks, np.full(max_tokens, self.confidence, np.float32))

    def append(self, request_id, token_ids):
        self.last[request_id] = int(token_ids[-1])

    def end(self, request_id):
        self.last.pop(request_id, None)

    def advance_epoch(self):
        self.epochs += 1

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


@pytest.fixture
def toy_registered():
    # What a user's module does: one decorator; the builder reads its settings from `das:`.
    @register_speculation("repeat-last", description="repeat the last token")
    def build(das, cost_model):
        return RepeatLastDrafter(confidence=das.min_token_prob), FixedPolicy()
    yield "repeat-last"
    unregister_speculation("repeat-last")


def test_toy_drafter_is_one_registration(toy_registered):
    assert toy_registered in speculation_names()
    cfg = config_from_dict({"drafter": toy_registered, "das": {"min_token_prob": 0.5},
                            "rollout": {"max_new_tokens": 12, "max_slots": 4,
                                        "max_cache_len": 128, "draft_widths": [1, 4]}})
    params = tiny_params(CFG)
    rollout = rollout_from_config(cfg, CFG, params, eos_token_ids=[1])
    assert isinstance(rollout.drafter, RepeatLastDrafter) and rollout.drafter.confidence == 0.5
    reqs = [Request((5, 6, 7), problem_id="a", sample_index=g) for g in range(3)]
    out, stats = rollout.generate(reqs, params)
    plain, _ = rollout.with_speculation("none").generate(reqs, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]   # lossless
    assert stats.drafted_tokens > 0
    rollout.advance_epoch()
    assert rollout.state_dict()["drafter"] == {"epochs": 1}
    with pytest.raises(SpeculationError, match="already registered"):
        register_speculation(toy_registered)(lambda das, cm: (None, None))


def test_registry_errors_and_builtins():
    assert speculation_names()[:6] == ("none", "ngram", "suffix", "suffix-global", "das",
                                      "das-unlimited")
    with pytest.raises(SpeculationError, match="unknown drafter 'eagle'; valid: none, ngram"):
        get_speculation("eagle")
    with pytest.raises(SpeculationError, match="unknown"):
        unregister_speculation("eagle")
    assert get_speculation("das").uses_cost_model and not get_speculation("suffix").uses_cost_model
    # The das: settings reach every part: drafter, policy and cost model.
    das = DASSection(window=3, max_depth=12, min_token_prob=0.2,
                     policy=DASConfig(budget_medium=2), cost_model=CostModelConfig(c_base=0.5))
    drafter, policy = build_speculation("das", das)
    assert drafter.history.window == 3 and drafter.config.max_depth == 12
    assert drafter.config.min_token_prob == 0.2
    assert policy.config.budget_medium == 2 and policy.cost_model.c_base == 0.5
    _, unlimited = build_speculation("das-unlimited", das)
    assert unlimited.config.unlimited and not policy.config.unlimited
    assert build_speculation("none") == (None, None)


# ------------------------------------------------------------------------------ Rollout
def _requests():
    rng = np.random.default_rng(0)
    return [Request(tuple(int(t) for t in rng.integers(2, 64, size=6)), problem_id=f"p{i // 2}",
                    sample_index=i % 2) for i in range(4)]


def test_rollout_calibrates_once_and_round_trips_its_state():
    params = tiny_params(CFG)
    engine = Engine(CFG, params, eos_token_ids=[1],
                    engine_config=EngineConfig(max_slots=2, max_cache_len=128,
                                               draft_widths=(1, 4)))
    das = DASSection(cost_model=CostModelConfig(calibrate_kv_lens=(8,), calibrate_repeats=1))
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8)
    rollout = Rollout(engine, "das", das, sampling)
    assert not rollout.calibrated and rollout.cost_model is rollout.policy.cost_model
    out, _ = rollout.generate(_requests())
    # Calibrated before the first generate: 2 batches x 1 length x 2 widths observed, plus steps.
    assert rollout.calibrated and len(rollout.cost_model.observations) >= 4
    rollout.advance_epoch()
    state = rollout.state_dict()
    assert sorted(state["policy"]["finished_lengths"]) == sorted(len(o.token_ids) for o in out)
    other = Rollout(engine, "das", das, sampling)
    other.load_state_dict(state)
    assert other.state_dict()["policy"] == state["policy"]
    assert other.predicted_lengths(_requests()).tolist() == \
        rollout.predicted_lengths(_requests()).tolist()
    assert (other.predicted_lengths(_requests()) > 0).all()
    # A fork for another device starts from the learned state, with its own policy.
    fork = rollout.fork(None)
    assert fork.policy is not rollout.policy and fork.drafter is rollout.drafter
    assert fork.state_dict()["policy"]["finished_lengths"] == state["policy"]["finished_lengths"]


def test_no_calibration_when_disabled_or_not_planning_with_cost_model():
    engine = Engine(CFG, None, eos_token_ids=[1], dtype="float32")   # no params needed
    das = DASSection(cost_model=CostModelConfig(calibrate=False))
    for name, d in (("das", das), ("suffix", DASSection())):
        r = Rollout(engine, name, d)
        with pytest.raises(Exception, match="no requests"):
            r.generate([])          # validates first; no calibration was attempted
        assert not r.calibrated


# ------------------------------------------------------------------------------ boundaries
PKG = pathlib.Path(das_jax.__file__).parent
# Packages whose public surface is their __init__ (lazy exports): code outside them imports
# from the package, never from a submodule.
SEALED = ("das_jax.engine", "das_jax.drafter", "das_jax.rollout")


def _imports(path: pathlib.Path):
    """(module, [names]) of every import in a file (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    here = ".".join(_where(path).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            yield node.lineno, mod, [a.name for a in node.names]


def _where(path: pathlib.Path) -> pathlib.Path:
    try:
        return path.relative_to(PKG.parent)
    except ValueError:   # a file outside the package (the probe below)
        return pathlib.Path("das_jax", "bench", path.name)


# Public names that start with an underscore: os._exit, namedtuple's API.
_PUBLIC_UNDERSCORE = {"_exit", "_replace", "_asdict", "_fields", "_make"}


def _private_attribute_uses(path: pathlib.Path):
    """`x._name` uses where x is not self/cls (a private name reached from outside)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in _PUBLIC_UNDERSCORE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            yield node.lineno, node.attr


def _boundary_violations(files):
    import importlib
    bad = []
    for f in files:
        where = _where(f)
        for line, mod, names in _imports(f):
            for sealed in SEALED:
                if mod.startswith(sealed + "."):
                    bad.append(f"{where}:{line} imports the submodule {mod}")
                elif mod == sealed:
                    public = set(importlib.import_module(sealed).__all__)
                    bad += [f"{where}:{line} imports {n} (not public) from {mod}"
                            for n in names if n not in public]
            if mod.startswith("das_jax"):
                bad += [f"{where}:{line} imports the private name {n} from {mod}"
                        for n in names if n.startswith("_")]
        bad += [f"{where}:{line} reaches the private attribute .{attr}"
                for line, attr in _private_attribute_uses(f)]
    return bad


def test_trainer_and_benches_use_only_public_surfaces():
    files = sorted((PKG / "rl").rglob("*.py")) + sorted((PKG / "bench").glob("*.py"))
    assert len(files) > 10
    assert _boundary_violations(files) == []


def test_the_boundary_check_catches_violations(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("from das_jax.engine.generate import Engine\n"
                   "from das_jax.engine import step\n"
                   "from ..rl.rewards.math_reward import _column\n"
                   "def f(engine):\n    return engine._compiled\n")
    found = _boundary_violations([bad])
    assert len(found) == 4, found
    assert "das_jax.rl.rewards.math_reward" in found[2]


def test_no_module_outside_its_package_reaches_a_private_name():
    """Across the whole package: no `from das_jax.x import _name` between modules."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        for line, mod, names in _imports(f):
            if mod.startswith("das_jax") and mod != "das_jax._lazy":
                bad += [f"{f.relative_to(PKG.parent)}:{line} {mod}.{n}" for n in names
                        if n.startswith("_")]
    # Private modules of a package, imported by that package only.
    bad = [b for b in bad if "_kernels" not in b]
    assert bad == []
