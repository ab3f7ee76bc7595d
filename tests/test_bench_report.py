"""Pure summaries of the rollout benchmark (`bench/rollout_report.py`) and the paper-scale replay
under several cost models (`bench/paper_replay.py`) on a tiny synthetic trace."""
from __future__ import annotations

import math

import numpy as np
import pytest

from das_jax.bench import rollout_report as rr


def test_first_divergence():
    assert rr.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert rr.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert rr.first_divergence([1, 2], [1, 2, 3]) == 2      # one stopped earlier
    assert rr.first_divergence([], []) is None


def test_divergence_stats_counts_compared_tokens_up_to_first_difference():
    outs = [[1, 2, 3, 4], [1, 2, 9, 9, 9], [7]]
    refs = [[1, 2, 3, 4], [1, 2, 3, 4, 5], [7]]
    s = rr.divergence_stats(outs, refs)
    assert s["rollouts"] == 3 and s["identical"] == 2 and s["divergences"] == 1
    assert s["identical_share"] == pytest.approx(2 / 3)
    # identical: 4 + 1 tokens; diverging: positions 0..2 (first difference at 2, included)
    assert s["compared_tokens"] == 4 + 1 + 3
    assert s["divergences_per_1k"] == pytest.approx(1000 / 8)
    m = rr.merge_divergence_stats([s, rr.divergence_stats([[1]], [[1]])])
    assert m["rollouts"] == 4 and m["compared_tokens"] == 9
    assert m["divergences_per_1k"] == pytest.approx(1000 / 9)
    with pytest.raises(ValueError, match="one reference per rollout"):
        rr.divergence_stats([[1]], [])


def test_divergence_stats_all_identical():
    s = rr.divergence_stats([[1, 2], [3]], [[1, 2], [3]])
    assert s["identical_share"] == 1.0 and s["divergences_per_1k"] == 0.0


def test_speedup_summary_per_epoch_later_and_best_baseline():
    times = {"none": [10.0, 10.0, 10.0, 10.0],
             "ngram": [12.0, 8.0, 9.0, 20.0],
             "suffix-global": [11.0, 9.0, 7.0, 8.0],
             "das": [10.0, 5.0, 5.0, 10.0]}
    s = rr.speedup_summary(times)
    assert s["per_epoch"]["das"] == [1.0, 2.0, 2.0, 1.0]
    assert s["per_epoch"]["none"] == [1.0] * 4
    assert s["best_baseline"] == ["suffix-global", "ngram", "suffix-global", "suffix-global"]
    assert s["subject_vs_best"] == pytest.approx([11 / 10, 8 / 5, 7 / 5, 8 / 10])
    assert s["later_epochs"] == [1, 2, 3]
    assert s["later"]["das"] == pytest.approx(30 / 20)
    # best baseline over epochs 1-3 by sums: ngram 37, suffix-global 24
    assert s["later_best_baseline"] == "suffix-global"
    assert s["later_subject_vs_best"] == pytest.approx(24 / 20)
    assert s["total"]["das"] == pytest.approx(40 / 30)
    assert s["total_subject_vs_best"] == pytest.approx(35 / 30)


def test_speedup_summary_without_subject_or_baselines_and_errors():
    s = rr.speedup_summary({"none": [2.0], "das": [1.0]})
    assert s["subject_vs_best"] == [None] and "later" not in s    # one epoch: no epochs 1-3
    s = rr.speedup_summary({"none": [2.0, 2.0], "ngram": [1.0, 4.0]})
    assert s["subject_vs_best"] == [None, None]
    assert math.isnan(rr.speedup_summary({"none": [1.0], "das": [0.0]})["per_epoch"]["das"][0])
    with pytest.raises(ValueError, match="reference"):
        rr.speedup_summary({"das": [1.0]})
    with pytest.raises(ValueError, match="epochs"):
        rr.speedup_summary({"none": [1.0, 1.0], "das": [1.0]})


def test_step_term_shares_and_regime():
    coef = {"c_base": 1.0, "c_tok": 0.1, "c_kv": 0.001}
    sh = rr.step_term_shares([(10, 1000), (30, 1000)], coef)
    # base 2, tok 4, kv 2
    assert sh["seconds"] == pytest.approx(8.0)
    assert (sh["base"], sh["tok"], sh["kv"]) == pytest.approx((0.25, 0.5, 0.25))
    assert rr.regime(sh) == rr.REGIMES["tok"]
    assert rr.regime(rr.step_term_shares([(1, 0)], coef)) == rr.REGIMES["base"]
    assert rr.regime(rr.step_term_shares([(1, 10 ** 6)], coef)) == rr.REGIMES["kv"]
    assert rr.step_term_shares([], coef)["seconds"] == 0.0


def test_targets_rows_report_met_and_not_met():
    measured = rr.speedup_summary({"none": [10.0, 10.0, 10.0, 10.0],
                                   "ngram": [20.0, 20.0, 20.0, 20.0],
                                   "das": [9.0, 7.0, 7.0, 7.0]})
    paper = {"h100-7b": {"summary": rr.speedup_summary({"none": [10.0, 10.0], "ngram": [4.0, 4.0],
                                                        "das": [4.0, 3.0]}),
                         "regime": "x", "compute_bound": True}}
    rows = rr.targets_rows(measured, {"none_tok_s": 30.0, "hf_tok_s": 10.0, "batch": 16},
                           {"das": rr.divergence_stats([[1]], [[1]])}, paper)
    by = {r[0]: r for r in rows}
    assert by["das / none per epoch"][3] == "yes"
    assert by["das / none over epochs 1-3"][3] == "yes"                 # 30 / 21 = 1.43
    assert by["`none` / HF transformers `generate` tok/s at B=16"][3] == "yes"   # 3.0x
    assert by["paper replay h100-7b: das / none per epoch [x]"][3] == "yes"
    # compute-bound: das / best must be >= 1.1 every epoch; epoch 0 is 1.0
    row = by["paper replay h100-7b: das / best baseline per epoch"]
    assert row[2] == ">= 1.1x every epoch" and row[3] == "no"
    md = rr.targets_markdown(rows)
    assert md.startswith("| measure | value | target | met |") and "100.0% identical" in md


