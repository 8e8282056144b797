"""bench.showcase's arithmetic: per-pair ratios, their median and range, the verdict."""

from __future__ import annotations

import math

from kvrelay.bench.showcase import PairResult, ShowcaseResult, TurnOutcome, pair_order


def run(ttfts: list[float], *, reuse: bool) -> tuple[TurnOutcome, ...]:
    out = []
    for i, ttft in enumerate(ttfts, 1):
        action, reason = (("recompute", "no_entry") if i == 1 else
                          ("pull", "pull") if reuse else ("recompute", "cost_model"))
        out.append(TurnOutcome(i, 1000 * i, action, reason, 900 * (i - 1) if reuse else 0,
                               ttft, f"answer {i}"))
    return tuple(out)


def pair(first: str, reuse: list[float], baseline: list[float]) -> PairResult:
    return PairResult(first, run(reuse, reuse=True), run(baseline, reuse=False))  # type: ignore[arg-type]


def test_the_ratio_is_follow_up_ttft_without_over_with_reuse() -> None:
    p = pair("reuse", [5.0, 0.2, 0.3], [0.1, 1.0, 2.0])  # turn 1 does not count
    assert p.reuse_followups_s == 0.5 and p.baseline_followups_s == 3.0
    assert p.ratio == 6.0
    assert math.isnan(pair("reuse", [1.0, 0.0], [1.0, 1.0]).ratio)


def test_summary_gives_the_median_and_range_over_pairs() -> None:
    result = ShowcaseResult((pair("reuse", [1, 0.5], [1, 2.0]),
                             pair("baseline", [1, 0.5], [1, 3.0]),
                             pair("reuse", [1, 0.5], [1, 5.0])))
    assert result.ratios == [4.0, 6.0, 10.0]
    summary = result.summary()
    assert "**6.00x** (median of 3 pairs" in summary and "range 4.00x-10.00x" in summary
    assert "reuse is faster" in summary and "pulled on 3 of 3 follow-ups" in summary
    assert "Answers identical: yes" in summary
    assert result.pairs_table().splitlines()[3].startswith("| 2 | baseline |")


def test_a_mixed_or_reversed_outcome_is_said_so() -> None:
    mixed = ShowcaseResult((pair("reuse", [1, 1.0], [1, 0.5]), pair("baseline", [1, 1.0],
                                                                     [1, 2.0])))
    assert "no clear difference" in mixed.summary()
    slower = ShowcaseResult((pair("reuse", [1, 2.0], [1, 1.0]),))
    assert "reuse is slower" in slower.summary()


def test_recomputed_follow_ups_are_counted_with_their_reasons() -> None:
    reuse = run([1, 0.5, 0.5], reuse=False)  # the reusing router recomputed (cost_model)
    result = ShowcaseResult((PairResult("reuse", reuse, run([1, 0.5, 0.5], reuse=False)),))
    assert "pulled on 0 of 2 follow-ups and recomputed the rest (cost_model x2)" in (
        result.summary())


def test_pair_order_alternates() -> None:
    assert pair_order(3) == ["reuse", "baseline", "reuse"]
    assert pair_order(2, recompute_first=True) == ["baseline", "reuse"]
