"""Multi-step decode (`EngineConfig.decode_steps`): k plain decode steps in one device call give
the tokens and log-probs of single steps; the replay takes the engine's decisions. Tiny random
models, float32, fixed seeds."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.engine.generate import EngineConfig, GenerateError
from das_jax.engine.sampling import SamplingParams
from das_jax.testing import random_requests, tiny_engine, tiny_params

EOS = 1     # the tiny engine's eos id


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def engine(params, **kw):
    return tiny_engine(params, eos_token_id=EOS, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_multi_step_decode_equals_single_steps(params, temperature, monkeypatch):
    from das_jax.engine.executor import DeviceExecutor
    reqs = random_requests(problems=3, samples=3)
    first, _ = engine(params, decode_steps=1).generate(
        reqs, SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=37))
    # a token some rows sample (after a few tokens) and others never: those rows end early,
    # inside a multi-step call, and the others run to max_new_tokens
    seen = [set(o.token_ids[3:]) for o in first]
    stop = min(t for t in set.union(*seen) if 0 < sum(t in x for x in seen) < len(seen))
    sampling = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=37,
                              stop_token_ids=(stop,))
    single, s1 = engine(params, decode_steps=1).generate(reqs, sampling)
    assert {o.finish_reason for o in single} == {"stop", "length"}
    calls = []
    real = DeviceExecutor.decode
    monkeypatch.setattr(DeviceExecutor, "decode",
                        lambda self, st, k, *a: calls.append(k) or real(self, st, k, *a))
    for k in (3, 8):
        calls.clear()
        multi, sk = engine(params, decode_steps=k).generate(reqs, sampling)
        for a, b in zip(single, multi):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            assert a.forward_passes == b.forward_passes == len(a.token_ids) - 1
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert sk.generated_tokens == s1.generated_tokens
        assert sk.acceptance_length == pytest.approx(1.0)
        # the host waits for the device once per call, not once per step
        assert calls and set(calls) == {k}
        assert len(calls) < s1.forward_passes / (k / 2)
    for o in single:     # stop ids: `stop` and the engine's EOS
        assert (o.token_ids[-1] in (stop, EOS)) == (o.finish_reason == "stop")
        assert not {stop, EOS} & set(o.token_ids[:-1])


def test_decode_steps_must_be_positive():
    with pytest.raises(GenerateError, match="decode_steps"):
        EngineConfig(decode_steps=0)
