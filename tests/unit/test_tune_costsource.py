"""The cost model from the router's /stats (sample-weighted over P nodes) or flags, as
core.costs estimates with exactly those values."""

from __future__ import annotations

import json

import pytest

from kvrelay.tune.costsource import CostSourceError, CostValues, costs_from_stats, load_stats

STATS = {"nodes": [
    {"id": "prefill-0", "role": "prefill", "costs": {
        "prefill_s_per_token": 2e-4, "prefill_samples": 30, "transfer_s_per_token": 1e-5,
        "transfer_overhead_s": 0.01, "transfer_samples": 10}},
    {"id": "prefill-1", "role": "prefill", "costs": {
        "prefill_s_per_token": 4e-4, "prefill_samples": 10, "transfer_s_per_token": 3e-5,
        "transfer_overhead_s": 0.03, "transfer_samples": 30}},
    {"id": "decode-0", "role": "decode", "costs": None},
]}


def test_weighted_by_samples():
    v = costs_from_stats(STATS)
    assert v.prefill_s_per_token == pytest.approx((2e-4 * 30 + 4e-4 * 10) / 40)
    assert v.transfer_s_per_token == pytest.approx((1e-5 * 10 + 3e-5 * 30) / 40)
    assert v.transfer_overhead_s == pytest.approx((0.01 * 10 + 0.03 * 30) / 40)
    assert "2 P node(s), 40 prefill samples" in v.source


def test_without_samples_a_plain_mean():
    stats = json.loads(json.dumps(STATS))
    for n in stats["nodes"][:2]:
        n["costs"]["prefill_samples"] = n["costs"]["transfer_samples"] = 0
    assert costs_from_stats(stats).prefill_s_per_token == pytest.approx(3e-4)


def test_estimates_hold_exactly_the_values_and_flags_override():
    v = CostValues().with_overrides(prefill_s_per_token=5e-9, transfer_overhead_s=None,
                                    attention_knee_tokens=1000)
    est = v.estimates()
    assert est.prefill.fit.line.s_per_token == 5e-9  # below the router's floor: kept
    assert est.prefill.attention_knee_tokens == 1000
    assert est.pull_s(100) == pytest.approx(v.transfer_overhead_s + 100 * v.transfer_s_per_token)
    assert "flags: prefill_s_per_token=5e-09" in v.source


def test_bad_stats_and_values():
    with pytest.raises(CostSourceError, match="nodes"):
        costs_from_stats({"decisions": {}})
    with pytest.raises(CostSourceError, match="no P node"):
        costs_from_stats({"nodes": [{"costs": None}]})
    with pytest.raises(CostSourceError):
        CostValues(prefill_s_per_token=0)


def test_load_stats_from_a_file(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(STATS))
    assert load_stats(str(path)) == STATS
    with pytest.raises(CostSourceError):
        load_stats(str(tmp_path / "nope.json"))
