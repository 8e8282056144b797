"""The recommendation rules: the best TTL within a budget (a bigger budget never recommends a
shorter TTL), the knee without one (longer gaps recommend a longer TTL), and the threshold
below which a pull does not pay."""

from __future__ import annotations

import pytest

from kvrelay.tune.costsource import CostValues
from kvrelay.tune.model import GIB, ModelParams, RetentionModel, TtlPoint
from kvrelay.tune.recommend import pull_threshold, recommend_ttl
from kvrelay.tune.retention import RetentionBuilder
from kvrelay.tune.synth import GapMixture, LogNormalPause, SynthSpec, synth_trace
from kvrelay.tune.trace import turns_from_records

GRID = (30, 45, 60, 90, 120, 180, 300, 480, 600, 900, 1200, 1800, 3600)


def model_of(spec: SynthSpec, num_decode: int = 2) -> RetentionModel:
    b = RetentionBuilder(num_decode=num_decode).add_all(turns_from_records(synth_trace(spec)))
    return RetentionModel(b.finish(), ModelParams(kv_bytes_per_token=2 * 28 * 8 * 128 * 2))


def spec(seed: int, gap_scale: float = 1.0, conversations: int = 300) -> SynthSpec:
    return SynthSpec(conversations=conversations, seed=seed, conversations_per_s=0.2,
                     duration_s=1500, gaps=GapMixture().scaled(gap_scale))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_bigger_budget_never_recommends_a_shorter_ttl(seed):
    model = model_of(spec(seed))
    points = model.sweep(GRID)
    ceiling = model.ceiling()
    peaks = sorted({p.peak_gib for p in points})
    budgets = [peaks[0] * 0.5, *peaks, *(x * 1.01 for x in peaks), peaks[-1] * 3]
    chosen = [recommend_ttl(points, ceiling, budget_gib=b).ttl_s for b in sorted(budgets)]
    ttls = [-1.0 if t is None else t for t in chosen]
    assert ttls == sorted(ttls)
    assert chosen[0] is None and chosen[-1] is not None
    for budget_stat in ("peak", "p95"):
        rec = recommend_ttl(points, ceiling, budget_gib=peaks[len(peaks) // 2],
                            budget_stat=budget_stat)
        fits = [p for p in points if (p.peak_gib if budget_stat == "peak" else p.p95_gib)
                <= peaks[len(peaks) // 2]]
        best = max(p.time_saved_s for p in fits)
        assert rec.ttl_s == min(p.ttl_s for p in fits if p.time_saved_s == best)


def test_longer_gaps_recommend_a_longer_ttl_without_a_budget():
    chosen = []
    for scale in (0.25, 1.0, 4.0):
        model = model_of(spec(5, gap_scale=scale))
        rec = recommend_ttl(model.sweep(GRID), model.ceiling())
        assert rec.rule == "knee" and rec.ttl_s is not None
        chosen.append(rec.ttl_s)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]


def test_knee_is_the_shortest_ttl_reaching_the_fraction():
    model = model_of(spec(6))
    points = model.sweep(GRID)
    ceiling = model.ceiling()
    rec = recommend_ttl(points, ceiling, knee_fraction=0.8)
    reached = [p for p in points if p.time_saved_s >= 0.8 * ceiling.time_saved_s]
    assert rec.ttl_s == reached[0].ttl_s
    assert "80%" in rec.reasoning[0]


def test_no_ttl_fits_a_tiny_budget_and_the_reason_says_so():
    model = model_of(spec(7))
    rec = recommend_ttl(model.sweep(GRID), model.ceiling(), budget_gib=1e-6)
    assert rec.ttl_s is None and "No TTL of the grid fits" in rec.reasoning[0]


def test_knee_beyond_the_grid_returns_its_longest_ttl():
    model = model_of(spec(8, gap_scale=50.0))
    rec = recommend_ttl(model.sweep((30, 60)), model.ceiling())
    assert rec.ttl_s == 60 and "extend --ttls" in rec.reasoning[0]


def test_threshold_is_where_a_pull_starts_to_pay():
    for overhead, rate in ((2e-3, 2e-5), (0.04, 5e-6), (1e-4, 9e-5)):
        costs = CostValues(1e-4, overhead, rate).estimates()
        params = ModelParams(kv_bytes_per_token=1.0, costs=costs)
        n = pull_threshold(params)
        assert n is not None and params.pull_pays(n)
        assert n == 1 or not params.pull_pays(n - 1)
    slow = ModelParams(kv_bytes_per_token=1.0, costs=CostValues(1e-4, 5.0, 1e-5).estimates())
    assert pull_threshold(slow, max_tokens=1000) is None
    assert pull_threshold(slow) is not None  # quadratic prefill wins eventually


def test_a_higher_transfer_overhead_raises_the_threshold():
    low = pull_threshold(ModelParams(1.0, CostValues(1e-4, 1e-3, 2e-5).estimates()))
    high = pull_threshold(ModelParams(1.0, CostValues(1e-4, 1e-2, 2e-5).estimates()))
    assert low is not None and high is not None and high > low


def test_points_must_be_given():
    with pytest.raises(ValueError):
        recommend_ttl([], TtlPoint(1, 0, 0, 0, 0, 0, 0, 0, ()))


def test_a_pause_is_log_normal_from_its_median_and_p90():
    pause = LogNormalPause(2.0, 20.0)
    assert pause.cdf(2.0) == pytest.approx(0.5)
    assert pause.cdf(20.0) == pytest.approx(0.9)
    assert GIB == 2**30
