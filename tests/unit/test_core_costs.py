"""core.costs: the cost lines and how they are learned, from injected samples only."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.core.consequences import learn_prefill
from kvrelay.core.costs import (
    DEFAULT_PREFILL_S_PER_TOKEN,
    CostEstimates,
    CostLine,
    CostLines,
    LineFit,
    PrefillEstimate,
    TransferEstimate,
)

PRIOR = CostLine(fixed_s=0.002, s_per_token=2e-5)


def test_cost_line() -> None:
    line = CostLine(0.5, 1e-3)
    assert line.seconds(0) == 0.5
    assert line.seconds(1000) == pytest.approx(1.5)


@pytest.mark.parametrize(("fixed", "rate"), [(-1.0, 1e-3), (0.0, 0.0), (math.nan, 1e-3),
                                             (0.0, math.inf)])
def test_cost_line_validates(fixed: float, rate: float) -> None:
    with pytest.raises(ValueError):
        CostLine(fixed, rate)


def test_a_fit_without_samples_predicts_its_prior() -> None:
    fit = LineFit.starting_at(PRIOR)
    assert fit.line == PRIOR and fit.num_samples == 0
    assert fit.seconds(4000) == PRIOR.seconds(4000)


def test_a_fit_finds_fixed_and_per_token_parts() -> None:
    """Noise-free samples of a line at two sizes: the fit recovers both parts."""
    true = CostLine(fixed_s=0.150, s_per_token=4e-5)
    fit = LineFit.starting_at(PRIOR)
    for i in range(60):
        n = 500 if i % 2 else 3000
        fit = fit.observe(n, true.seconds(n))
    assert fit.line.fixed_s == pytest.approx(true.fixed_s, rel=0.02)
    assert fit.line.s_per_token == pytest.approx(true.s_per_token, rel=0.02)
    assert fit.num_samples == 60


def test_a_few_samples_outweigh_the_prior() -> None:
    """Three samples at one size move the prediction there most of the way, however far
    the prior was (within the per-sample clamp): the data decide, not the priors."""
    fit = LineFit.starting_at(PRIOR)
    seen = 0.120  # ~3x the prior's 0.032 s at 1500 tokens
    for _ in range(3):
        fit = fit.observe(1500, seen)
    assert fit.seconds(1500) == pytest.approx(seen, rel=0.15)


def test_one_outlier_is_clamped_and_then_forgotten() -> None:
    """A cold first sample (a first NIXL handshake: 100x the usual) moves the prediction at
    most ``max_step_ratio`` times, and the next ordinary samples bring it back."""
    usual = 0.050
    fit = LineFit.starting_at(CostLine(0.002, usual / 2000))
    fit = fit.observe(2000, 100 * usual)
    assert fit.seconds(2000) <= fit.max_step_ratio * usual
    for _ in range(20):
        fit = fit.observe(2000, usual)
    assert fit.seconds(2000) == pytest.approx(usual, rel=0.1)


def test_the_fit_follows_a_change() -> None:
    """Old samples decay: a node that became 5x slower is predicted so within ~20 samples."""
    fit = LineFit.starting_at(PRIOR)
    for i in range(40):
        n = 800 if i % 2 else 2400
        fit = fit.observe(n, 0.01 + 1e-5 * n)
    for i in range(30):
        n = 800 if i % 2 else 2400
        fit = fit.observe(n, 5 * (0.01 + 1e-5 * n))
    assert fit.seconds(2400) == pytest.approx(5 * (0.01 + 1e-5 * 2400), rel=0.1)


@pytest.mark.parametrize(("x", "secs"), [(0, 1.0), (-3, 1.0), (10, -1.0), (10, math.nan),
                                         (10, math.inf), (math.nan, 1.0)])
def test_a_fit_ignores_nonsense(x: float, secs: float) -> None:
    fit = LineFit.starting_at(PRIOR)
    assert fit.observe(x, secs) is fit


@pytest.mark.parametrize("kwargs", [{"decay": 0.0}, {"decay": 1.5}, {"prior_weight": 0.0},
                                    {"max_step_ratio": 0.5}, {"min_s_per_token": 0.0}])
def test_a_fit_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LineFit.starting_at(PRIOR, **kwargs)


@given(st.lists(st.tuples(st.one_of(st.floats(min_value=-10, max_value=1e6), st.just(math.nan)),
                          st.floats(allow_nan=True, allow_infinity=True)), max_size=40))
def test_any_samples_leave_a_usable_line(samples: list[tuple[float, float]]) -> None:
    fit = LineFit.starting_at(PRIOR)
    for x, secs in samples:
        fit = fit.observe(x, secs)
        assert 0 <= fit.line.fixed_s <= fit.max_fixed_s
        assert fit.min_s_per_token <= fit.line.s_per_token <= fit.max_s_per_token
        assert math.isfinite(fit.seconds(100_000))


def test_prefill_seconds_are_marginal_and_the_call_adds_its_fixed_part() -> None:
    est = CostEstimates.from_lines(CostLines(prefill=CostLine(0.2, 1e-4))).prefill
    assert est.seconds(0) == 0.0
    assert est.seconds(1000) == pytest.approx(1e-4 * (1000 + 1000**2 / (2 * 32768)))
    assert est.call_seconds(1000) == pytest.approx(0.2 + est.seconds(1000))
    assert est.seconds(1000, context_tokens=20_000) > est.seconds(1000)
    assert est.seconds(2000) == pytest.approx(
        est.seconds(1000) + est.seconds(1000, context_tokens=1000))


def test_prefill_learns_its_line_from_calls() -> None:
    est = PrefillEstimate()
    true = CostLine(0.030, 1e-3)
    for i in range(60):
        n = 400 if i % 2 else 1600
        est = est.observe(num_tokens=n, context_tokens=0,
                          seconds=true.seconds(est.work_tokens(n)))
    assert est.fit.line.s_per_token == pytest.approx(true.s_per_token, rel=0.02)
    assert est.fit.line.fixed_s == pytest.approx(true.fixed_s, rel=0.05)


@pytest.mark.parametrize(("n", "secs"), [(0, 1.0), (-3, 1.0), (10, -1.0), (10, math.nan)])
def test_estimates_ignore_nonsense(n: int, secs: float) -> None:
    prefill, transfer = PrefillEstimate(), TransferEstimate()
    assert prefill.observe(num_tokens=n, context_tokens=0, seconds=secs) is prefill
    assert transfer.observe(num_tokens=n, seconds=secs) is transfer


def test_pull_costs_its_whole_line() -> None:
    est = TransferEstimate()
    assert est.seconds(0) == 0.0
    assert est.seconds(1000) == pytest.approx(est.fit.line.seconds(1000))


def test_from_lines_predicts_exactly_the_lines_given() -> None:
    lines = CostLines(prefill=CostLine(0.0, 5e-10), pull=CostLine(9.0, 2.0))  # out of bounds
    costs = CostEstimates.from_lines(lines, attention_knee_tokens=10**9)
    assert costs.lines == lines
    assert costs.prefill_s(1000) == pytest.approx(5e-7)
    assert costs.pull_s(10) == pytest.approx(29.0)


def test_defaults_favour_pull_above_the_threshold() -> None:
    costs = CostEstimates()
    assert costs.pull_s(64) < costs.prefill_s(64)
    assert costs.pull_s(0) == 0.0
    assert costs.lines.prefill.s_per_token == DEFAULT_PREFILL_S_PER_TOKEN


def recompute_then_pull(costs: CostEstimates, *, prefill: CostLine, pull: CostLine,
                        turns: int) -> CostEstimates:
    """``turns`` rounds of what a router sees: a first turn of 1k or 2k tokens recomputed
    (P's whole call on the ``prefill`` line), then a follow-up 100 tokens longer that pulled
    it (the call: the suffix's prefill plus the ``pull`` line)."""
    work = PrefillEstimate()
    for i in range(turns):
        n = 1000 if i % 2 else 2000
        costs = learn_prefill(costs, pulled=False, prompt_tokens=n, cached_tokens=0,
                              seconds=prefill.seconds(work.work_tokens(n)))
        call = prefill.seconds(work.work_tokens(100, n)) + pull.seconds(n)
        costs = learn_prefill(costs, pulled=True, prompt_tokens=n + 100, cached_tokens=n,
                              seconds=call)
    return costs


def test_cheap_recompute_is_learned_within_a_few_samples() -> None:
    """The tiny model's case: P's calls cost 100 ms fixed + 0.05 ms/token, a pull 150 ms
    fixed + 0.1 ms/token, so recomputing 1.5k tokens (~75 ms) beats pulling them (~300 ms).
    The priors say the opposite (pull 5x cheaper per token); three rounds of samples turn
    the prediction around."""
    prefill, pull = CostLine(0.100, 5e-5), CostLine(0.150, 1e-4)
    costs = recompute_then_pull(CostEstimates(), prefill=prefill, pull=pull, turns=3)
    assert costs.pull_s(1500) > costs.prefill_s(1500)
    costs = recompute_then_pull(costs, prefill=prefill, pull=pull, turns=20)
    assert costs.prefill.fit.line.fixed_s == pytest.approx(prefill.fixed_s, rel=0.1)


def test_expensive_prefill_keeps_pulling() -> None:
    """The bench model's case: recomputing 1.5k tokens costs ~0.9 s, pulling them ~60 ms."""
    prefill, pull = CostLine(0.030, 6e-4), CostLine(0.040, 1.5e-5)
    costs = recompute_then_pull(CostEstimates(), prefill=prefill, pull=pull, turns=3)
    assert costs.pull_s(1500) < costs.prefill_s(1500)
    costs = recompute_then_pull(costs, prefill=prefill, pull=pull, turns=40)
    assert costs.pull_s(1500) == pytest.approx(pull.seconds(1500), rel=0.1)
    assert costs.prefill_s(1500) == pytest.approx(
        prefill.s_per_token * PrefillEstimate().work_tokens(1500), rel=0.1)
