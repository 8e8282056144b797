"""core.retention_time: the per-turn retention time, from injected gaps and D's headroom."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.core.retention_time import (
    GAP_MAX_S,
    GapHistogram,
    RetentionTimeConfig,
    bin_of,
    bin_upper_s,
    decide_retain_s,
    plan_retention,
)

CONFIG = RetentionTimeConfig(quantile=0.9, min_samples=20, router_margin_s=25.0,
                             fit_tail=False)
"""The histogram's own quantile (the tail's fit has tests of its own below)."""
TTL = 480.0


def histogram(gaps: list[float], decay: float = 1.0) -> GapHistogram:
    h = GapHistogram()
    for gap in gaps:
        h = h.observe(gap, decay=decay)
    return h


def test_too_few_gaps_keep_the_prior_d_ttl() -> None:
    few = histogram([2.0] * 19)
    got = decide_retain_s([few], ttl_s=TTL, free_fraction=None, config=CONFIG)
    assert (got.retain_s, got.reason, got.gap_quantile_s) == (TTL, "prior", None)
    assert decide_retain_s([], ttl_s=TTL, free_fraction=0.9, config=CONFIG).retain_s == TTL


def test_short_think_times_retain_their_high_quantile_plus_the_router_margin() -> None:
    """Agents calling tools every 1-8 s: keep turns ~33 s, not 480 s; every follow-up
    observed (gap <= quantile) would still pull (gap <= retain_s - margin)."""
    rng = random.Random(7)
    gaps = [rng.uniform(1.0, 8.0) for _ in range(500)]
    got = decide_retain_s([histogram(gaps)], ttl_s=TTL, free_fraction=0.8, config=CONFIG)
    assert got.reason == "learned" and got.gap_quantile_s is not None
    assert got.retain_s == pytest.approx(got.gap_quantile_s + 25.0)
    share = sum(g <= got.retain_s - 25.0 for g in gaps) / len(gaps)
    assert share >= 0.9
    assert got.retain_s < 25.0 + 8.0 * 1.25  # within one bin of the true 90th percentile


def test_a_heavy_tail_is_kept_and_the_ttl_bounds_it() -> None:
    """10% of follow-ups come after 30 minutes: the 90th percentile sits in the tail, and D's
    TTL caps the result."""
    gaps = [3.0] * 850 + [1800.0] * 150
    got = decide_retain_s([histogram(gaps)], ttl_s=TTL, free_fraction=None, config=CONFIG)
    assert got.reason == "learned" and got.retain_s == TTL
    tail_short = [3.0] * 950 + [1800.0] * 50
    got = decide_retain_s([histogram(tail_short)], ttl_s=TTL, free_fraction=None,
                          config=CONFIG)
    assert got.retain_s < 40.0


def test_the_narrowest_histogram_with_enough_samples_decides() -> None:
    conversation = histogram([60.0] * 25)
    tenant = histogram([2.0] * 200)
    sparse = histogram([300.0] * 3)
    narrow = decide_retain_s([conversation, tenant], ttl_s=TTL, free_fraction=None,
                             config=CONFIG)
    assert narrow.gap_quantile_s is not None and 60.0 <= narrow.gap_quantile_s < 75.0
    wider = decide_retain_s([sparse, None, tenant], ttl_s=TTL, free_fraction=None,
                            config=CONFIG)
    assert wider.gap_quantile_s is not None and wider.gap_quantile_s < 2.5


def test_a_d_short_of_free_blocks_retains_shorter_never_below_the_floor() -> None:
    learned = histogram([100.0] * 100)
    roomy = decide_retain_s([learned], ttl_s=TTL, free_fraction=0.5, config=CONFIG)
    tight = decide_retain_s([learned], ttl_s=TTL, free_fraction=0.1, config=CONFIG)
    full = decide_retain_s([learned], ttl_s=TTL, free_fraction=0.0, config=CONFIG)
    assert roomy.reason == "learned" and tight.reason == full.reason == "headroom"
    assert tight.retain_s == pytest.approx(roomy.retain_s * 0.5)
    assert full.retain_s == pytest.approx(max(CONFIG.floor_s, roomy.retain_s * 0.25))
    prior_tight = decide_retain_s([], ttl_s=TTL, free_fraction=0.05, config=CONFIG)
    assert prior_tight.retain_s == pytest.approx(TTL * 0.25)
    instant = histogram([0.1] * 100)
    got = decide_retain_s([instant], ttl_s=TTL, free_fraction=0.0, config=CONFIG)
    assert got.retain_s == CONFIG.floor_s == 30.0
    assert decide_retain_s([instant], ttl_s=12.0, free_fraction=0.0, config=CONFIG
                           ).retain_s == 12.0  # a D TTL below the floor wins


def test_old_gaps_decay_so_a_changed_workload_is_followed() -> None:
    h = histogram([200.0] * 300, decay=0.99)
    before = decide_retain_s([h], ttl_s=TTL, free_fraction=None, config=CONFIG)
    for _ in range(300):
        h = h.observe(2.0, decay=0.99)
    after = decide_retain_s([h], ttl_s=TTL, free_fraction=None, config=CONFIG)
    assert before.retain_s > 200.0 and after.retain_s == CONFIG.floor_s


@given(st.floats(min_value=0.0, max_value=1e6, allow_nan=False))
def test_every_gap_lies_in_a_bin_whose_edge_covers_it(gap: float) -> None:
    i = bin_of(gap)
    assert gap <= bin_upper_s(i) * (1 + 1e-12) or bin_upper_s(i) == pytest.approx(GAP_MAX_S)
    if i > 0:
        assert gap > bin_upper_s(i - 1) * (1 - 1e-12)


def test_bad_input_is_refused_or_ignored() -> None:
    h = GapHistogram()
    assert h.observe(-1.0) == h and h.observe(float("nan")) == h
    with pytest.raises(ValueError):
        h.quantile_s(0.0)
    with pytest.raises(ValueError):
        decide_retain_s([], ttl_s=0.0, free_fraction=None, config=CONFIG)
    with pytest.raises(ValueError):
        RetentionTimeConfig(quantile=1.5)


def test_the_return_curve_is_the_gaps_fit_and_the_share_of_ends_that_came_back() -> None:
    """Of 100 turns that ended, 60 came back after gaps of 2 s or 8 s: the curve says 0.6 of
    them come back, log-normally around 4 s."""
    config = RetentionTimeConfig(min_samples=20, router_margin_s=25.0)
    h = GapHistogram()
    for i in range(100):
        h = h.end(decay=1.0)
        if i % 5 < 3:
            h = h.observe(2.0 if i % 2 else 8.0, decay=1.0)
    assert h.return_share() == pytest.approx(0.6)
    got = decide_retain_s([h], ttl_s=TTL, free_fraction=None, config=config)
    assert got.curve is not None and got.curve.return_p == pytest.approx(0.6)
    assert math.exp(got.curve.log_mean) == pytest.approx(4.0, rel=0.05)
    assert got.curve.log_sigma == pytest.approx(math.log(2.0), rel=0.05)
    # Before any end is counted every turn may come back; the prior has no curve.
    assert GapHistogram().return_share() == 1.0
    assert decide_retain_s([], ttl_s=TTL, free_fraction=None, config=config).curve is None
    # Ends and returns are weighted alike: an old share decays towards the recent one.
    recent = h
    for _ in range(2000):
        recent = recent.end(decay=0.99).observe(3.0, decay=0.99)
    assert recent.return_share() > 0.99


def test_tool_calls_and_replies_are_learned_apart_and_d_is_told_the_longer() -> None:
    """An agent: tool results come back in 1-8 s, users after 100-300 s. Before D answers
    nobody knows which it will be: D is told the replies' time; once the answer is a tool
    call, the entry keeps only the tools' time (``shortened``); a reply keeps D's."""
    rng = random.Random(3)
    tools = histogram([rng.uniform(1.0, 8.0) for _ in range(200)])
    users = histogram([rng.uniform(100.0, 300.0) for _ in range(50)])
    plan = plan_retention([None, tools], [None, users], ttl_s=TTL, free_fraction=None,
                          config=CONFIG)
    assert plan.tool.reason == plan.user.reason == "learned"
    assert plan.tool.retain_s < 25.0 + 8.0 * 1.25 < 100.0 + 25.0 <= plan.user.retain_s
    assert plan.on_d == plan.user == plan.after("user")
    assert plan.after("tool") == plan.tool
    assert plan.shortened("tool") and not plan.shortened("user")


def test_a_kind_with_too_few_gaps_keeps_d_at_the_prior_and_an_unseen_kind_does_not() -> None:
    """Few replies seen yet: their retention is the prior (D's TTL), and D is told it, so a
    reply's follow-up is not lost while it learns. No tool call ever seen (a chat deployment
    without tools): the replies' learned time is D's, as before kinds existed; a turn that
    ends in a tool call after all keeps it too."""
    tools = histogram([3.0] * 200)
    plan = plan_retention([tools], [histogram([150.0] * 5)], ttl_s=TTL, free_fraction=None,
                          config=CONFIG)
    assert plan.user.reason == "prior" and plan.on_d.retain_s == TTL
    assert plan.shortened("tool")
    chat_only = plan_retention([None, GapHistogram()], [histogram([150.0] * 200)], ttl_s=TTL,
                               free_fraction=None, config=CONFIG)
    assert chat_only.tool.reason == "prior" and chat_only.on_d == chat_only.user
    assert chat_only.on_d.reason == "learned" and chat_only.on_d.retain_s < TTL
    assert not chat_only.shortened("tool") and not chat_only.shortened("user")
    nothing = plan_retention([], [], ttl_s=TTL, free_fraction=None, config=CONFIG)
    assert nothing.on_d.retain_s == TTL and not nothing.shortened("tool")


def test_d_short_of_blocks_shortens_both_kinds() -> None:
    tools, users = histogram([3.0] * 100), histogram([200.0] * 100)
    roomy = plan_retention([tools], [users], ttl_s=TTL, free_fraction=0.5, config=CONFIG)
    tight = plan_retention([tools], [users], ttl_s=TTL, free_fraction=0.05, config=CONFIG)
    assert tight.on_d.reason == "headroom" and tight.on_d.retain_s < roomy.on_d.retain_s
    assert tight.tool.retain_s <= roomy.tool.retain_s


def test_the_tails_fit_reaches_where_a_few_hundred_gaps_cannot() -> None:
    """Tool gaps: log-normal (median 2.6 s, sigma 1.5) cut at a 120 s timeout (0.5% of them).
    150 of them show no timeout about half the time (this seed's longest is 82 s), and then
    their 0.997 quantile (their maximum) is short of it; the log-normal fit's 0.997 quantile
    is past it: every follow-up the timeout allows is caught, the retention errs long."""
    rng = random.Random(1)
    gaps = [min(120.0, rng.lognormvariate(0.954, 1.5)) for _ in range(150)]
    h = histogram(gaps)
    assert h.quantile_s(0.997) < 120.0 < h.fit_quantile_s(0.997)
    config = RetentionTimeConfig(router_margin_s=25.0)  # defaults: 0.997, fit_tail
    got = decide_retain_s([h], ttl_s=TTL, free_fraction=None, config=config)
    assert got.gap_quantile_s == pytest.approx(h.fit_quantile_s(0.997))
    assert 120.0 + 25.0 < got.retain_s < TTL
    no_fit = RetentionTimeConfig(router_margin_s=25.0, fit_tail=False)
    assert decide_retain_s([h], ttl_s=TTL, free_fraction=None, config=no_fit).reason == \
        "prior"  # 150 gaps are too few for a 0.997 quantile of their own (334 needed)
    assert no_fit.samples_needed == 334 and config.samples_needed == config.min_samples


def test_the_fit_never_shortens_what_the_histogram_shows() -> None:
    """Two clusters (a fit's worst case): the retention is the larger of the two."""
    h = histogram([1.0] * 500 + [300.0] * 10)
    config = RetentionTimeConfig(quantile=0.99, router_margin_s=25.0)
    got = decide_retain_s([h], ttl_s=TTL, free_fraction=None, config=config)
    assert got.gap_quantile_s == max(h.quantile_s(0.99), h.fit_quantile_s(0.99))
    assert got.gap_quantile_s >= 300.0


def test_the_fit_follows_the_gaps_and_refuses_bad_shares() -> None:
    assert GapHistogram().fit_quantile_s(0.5) == GAP_MAX_S
    same = histogram([8.0] * 50)
    assert same.fit_quantile_s(0.999) == pytest.approx(8.0)
    h = histogram([0.0, 2.0, 2.0])  # a follow-up sent at once counts as LOG_FLOOR_S
    assert 0.0 < h.fit_quantile_s(0.5) < 2.0
    with pytest.raises(ValueError):
        h.fit_quantile_s(1.0)