def test_each_preset_is_reported_against_its_own_targets():
    """The long-tailed preset's rows carry its targets (das / none >= 1.5x and das / best
    baseline >= 1.2x over the epochs with history), not the README benchmark's; a value without
    a target is reported with none."""
    measured = rr.speedup_summary({"none": [10.0, 10.0, 10.0],
                                   "suffix-global": [9.0, 8.0, 8.0],
                                   "das": [9.5, 7.0, 6.0]}, later_epochs=(1, 2))
    hf = {"none_tok_s": 30.0, "hf_tok_s": 20.0, "batch": 16}
    readme = {r[0]: r for r in rr.targets_rows(measured, hf, targets=rr.TARGETS["readme"])}
    longtail = {r[0]: r for r in rr.targets_rows(measured, hf, targets=rr.TARGETS["longtail"])}
    # das / none over epochs 1-2: 20 / 13 = 1.538
    assert readme["das / none over epochs 1-2"][2:] == (">= 1.3x", "yes")
    assert longtail["das / none over epochs 1-2"][2:] == (">= 1.5x", "yes")
    # das / suffix-global over epochs 1-2: 16 / 13 = 1.231; over all epochs 25 / 22.5 = 1.111
    key = "das / best baseline over epochs 1-2 (suffix-global)"
    assert readme[key][1:] == ("1.23x", "", "")
    assert longtail[key][1:] == ("1.23x", ">= 1.2x", "yes")
    key = "das / best baseline over all epochs (suffix-global)"
    assert readme[key][2:] == (">= 1.3x", "no") and longtail[key][2:] == ("", "")
    key = "`none` / HF transformers `generate` tok/s at B=16"
    assert readme[key][2:] == (">= 2.5x", "no") and longtail[key][2:] == ("", "")
    assert readme["das / none per epoch"][2:] == longtail["das / none per epoch"][2:] == (
        ">= 1.0x every epoch", "yes")
    # A stricter every-epoch bound that one epoch misses (epoch 0: 10 / 9.5 = 1.05).
    strict = rr.Targets(every_epoch=1.1)
    assert {r[0]: r for r in rr.targets_rows(measured, targets=strict)}[
        "das / none per epoch"][3] == "no"


# ----------------------------------------------------------------------------- paper replay

def _tiny_epochs():
    from das_jax.bench import replay as rp
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(2, 40, size=60)]
    epochs = {}
    for e in range(2):
        rolls = []
        for q in range(3):
            for s in range(3):
                n = 20 + 10 * q + 3 * s
                toks = tuple(base[q:q + n - 1]) + (1,)
                rolls.append(rp.TraceRollout(e, f"p{q}", s, (5, 6, 7, q + 8), toks, "stop", 0.6))
        epochs[e] = rolls
    return epochs


def test_reprice_equals_simulation():
    """A speculation that ignores the cost model, simulated once and re-priced under another
    model, gives the decode time of a simulation under that model (paper_replay's shortcut)."""
    from das_jax.bench import paper_replay as pr
    from das_jax.bench import replay as rp
    from das_jax.config import DASSection
    from das_jax.engine import EngineConfig

    epochs = _tiny_epochs()
    ec = EngineConfig(max_slots=4, max_cache_len=256, draft_widths=(1, 4, 8))
    models = {"a": {"c_base": 0.02, "c_tok": 1e-3, "c_kv": 5e-6},
              "b": {"c_base": 0.005, "c_tok": 2e-5, "c_kv": 2e-8}}
    das = DASSection(window=4, max_depth=16, min_token_prob=0.1)
    got = pr.summarize(pr.replay_models(epochs, ["none", "suffix-global", "das"], ec, 64, models,
                                        das))
    ref = rp.replay_epochs(epochs, ["none", "suffix-global", "das"], ec, 64, models["b"], das)
    for name in ("none", "suffix-global", "das"):
        for g, r in zip(got["b"]["drafters"][name], ref[name]):
            assert g["forward_passes"] == r["forward_passes"], name
            assert g["decode_s"] == pytest.approx(r["decode_s"], rel=1e-9), name
    s = got["a"]["summary"]
    assert s["per_epoch"]["none"] == [1.0, 1.0] and len(s["subject_vs_best"]) == 2
    assert got["a"]["regime_none"] in rr.REGIMES.values()
    assert sum(got["a"]["shares"]["none"][k] for k in ("base", "tok", "kv")) == pytest.approx(1)
    md = pr.markdown(got)
    assert "**a**" in md and "**b**" in md and "| all |" in md


def test_length_stats_of_a_long_tail_and_a_capped_batch():
    from das_jax.bench.rollout_report import length_stats
    tail = length_stats([100, 120, 150, 200, 220, 250, 300, 400, 900, 1024], cap=1024)
    assert tail["median"] == 235.0 and tail["p90"] == 900 and tail["max"] == 1024
    assert tail["at_cap_share"] == 0.1 and tail["max_over_median"] == pytest.approx(1024 / 235)
    capped = length_stats([384] * 3 + [200], cap=384)
    assert capped["at_cap_share"] == 0.75 and capped["p90"] == 384 and capped["median"] == 384.0
    assert length_stats([], cap=10) == {"median": 0.0, "p90": 0, "max": 0,
                                        "max_over_median": 0.0, "at_cap_share": 0.0}
