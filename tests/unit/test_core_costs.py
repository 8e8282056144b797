from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.core.costs import (
    DEFAULT_PREFILL_S_PER_TOKEN,
    BoundedEwma,
    CostEstimates,
    PrefillEstimate,
    TransferEstimate,
)


def test_ewma_moves_part_way_towards_a_sample() -> None:
    est = BoundedEwma(value=1.0, floor=0.01, ceiling=100.0, alpha=0.5)
    after = est.observe(2.0)
    assert after.value == pytest.approx(1.5)
    assert after.num_samples == 1
    assert est.value == 1.0


def test_ewma_converges_to_a_steady_signal() -> None:
    est = BoundedEwma(value=1.0, floor=0.01, ceiling=100.0)
    for _ in range(100):
        est = est.observe(10.0)
    assert est.value == pytest.approx(10.0, rel=1e-3)


def test_ewma_stays_within_floor_and_ceiling() -> None:
    est = BoundedEwma(value=1.0, floor=0.5, ceiling=2.0, alpha=1.0, max_step_ratio=100.0)
    assert est.observe(1e9).value == 2.0
    assert est.observe(0.0).value == 0.5
    assert est.observe(-5.0).value == 0.5


def test_ewma_ignores_non_finite_samples() -> None:
    est = BoundedEwma(value=1.0, floor=0.5, ceiling=2.0)
    assert est.observe(math.nan) is est
    assert est.observe(math.inf) is est


def test_few_outliers_cannot_swing_the_estimate() -> None:
    est = BoundedEwma(value=1.0, floor=1e-6, ceiling=1e6)
    for _ in range(3):
        est = est.observe(1e5)
    assert est.value < 5.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"value": 0.0, "floor": 0.0, "ceiling": 1.0},
        {"value": 2.0, "floor": 0.1, "ceiling": 1.0},
        {"value": 0.5, "floor": 0.1, "ceiling": 1.0, "alpha": 0.0},
        {"value": 0.5, "floor": 0.1, "ceiling": 1.0, "max_step_ratio": 0.5},
    ],
)
def test_ewma_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BoundedEwma(**kwargs)  # type: ignore[arg-type]


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=30))
def test_ewma_bounds_property(samples: list[float]) -> None:
    est = BoundedEwma(value=1.0, floor=0.1, ceiling=10.0)
    for s in samples:
        est = est.observe(s)
        assert 0.1 <= est.value <= 10.0


def test_prefill_defaults_and_attention_term() -> None:
    est = PrefillEstimate()
    assert est.seconds(0) == 0.0
    assert est.seconds(1000) == pytest.approx(
        DEFAULT_PREFILL_S_PER_TOKEN * (1000 + 1000**2 / (2 * 32768))
    )
    assert est.seconds(1000, context_tokens=20_000) > est.seconds(1000)
    assert est.seconds(2000) == pytest.approx(
        est.seconds(1000) + est.seconds(1000, context_tokens=1000)
    )


def test_prefill_learns_from_observations() -> None:
    est = PrefillEstimate()
    true_rate = 1e-3
    for _ in range(60):
        secs = true_rate * est.work_tokens(500, 1500)
        est = est.observe(num_tokens=500, context_tokens=1500, seconds=secs)
    assert est.seconds_per_token.value == pytest.approx(true_rate, rel=1e-3)


@pytest.mark.parametrize(("n", "secs"), [(0, 1.0), (-3, 1.0), (10, -1.0), (10, math.nan)])
def test_prefill_ignores_nonsense(n: int, secs: float) -> None:
    est = PrefillEstimate()
    assert est.observe(num_tokens=n, context_tokens=0, seconds=secs) is est


def test_transfer_model() -> None:
    est = TransferEstimate()
    assert est.seconds(0) == 0.0
    assert est.seconds(1000) == pytest.approx(
        est.overhead_s.value + est.seconds_per_token.value * 1000
    )


def test_transfer_learns_rate_and_overhead() -> None:
    est = TransferEstimate()
    rate, overhead = 5e-5, 0.02
    for i in range(200):
        n = 100 if i % 2 else 4000
        est = est.observe(num_tokens=n, seconds=overhead + rate * n)
    assert est.seconds_per_token.value == pytest.approx(rate, rel=0.05)
    assert est.overhead_s.value == pytest.approx(overhead, rel=0.05)


def test_small_pulls_teach_the_overhead_not_the_rate() -> None:
    """A few small pulls with a large fixed cost must not make big pulls look expensive
    (the cost-model bias the fake engine's ``cpu`` preset exposed)."""
    est = TransferEstimate()
    overhead, rate = 0.040, 5e-6
    for _ in range(3):
        est = est.observe(num_tokens=160, seconds=overhead + rate * 160)
    assert est.seconds_per_token.value == TransferEstimate().seconds_per_token.value
    assert est.overhead_s.value > TransferEstimate().overhead_s.value
    prefill = PrefillEstimate().observe(num_tokens=1900, context_tokens=0, seconds=0.12)
    assert est.seconds(1900) < prefill.seconds(1900)  # a 2k pull still beats recomputing


def test_transfer_ignores_nonsense() -> None:
    est = TransferEstimate()
    assert est.observe(num_tokens=0, seconds=1.0) is est
    assert est.observe(num_tokens=10, seconds=math.inf) is est


def test_cost_estimates_defaults_favour_pull_above_the_threshold() -> None:
    costs = CostEstimates()
    assert costs.pull_s(64) < costs.prefill_s(64)
    assert costs.pull_s(0) == 0.0
