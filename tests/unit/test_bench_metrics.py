"""Summaries of benchmark records: percentiles, hit rates, per-turn and per-context means,
and the recompute/pull and pull/local ratios."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.bench.metrics import Dist, TurnRecord, compare, percentile, summarize


def rec(turn=1, ttft=0.1, *, mode="pull", conv="c0", action=None, reason=None, reused=None,
        context=None, measured=True, error=None, tpot=None, e2e=1.0):
    return TurnRecord(mode=mode, workload="agent", conversation_id=conv, turn=turn,
                      context_tokens=context, target_tokens=100, measured=measured, think_s=0.0,
                      sent_at_s=0.0, prompt_tokens=100, completion_tokens=10, ttft_s=ttft,
                      tpot_s=tpot, e2e_s=e2e, action=action, reason=reason,
                      reused_tokens=reused, decision_source="headers" if action else None,
                      error=error)


def test_percentile_interpolates_linearly():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_dist_of_empty_is_none():
    assert Dist.of([]) is None
    d = Dist.of([1.0, 2.0, 3.0])
    assert d is not None and (d.count, d.mean, d.p50, d.min, d.max) == (3, 2.0, 2.0, 1.0, 3.0)


def test_summary_hit_rate_counts_pulls_among_decided_later_turns():
    records = [
        rec(1, 0.5, action="recompute", reason="no_entry"),
        rec(2, 0.1, action="pull", reason="pull", reused=1000),
        rec(3, 0.1, action="pull", reason="pull", reused=2000),
        rec(4, 0.4, action="recompute", reason="expired", reused=0),
        rec(5, 0.2, action="direct", reason="direct", reused=3000),
        rec(6, 0.3),  # decision unknown: not in the denominator
        rec(7, None, error="HTTP 500: boom", action="pull"),  # failed: not counted
    ]
    s = summarize("pull", "agent", records)
    assert s.turns == 7 and s.errors == 1
    assert s.decided_later_turns == 4
    assert s.hit_rate == pytest.approx(2 / 4)
    assert s.reuse_rate == pytest.approx(3 / 4)
    assert s.actions == {"direct": 1, "pull": 2, "recompute": 2}
    assert s.reasons["expired"] == 1
    assert s.reused_tokens_mean == pytest.approx((1000 + 2000 + 0 + 3000) / 4)
    assert s.ttft is not None and s.ttft.count == 6
    assert s.ttft_later_turns is not None and s.ttft_later_turns.count == 5


def test_summary_without_decisions_has_no_hit_rate():
    s = summarize("x", "agent", [rec(1), rec(2)])
    assert s.hit_rate is None and s.reuse_rate is None and s.decided_later_turns == 0


def test_per_turn_means_and_per_context_measured_turns():
    records = [
        rec(1, 1.0, conv="a", context=2048, measured=False),
        rec(2, 0.2, conv="a", context=2048),
        rec(1, 3.0, conv="b", context=2048, measured=False),
        rec(2, 0.4, conv="b", context=2048),
        rec(1, 5.0, conv="c", context=4096, measured=False),
        rec(2, 0.9, conv="c", context=4096),
    ]
    s = summarize("pull", "sweep", records)
    assert s.ttft_by_turn == pytest.approx({1: 3.0, 2: 0.5})
    assert set(s.ttft_by_context) == {2048, 4096}
    assert s.ttft_by_context[2048].p50 == pytest.approx(0.3)
    assert s.ttft_by_context[4096].count == 1


def test_tpot_and_e2e_distributions():
    s = summarize("m", "agent", [rec(1, tpot=0.01, e2e=2.0), rec(2, tpot=0.03, e2e=4.0),
                                 rec(3, tpot=None, e2e=6.0)])
    assert s.tpot is not None and s.tpot.p50 == pytest.approx(0.02) and s.tpot.count == 2
    assert s.e2e is not None and s.e2e.p50 == pytest.approx(4.0)


def test_comparisons_divide_p50_ttfts_per_context():
    def sweep(mode, factor):
        out = []
        for ctx, base in ((2048, 0.1), (4096, 0.2)):
            out += [rec(1, 9.0, mode=mode, context=ctx, measured=False),
                    rec(2, base * factor, mode=mode, context=ctx)]
        return summarize(mode, "sweep", out)

    summaries = {"pull": sweep("pull", 1.0), "recompute": sweep("recompute", 3.0),
                 "local": sweep("local", 0.5)}
    ratios = {c.label: c for c in compare(summaries)}
    assert set(ratios) == {"recompute/pull", "pull/local"}
    assert ratios["recompute/pull"].by_context == pytest.approx({2048: 3.0, 4096: 3.0})
    assert ratios["pull/local"].by_context == pytest.approx({2048: 2.0, 4096: 2.0})
    assert ratios["recompute/pull"].overall == pytest.approx(3.0)
    only_pull = compare({"pull": summaries["pull"]})
    assert only_pull == []


def test_record_json_round_trip():
    r = rec(3, 0.25, action="pull", reason="pull", reused=512, context=2048)
    assert TurnRecord.from_json(r.to_json()) == r
    assert TurnRecord.from_json(replace(r, ttft_s=None, error="x").to_json()).succeeded is False
