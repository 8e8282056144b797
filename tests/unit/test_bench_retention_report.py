"""The retention benchmark's arithmetic (``bench.retention_report``): block-seconds of a
sampled step function, the per-mode figures, and issue #21's goals."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.bench.metrics import TurnRecord
from kvrelay.bench.retention_bench import parse_retention_modes
from kvrelay.bench.retention_report import (
    DecodeTrace,
    RetentionSummary,
    block_seconds,
    check_goals,
    markdown_table,
    summarize_retention,
)


def turn(conv: str, number: int, ttft_s: float | None, action: str | None = "pull",
         reason: str | None = "pull", reused: int | None = 512,
         error: str | None = None, cause: str | None = None, *, tool_call: bool = False,
         made: bool | None = None, after_tool: bool = False) -> TurnRecord:
    return TurnRecord(
        mode="m", workload="agent", conversation_id=conv, turn=number, context_tokens=None,
        target_tokens=600, measured=True, think_s=0.0, sent_at_s=0.0, prompt_tokens=600,
        completion_tokens=8, ttft_s=ttft_s, tpot_s=None, e2e_s=1.0, action=action,
        reason=reason, reused_tokens=reused, decision_source="header", error=error,
        released_cause=cause, tool_call=tool_call,
        made_tool_call=tool_call if made is None else made, after_tool_call=after_tool)


def test_block_seconds_integrates_the_samples_as_steps_up_to_the_end() -> None:
    samples = [(0.0, 10, 0), (2.0, 4, 1), (3.0, 0, 0)]
    assert block_seconds(samples, 5.0) == 10 * 2 + 4 * 1 + 0 * 2
    # order does not matter, samples at or after the end are ignored, the last one holds
    assert block_seconds([(3.0, 6, 0), (1.0, 2, 0), (9.0, 100, 0)], 4.0) == 2 * 2 + 6 * 1
    assert block_seconds([], 4.0) == 0.0
    assert block_seconds([(5.0, 3, 0)], 4.0) == 0.0


def test_summary_counts_new_turns_follow_ups_and_hits() -> None:
    records = [
        turn("a", 1, 0.10, action="recompute", reason="new_conversation", reused=None),
        turn("a", 2, 0.05),
        turn("a", 3, 0.30, action="recompute", reason="released", reused=0, cause="pressure"),
        turn("a", 4, 0.30, action="recompute", reason="expired", reused=0),
        turn("b", 1, 0.20, action="recompute", reason="new_conversation", reused=None),
        turn("b", 2, 0.04, action="pull", reason="pull", reused=0),  # pulled nothing: a miss
        turn("c", 1, None, error="timeout"),
    ]
    trace = DecodeTrace(((0.0, 8, 0), (1.0, 16, 2), (2.0, 0, 0)), 4.0, 3,
                        {"pressure": 2, "expired": 0},
                        {"pressure": 0.25, "headroom": 0.5, "router": 0.0})
    s = summarize_retention("managed", records, trace, time_scale=10.0)
    assert (s.conversations, s.failed_turns) == (3, 1)
    assert s.new_ttft_p50_s == pytest.approx(0.15)
    assert s.new_ttft_p99_s == pytest.approx(0.10 + 0.10 * 0.99)
    assert (s.followups, s.pulled, s.hit_rate) == (4, 1, pytest.approx(1 / 4))
    assert s.block_seconds == pytest.approx((8 + 16) * 10.0)
    assert (s.peak_blocks, s.peak_waiting, s.preemptions) == (16, 2, 3)
    assert s.releases == {"pressure": 2}
    assert s.followup_reasons == {"pull/pull": 2, "recompute/expired": 1,
                                  "recompute/released": 1}
    # Each miss by why its turn was gone: D's release cause, the router's reason.
    assert s.misses == {"released/pressure": 1, "expired": 1, "pull": 1}
    # Beside the misses D caused by choosing, the ones it expected: the chances it released.
    assert s.expected_lost == pytest.approx(0.75)
    table = "\n".join(markdown_table({"managed": s}, []))
    assert "released/pressure 1" in table
    assert "| misses D chose / expected | 1 / 0.75 |" in table
    with pytest.raises(ValueError):
        summarize_retention("managed", records, trace, time_scale=0.0)



def test_follow_up_hits_split_by_what_they_continued() -> None:
    records = [
        turn("a", 1, 0.1, action="recompute", reason="new_conversation", reused=None,
             tool_call=True),
        turn("a", 2, 0.05, after_tool=True, tool_call=True),
        turn("a", 3, 0.05, action="recompute", reason="expired", reused=0, after_tool=True),
        turn("a", 4, 0.05, action="recompute", reason="expired", reused=0, tool_call=True,
             made=False),
        turn("a", 5, 0.05),  # the call was cut off: a follow-up of a reply
        turn("a", 6, None, error="timeout", after_tool=True),  # failed: not a follow-up
    ]
    s = summarize_retention("managed", records, DecodeTrace((), 1.0, 0), time_scale=1.0)
    assert (s.followups, s.pulled, s.hit_rate) == (4, 2, 0.5)  # the overall figure as ever
    assert (s.followups_after_tool, s.pulled_after_tool, s.hit_rate_after_tool) == (2, 1, 0.5)
    assert (s.followups_after_reply, s.pulled_after_reply, s.hit_rate_after_reply) == (
        2, 1, 0.5)
    assert (s.tool_call_turns, s.tool_calls_made) == (3, 2)
    table = "\n".join(markdown_table({"managed": s}, []))
    assert "| hit rate after a tool call | 50.0% (1/2) |" in table
    assert "| hit rate after a reply | 50.0% (1/2) |" in table
    assert "| tool-call turns (calls made) | 3 (2) |" in table
    none = summarize_retention("none", records[:1], DecodeTrace((), 1.0, 0), time_scale=1.0)
    assert none.hit_rate_after_tool is None and none.hit_rate_after_reply is None
    assert none.expected_lost is None  # D chose nothing: no retention of kvrelay's


def summary(mode: str, p99: float | None, hit: float | None, blocks: float,
            preemptions: int) -> RetentionSummary:
    return RetentionSummary(mode, 10, 0, p99, p99, 20, 0, hit, blocks, 0, 0, preemptions, {}, {})


def test_goals_hold_or_fail_on_their_thresholds() -> None:
    none = summary("none", 0.100, 0.0, 0.0, 1)
    stock = summary("stock", 5.0, 0.6, 1000.0, 4)
    good = check_goals({"managed": summary("managed", 0.110, 0.6, 500.0, 1), "stock": stock,
                        "none": none})
    assert [g.met for g in good] == [True, True, True, True]
    assert [g.measured for g in good] == [pytest.approx(1.1), 0.0, 0.5, 0.0]
    bad = check_goals({"managed": summary("managed", 0.111, 0.59, 501.0, 2), "stock": stock,
                       "none": none})
    assert [g.met for g in bad] == [False, False, False, False]
    assert bad[3].measured == 1.0


def test_goals_without_their_inputs_are_not_met_and_not_failed() -> None:
    goals = check_goals({"managed": summary("managed", 0.1, None, 0.0, 0)})
    assert [g.met for g in goals] == [None, None, None, None]
    zero_stock = check_goals({"managed": summary("managed", None, 0.5, 0.0, 0),
                              "stock": summary("stock", 1.0, 0.5, 0.0, 0)})
    assert zero_stock[2].met is None  # no ratio to a stock that retained nothing
    lines = markdown_table({"managed": summary("managed", 0.1, None, 0.0, 0)}, goals)
    assert lines[0] == "| | managed |" and any("| n/a |" in line for line in lines)


def test_modes_parse_in_the_order_given() -> None:
    assert parse_retention_modes("stock, managed") == ("stock", "managed")
    for bad in ("", "managed,managed", "pull"):
        with pytest.raises(ValueError):
            parse_retention_modes(bad)


async def test_the_warm_up_sends_one_short_turn_and_fails_loudly() -> None:
    import httpx

    from kvrelay.bench.client import ChatClient
    from kvrelay.bench.retention_bench import warm_up

    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=(
            'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
            "data: [DONE]\n\n"))

    async with ChatClient("http://router", "m", transport=httpx.MockTransport(ok)) as client:
        await warm_up(client, "managed-warmup")
    assert len(seen) == 1
    assert seen[0].headers["x-conversation-id"] == "managed-warmup"

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "no"}})

    async with ChatClient("http://router", "m", transport=httpx.MockTransport(down)) as client:
        with pytest.raises(RuntimeError, match="warm-up"):
            await warm_up(client, "managed-warmup")


async def test_the_warm_up_goes_over_the_benchs_api() -> None:
    import httpx

    from kvrelay.bench.messages_client import MessagesClient
    from kvrelay.bench.retention_bench import warm_up

    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=(
            'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
            '"delta": {"type": "text_delta", "text": "hi"}}\n\n'
            'event: message_stop\ndata: {"type": "message_stop"}\n\n'))

    async with MessagesClient("http://router", "m", transport=httpx.MockTransport(ok)) as c:
        await warm_up(c, "managed-warmup")
    assert [r.url.path for r in seen] == ["/v1/messages"]
    assert seen[0].headers["x-conversation-id"] == "managed-warmup"


def test_the_chat_api_cannot_send_tool_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvrelay.cli import main

    code = main(["bench", "retention", "--api", "chat", "--out", str(tmp_path)])
    assert code == 2
    assert "--tool-p 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_report_ends_with_what_hindsight_says_of_the_none_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's last line and the JSON's ``hindsight`` come from ``none``'s records:
    here two conversations each retain 8 blocks (1,000 tokens) while a third runs 5, in a D
    of 16 blocks: one of the two follow-ups is lost to D's size."""
    import json

    from kvrelay.bench import retention_bench
    from kvrelay.bench.report import ModeRun
    from kvrelay.bench.retention_bench import RetentionRun
    from kvrelay.cli import main
    from tests.unit.test_bench_hindsight import rec

    def fake_bench(workload: object, modes: object, run_dir: Path, options: object,
                   **_: object) -> list[RetentionRun]:
        records = [rec(c, 1, 0.0, prompt=1000, answer=1, ttft_s=0.1) for c in ("a", "b")] + \
            [rec(c, 2, 9.0, prompt=1100, answer=1, ttft_s=0.1) for c in ("a", "b")] + \
            [rec("c", 1, 4.0, prompt=600, answer=1, ttft_s=0.1)]
        trace = DecodeTrace(samples=((0.0, 0, 0),), end_s=10.0, num_preemptions=0)
        return [RetentionRun("none", ModeRun("none", records), trace)]

    monkeypatch.setattr(retention_bench, "run_retention_bench", fake_bench)
    code = main(["bench", "retention", "--modes", "none", "--decode-kv-blocks", "16",
                 "--conversations", "2", "--prelude-conversations", "0", "--out",
                 str(tmp_path)])
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("Hindsight (none's records): live requests plus the 2 turns")
    assert "peak at 21 of D's 16 blocks" in last and "loses at least 1 of" in last
    saved = json.loads((tmp_path / "retention.json").read_text())["hindsight"]
    assert saved == {"num_blocks": 16, "peak_blocks": 21, "forced_misses": 1,
                     "continued_turns": 2}
