"""The rollout traces shipped under docs/traces read as `bench replay` reads them, and hold the
workloads docs/results describes (the paper-scale replay and the GPU check stretch them)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from das_jax.bench import replay as rp

TRACES = Path(__file__).resolve().parents[1] / "docs" / "traces"


@pytest.mark.parametrize("name, problems, epochs, cap", [
    ("gsm8k-smollm2-135m.jsonl.gz", 16, 4, 384),
    ("gsm8k-longtail-smollm2-135m.jsonl.gz", 8, 3, 1024),
])
def test_shipped_trace_reads_with_its_groups(name, problems, epochs, cap):
    trace = rp.read_trace(TRACES / name)
    assert trace.header["max_new_tokens"] == cap
    assert trace.header["num_generations"] == 8
    assert {r.problem_id for r in trace.rollouts} == {f"gsm8k-train-{i}" for i in range(problems)}
    assert sorted({r.epoch for r in trace.rollouts}) == list(range(epochs))
    assert len(trace.rollouts) == problems * 8 * epochs
    for r in trace.rollouts:
        # A rollout ends on a stop token or at the cap, never past it.
        assert 1 <= len(r.token_ids) <= cap
        assert r.finish_reason in ("stop", "length")
        assert (r.finish_reason == "length") == (len(r.token_ids) == cap)
    # The paper-scale replay builds its workload from every shipped trace.
    wl = rp.paper_workload(trace, problems=4, samples=2, max_tokens=2048, median_len=512,
                           epochs=2)
    assert sorted(wl) == [0, 1] and all(len(v) == 8 for v in wl.values())


def test_the_long_tailed_trace_has_a_tail():
    """Lengths of the long-tailed trace (`bench rollout --preset longtail`): max / median >= 3
    in every epoch, most rollouts end on their own (the rest run into the 1,024-token cap)."""
    trace = rp.read_trace(TRACES / "gsm8k-longtail-smollm2-135m.jsonl.gz")
    for epoch in range(3):
        lens = np.array([len(r.token_ids) for r in trace.rollouts if r.epoch == epoch])
        assert lens.max() / np.median(lens) >= 3
        assert 0.5 < np.mean(lens < 1024) < 1.0
