"""Driving a workload: history = prompts + the answers actually generated, think times,
concurrency, failures; and the pure stream meter behind the client's timings."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from kvrelay.bench.client import Decision, StreamMeter, TurnResult, decision_from_headers
from kvrelay.bench.execute import run_workload
from kvrelay.bench.tokens import byte_template_counter as count
from kvrelay.bench.tool_calls import ToolUse
from kvrelay.bench.workloads import (
    ConversationSpec,
    Pacing,
    ThinkTime,
    TurnSpec,
    Workload,
    agent_workload,
)


class FakeSender:
    """Answers ``answer-<n>`` for the n-th request; fails (conversation, turn) in ``fail``."""

    def __init__(self, fail=(), hold=None):
        self.calls = []
        self.fail = set(fail)
        self.hold = hold
        self.in_flight = 0
        self.max_in_flight = 0

    async def chat(self, messages, *, max_tokens, conversation_id=None, stream=True,
                   tool_call=False):
        self.calls.append((conversation_id, [dict(m) for m in messages], max_tokens))
        turn = sum(1 for c in self.calls if c[0] == conversation_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
        if (conversation_id, turn) in self.fail:
            return TurnResult(500, "", None, None, 0.01, None, 0, None, error="HTTP 500: x")
        decision = Decision("pull" if turn > 1 else "recompute", None, turn * 10, "headers")
        return TurnResult(200, f"answer-{len(self.calls)}", 0.01, 0.001, 0.02, 100, 3, decision)


class Sleeps:
    def __init__(self):
        self.calls = []

    async def __call__(self, seconds):
        self.calls.append(seconds)


async def test_each_prompt_extends_the_previous_prompt_and_the_generated_answer():
    w = agent_workload(count, conversations=2, turns=4, system_tokens=300, user_tokens=50,
                       answer_tokens=20, pacing=Pacing(ThinkTime("constant", 0.0), 0))
    sender = FakeSender()
    records = await run_workload(w, sender, mode="pull", id_prefix="run1-", sleep=Sleeps())
    by_conv = {}
    for conv_id, messages, max_tokens in sender.calls:
        by_conv.setdefault(conv_id, []).append(messages)
        assert max_tokens == 20
    assert set(by_conv) == {"run1-agent-0", "run1-agent-1"}
    for prompts in by_conv.values():
        for prev, cur in itertools.pairwise(prompts):
            assert cur[: len(prev)] == prev
            assert cur[len(prev)]["role"] == "assistant"
            assert cur[len(prev)]["content"].startswith("answer-")
            assert cur[len(prev) + 1]["role"] == "user"
    assert [(r.conversation_id, r.turn) for r in records] == [
        (f"run1-agent-{c}", t) for c in (0, 1) for t in (1, 2, 3, 4)]
    assert records[1].action == "pull" and records[1].reused_tokens == 20
    assert records[0].target_tokens == 350 and records[0].mode == "pull"


async def test_think_times_and_start_offsets_are_slept():
    convs = (
        ConversationSpec("a", (TurnSpec(({"role": "user", "content": "x"},), 5),
                               TurnSpec(({"role": "user", "content": "y"},), 5, think_s=2.5))),
        ConversationSpec("b", (TurnSpec(({"role": "user", "content": "z"},), 5),),
                         start_s=100.0),
    )
    sleeps = Sleeps()
    now = [0.0]
    records = await run_workload(Workload("agent", convs, concurrency=1), FakeSender(),
                                 mode="m", sleep=sleeps, clock=lambda: now[0])
    assert sleeps.calls == [2.5, 100.0]
    assert [r.think_s for r in records] == [0.0, 2.5, 0.0]


async def test_concurrency_is_bounded():
    w = agent_workload(count, conversations=6, turns=2, system_tokens=200, user_tokens=60,
                       answer_tokens=5,
                       pacing=Pacing(ThinkTime("constant", 0.0), 0, concurrency=3))
    hold = asyncio.Event()
    sender = FakeSender(hold=hold)
    task = asyncio.ensure_future(run_workload(w, sender, mode="m", sleep=Sleeps()))
    for _ in range(50):
        await asyncio.sleep(0)
    assert sender.in_flight == 3
    hold.set()
    records = await task
    assert len(records) == 12 and sender.max_in_flight == 3


async def test_a_failed_turn_ends_its_conversation_only():
    w = agent_workload(count, conversations=2, turns=4, system_tokens=200, user_tokens=60,
                       answer_tokens=5,
                       pacing=Pacing(ThinkTime("constant", 0.0), 0))
    seen = []
    records = await run_workload(w, FakeSender(fail={("agent-0", 2)}), mode="m",
                                 on_turn=lambda r, skipped: seen.append((r.turn, skipped)),
                                 sleep=Sleeps())
    assert [(r.conversation_id, r.turn, r.error is None) for r in records] == [
        ("agent-0", 1, True), ("agent-0", 2, False),
        ("agent-1", 1, True), ("agent-1", 2, True), ("agent-1", 3, True), ("agent-1", 4, True)]
    assert (2, 2) in seen and sum(1 + s for _, s in seen) == 8



class ToolSender:
    """Answers a forced turn with the tool call ``call-<n>`` (``cut``: the n-th request's
    forced call is cut off: text), any other with ``answer-<n>``."""

    def __init__(self, cut=()):
        self.calls = []
        self.cut = set(cut)

    async def chat(self, messages, *, max_tokens, conversation_id=None, stream=True,
                   tool_call=False):
        self.calls.append(([dict(m) for m in messages], tool_call))
        n = len(self.calls)
        if tool_call and n not in self.cut:
            call = ToolUse(f"call-{n}", "run", json.dumps({"input": f"cmd {n}"}))
            return TurnResult(200, "", 0.01, None, 0.02, 100, 60, None, tool_call=call)
        return TurnResult(200, f"answer-{n}", 0.01, None, 0.02, 100, 3, None)


def tool_result(text):
    return {"role": "tool", "content": f"Tool result:\n{text}"}


async def test_tool_calls_enter_the_history_and_their_results_carry_their_ids():
    turns = (
        TurnSpec(({"role": "user", "content": "Task: a"},), 70, tool_call=True),
        TurnSpec((tool_result("one"),), 70, think_s=3.0, tool_call=True),
        TurnSpec((tool_result("two"),), 10, think_s=4.0),
        TurnSpec(({"role": "user", "content": "Task: b"},), 70, think_s=9.0, tool_call=True),
        TurnSpec((tool_result("three"),), 10, think_s=1.0),
    )
    sender = ToolSender(cut={4})  # turn 4's forced call is cut off
    sleeps = Sleeps()
    records = await run_workload(Workload("agent", (ConversationSpec("c", turns),)), sender,
                                 mode="m", sleep=sleeps)
    assert [forced for _, forced in sender.calls] == [True, True, False, True, False]
    assert sleeps.calls == [3.0, 4.0, 9.0, 1.0]
    last = sender.calls[-1][0]
    assert last == [
        {"role": "user", "content": "Task: a"},
        ToolUse("call-1", "run", '{"input": "cmd 1"}').message(),
        {"role": "tool", "content": "Tool result:\none", "tool_use_id": "call-1"},
        ToolUse("call-2", "run", '{"input": "cmd 2"}').message(),
        {"role": "tool", "content": "Tool result:\ntwo", "tool_use_id": "call-2"},
        {"role": "assistant", "content": "answer-3"},
        {"role": "user", "content": "Task: b"},
        {"role": "assistant", "content": "answer-4"},  # the cut-off call: its text
        {"role": "user", "content": "Tool result:\nthree"},  # so its result as user text
    ]
    # (forced, the answer made a call, the turn followed a call)
    assert [(r.tool_call, r.made_tool_call, r.after_tool_call) for r in records] == [
        (True, True, False), (True, True, True), (False, False, True),
        (True, False, False), (False, False, False)]


def test_stream_meter_times_the_first_content_chunk():
    m = StreamMeter(started_s=10.0)
    m.feed('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', 10.5)
    m.feed('{"choices":[{"index":0,"delta":{"content":null}}]}', 10.7)
    m.feed('{"choices":[{"index":0,"delta":{"content":"He"}}]}', 11.0)
    m.feed('{"choices":[{"index":0,"delta":{"content":"llo"}}]}', 11.2)
    m.feed('{"choices":[{"index":0,"delta":{"content":"!"}}]}', 11.4)
    m.feed('{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}', 11.5)
    m.feed("[DONE]", 11.6)
    r = m.result(11.7, 200, None)
    assert r.ok and r.text == "Hello!"
    assert r.ttft_s == pytest.approx(1.0)
    assert r.tpot_s == pytest.approx(0.4 / 4)  # 5 tokens from usage, first to last chunk
    assert r.e2e_s == pytest.approx(1.7)
    assert (r.prompt_tokens, r.completion_tokens) == (7, 5)
    assert m.done


def test_stream_meter_without_usage_counts_chunks_and_flags_errors():
    m = StreamMeter(0.0)
    m.feed('{"choices":[{"delta":{"content":"a"}}]}', 1.0)
    m.feed('{"choices":[{"delta":{"content":"b"}}]}', 3.0)
    r = m.result(4.0, 200, None)
    assert r.completion_tokens == 2 and r.tpot_s == pytest.approx(2.0)
    assert r.prompt_tokens is None
    empty = StreamMeter(0.0)
    empty.feed('{"choices":[{"delta":{"role":"assistant"}}]}', 1.0)
    assert empty.result(2.0, 200, None).error == "stream ended without content"
    bad = StreamMeter(0.0)
    bad.feed('{"error":{"message":"kv load failed","code":500}}', 1.0)
    assert "kv load failed" in (bad.result(2.0, 200, None).error or "")
    junk = StreamMeter(0.0)
    junk.feed("{oops", 1.0)
    assert "malformed" in (junk.result(1.0, 200, None).error or "")


def test_decision_headers_are_parsed_case_insensitively():
    d = decision_from_headers({"X-KVRelay-Action": "pull", "x-kvrelay-reason": "pull",
                               "X-KVRELAY-REUSED-TOKENS": "4096"})
    assert d == Decision("pull", "pull", 4096, "headers")
    assert decision_from_headers({"x-kvrelay-action": "recompute",
                                  "x-kvrelay-reused-tokens": "n/a"}) == Decision(
        "recompute", None, None, "headers")
    assert decision_from_headers({"content-type": "text/event-stream"}) is None
