"""Trace replay: the time-scaled settings, the workload a trace becomes (sizes, start times,
think times = scaled gaps, growing histories), the metrics it samples and how it compares."""

from __future__ import annotations

import math

import pytest

from kvrelay.bench.metrics import TurnRecord
from kvrelay.bench.tokens import byte_template_counter as count
from kvrelay.bench.trace_replay import (
    READER_MARGIN_S,
    ScaledSettings,
    gauge_sum,
    measured_hit_rate,
    time_weighted_mean,
    trace_workload,
)
from kvrelay.bench.workloads import planned_history
from kvrelay.tune.trace import TraceTurn


def test_scaled_settings_keep_the_pull_window_and_clear_the_reader_margin():
    for ttl, scale in ((60, 20), (300, 30), (1200, 1)):
        s = ScaledSettings.for_ttl(ttl, scale)
        window_real = s.engine_ttl_s - s.ttl_safety_margin_s - s.near_expiry_s
        assert window_real * scale == pytest.approx(ttl - 25.0)
        # when the router pulls at the end of its window, D has more than R left
        assert s.engine_ttl_s - window_real > READER_MARGIN_S
        assert s.d_pin_s == pytest.approx(ttl + READER_MARGIN_S * scale)
        assert s.router_expiry_s == pytest.approx(ttl - 10.0)
    with pytest.raises(ValueError):
        ScaledSettings.for_ttl(60, 0)


def turns():
    return [
        TraceTurn("a", 100.0, 400, 50),
        TraceTurn("b", 130.0, 300, 20),
        TraceTurn("a", 160.0, 700, 30),   # gap 60 s
        TraceTurn("a", 400.0, 500, 10),   # prompt shrinks: history is sent anyway
        TraceTurn("b", 131.0, 420, 5),    # gap 1 s
    ]


def test_a_trace_becomes_conversations_with_scaled_starts_and_gaps():
    w = trace_workload(turns(), count, time_scale=10.0, salt="s")
    a, b = w.conversations
    assert (a.start_s, b.start_s) == (0.0, 3.0)
    assert [t.think_s for t in a.turns] == [0.0, 6.0, 24.0]
    assert [t.think_s for t in b.turns] == [0.0, 0.1]
    assert [t.max_tokens for t in a.turns] == [50, 30, 10]
    assert w.concurrency == 2 and w.params["prompts_longer_than_trace"] == 1
    for conv in (a, b):
        for i, spec in enumerate(conv.turns):
            planned = count(planned_history(conv, i, count))
            if spec.target_tokens >= planned:
                assert spec.target_tokens - 8 < planned <= spec.target_tokens
    assert "[trace session s-0-0]" in a.turns[0].new_messages[0]["content"]


def test_decode_time_shortens_the_gap():
    w = trace_workload(turns(), count, time_scale=1.0, decode_s_per_token=0.1)
    assert w.conversations[0].turns[1].think_s == pytest.approx(60 - 5.0)


def test_gauge_sum_adds_every_labelled_sample():
    text = ("# HELP kvrelay_router_retained_tokens x\n# TYPE kvrelay_router_retained_tokens gauge\n"
            'kvrelay_router_retained_tokens{node="decode-0"} 100.0\n'
            'kvrelay_router_retained_tokens{node="decode-1"} 50.0\n'
            "# TYPE other gauge\nother 7\n")
    assert gauge_sum(text, "kvrelay_router_retained_tokens") == 150.0
    assert gauge_sum(text, "missing") is None


def test_time_weighted_mean_of_a_step_function():
    samples = [(0.0, 10.0), (1.0, 20.0), (3.0, 0.0)]
    assert time_weighted_mean(samples, 0.0, 4.0) == pytest.approx((10 + 40 + 0) / 4)
    assert time_weighted_mean(samples, 1.0, 3.0) == pytest.approx(20.0)
    assert math.isnan(time_weighted_mean([], 0.0, 1.0))


def record(turn, action, reused, error=None):
    return TurnRecord("m", "replay", "c", turn, None, 0, True, 0.0, 0.0, 10, 1,
                      None if error else 0.01, None, 0.01, action, action, reused, "headers",
                      error)


def test_measured_hit_rate_counts_follow_ups_served_from_d():
    records = [record(1, "recompute", 0), record(2, "pull", 100), record(3, "pull", 0),
               record(4, "recompute", 0), record(2, None, None, error="boom")]
    assert measured_hit_rate(records) == (3, 1 / 3, 1)


async def test_sampling_scrapes_the_router_gauge_and_the_d_usage():
    import asyncio

    import httpx

    from kvrelay.bench.trace_replay import PinnedSamples, sample_pinned

    scrapes = {"router": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "router":
            scrapes["router"] += 1
            value = 100.0 * scrapes["router"]
            return httpx.Response(200, text=(
                "# TYPE kvrelay_router_retained_tokens gauge\n"
                f'kvrelay_router_retained_tokens{{node="decode-0"}} {value}\n'
                f'kvrelay_router_retained_tokens{{node="decode-1"}} {value}\n'))
        return httpx.Response(200, text=(
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5\n'))

    samples = PinnedSamples()
    stop = asyncio.Event()
    task = asyncio.create_task(sample_pinned(
        "http://router", ["http://d0", "http://d1"], 11, 0.0, samples, stop, 0.001,
        transport=httpx.MockTransport(handler)))
    while len(samples.router) < 3:
        await asyncio.sleep(0.001)
    stop.set()
    await task
    assert samples.router_available()
    assert [v for _, v in samples.router[:3]] == [200.0, 400.0, 600.0]
    assert {v for _, v in samples.decode} == {2 * 0.5 * 10 * 128}


async def test_a_router_without_the_gauge_reads_as_not_exported():
    import asyncio

    import httpx

    from kvrelay.bench.trace_replay import PinnedSamples, sample_pinned

    samples = PinnedSamples()
    stop = asyncio.Event()
    transport = httpx.MockTransport(lambda r: httpx.Response(200, text="# nothing\n"))
    task = asyncio.create_task(sample_pinned("http://router", [], 11, 0.0, samples, stop,
                                             0.001, transport=transport))
    while not samples.router:
        await asyncio.sleep(0.001)
    stop.set()
    await task
    assert not samples.router_available()
