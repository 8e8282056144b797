"""The TTL model on a hand-computed trace: hits, pulls, prefill saved, pinned KV (peak,
time-weighted p95 and mean per D), the router margin, the threshold, the cost rule."""

from __future__ import annotations

import math
from array import array

import pytest

from kvrelay.core.costs import CostEstimates
from kvrelay.tune.model import GIB, ModelParams, RetentionModel
from kvrelay.tune.retention import Retentions

INF = math.inf


def retentions(decode=(0, 0, 0, 0), names=("d0",)):
    # conversation A: turns end at 0 and 100 (gap 100); B: at 50 and 1050 (gap 1000)
    return Retentions(
        start_s=array("d", [0.0, 100.0, 50.0, 1050.0]),
        tokens=array("q", [1000, 2000, 500, 800]),
        decode=array("q", decode),
        gap_s=array("d", [100.0, INF, 1000.0, INF]),
        usable_tokens=array("q", [900, 0, 400, 0]),
        decode_names=names,
        first_at_s=0.0,
        last_at_s=1050.0,
        num_conversations=2,
    )


def params(**kw):
    values = dict(kv_bytes_per_token=float(GIB), router_margin_s=0.0)  # 1 token = 1 GiB
    values.update(kw)
    return ModelParams(**values)


def test_hand_computed_point():
    model = RetentionModel(retentions(), params())
    p = model.at(200.0)
    assert (p.followups, p.hits, p.pulls) == (2, 1, 1)
    assert p.hit_rate == 0.5 and p.tokens_reused == 900
    costs = CostEstimates()
    assert p.time_saved_s == pytest.approx(costs.prefill_s(900) - costs.pull_s(900))
    # A1 pinned 100 s (pulled), the others the whole TTL
    assert p.pinned_token_s == 1000 * 100 + 2000 * 200 + 500 * 200 + 800 * 200
    assert p.wasted_token_s == p.pinned_token_s - 1000 * 100
    # levels: [0,50) 1000, [50,100) 1500, [100,250) 2500, [250,300) 2000, [300,1050) 0
    (d,) = p.decode
    assert d.peak_gib == 2500
    assert d.mean_gib == pytest.approx((1000 * 50 + 1500 * 50 + 2500 * 150 + 2000 * 50) / 1050)
    assert d.p95_gib == 2500  # 95% of 1050 s falls in the top 150 s
    assert p.peak_gib == 2500 and p.p95_gib == 2500


def test_the_router_margin_shortens_the_window():
    model = RetentionModel(retentions(), params(router_margin_s=150.0))
    assert model.at(200.0).hits == 0  # window 50 s < gap 100 s
    assert model.at(250.0).hits == 1  # window 100 s: hit (gap <= window)
    assert model.at(100.0).hits == 0  # window negative


def test_below_the_threshold_a_hit_is_not_pulled_and_stays_pinned():
    model = RetentionModel(retentions(), params(threshold_tokens=1000))
    p = model.at(200.0)
    assert (p.hits, p.pulls, p.tokens_reused, p.time_saved_s) == (1, 0, 0, 0.0)
    assert p.pinned_token_s == (1000 + 2000 + 500 + 800) * 200


def test_a_pull_that_does_not_pay_is_not_made():
    assert not ModelParams(kv_bytes_per_token=1, pull_cost_factor=1e6).pull_pays(900)
    model = RetentionModel(retentions(), params(pull_cost_factor=1e6))
    assert model.at(200.0).pulls == 0


def test_per_d_memory():
    model = RetentionModel(retentions(decode=(0, 0, 1, 1), names=("d0", "d1")), params())
    d0, d1 = model.at(200.0).decode
    assert (d0.node, d0.peak_gib) == ("d0", 2000)  # A1 until 100, then A2
    assert (d1.node, d1.peak_gib) == ("d1", 800)


def test_longer_ttls_hit_more_and_the_ceiling_bounds_them():
    model = RetentionModel(retentions(), params())
    points = model.sweep([50, 200, 2000])
    assert [p.hits for p in points] == [0, 1, 2]
    ceiling = model.ceiling()
    assert ceiling.hits == 2 and ceiling.pulls == 2
    assert ceiling.time_saved_s == pytest.approx(points[-1].time_saved_s)


def test_ttl_for_a_target_hit_rate():
    model = RetentionModel(retentions(), params(router_margin_s=25.0))
    assert model.ttl_for_hit_rate(0.5) == 125.0
    assert model.ttl_for_hit_rate(0.51) == 1025.0
    assert model.at(125.0).hit_rate == 0.5
    with pytest.raises(ValueError):
        model.ttl_for_hit_rate(0.0)


def test_a_turn_that_retained_nothing_cannot_hit():
    r = retentions()
    r.tokens[0] = 0
    model = RetentionModel(r, params())
    assert model.at(2000.0).hits == 1
    assert model.ttl_for_hit_rate(1.0) is None


def test_series_shows_the_peak_and_pin_s_extends_what_nobody_pulled():
    model = RetentionModel(retentions(), params())
    s = model.series(200.0, bins=25)
    assert s.nodes == ("d0",) and len(s.t_s) == 25
    assert max(s.gib[0]) == 2500 and s.gib[0][-1] == 800
    assert model.mean_pinned_tokens(200.0, pin_s=400.0) > model.mean_pinned_tokens(200.0)


def test_router_view_entries_live_until_the_next_turn_or_expiry():
    model = RetentionModel(retentions(), params())
    # expiry 200: A1 100 s, A2 200 s, B1 200 s (replaced at 1050 only after expiry), B2 -
    expected = (1000 * 100 + 2000 * 200 + 500 * 200) / 1050
    assert model.mean_entry_tokens(200.0) * 1.0 == pytest.approx(expected)


def test_bad_params():
    with pytest.raises(ValueError):
        ModelParams(kv_bytes_per_token=0)
    with pytest.raises(ValueError):
        RetentionModel(retentions(), params()).at(0.0)
