"""The bench's agent workload with tool calls over ``/v1/messages``, through the real router
in front of fake engines (in process, real HTTP): forced turns answer with a ``tool_use``
block, the next turn sends its ``tool_result``, and the follow-ups pull, after a tool call as
after a reply."""

from __future__ import annotations

import json
from typing import Any

import httpx

from kvrelay.bench.execute import run_workload
from kvrelay.bench.messages_client import MessagesClient
from kvrelay.bench.tokens import byte_template_counter
from kvrelay.bench.workloads import Pacing, ThinkTime, agent_workload
from tests.component.router_fake import routed


class Recording(httpx.AsyncBaseTransport):
    """Real HTTP, every request's JSON body kept."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[dict[str, Any]] = []
        self.conversations: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))
            self.conversations.append(request.headers["x-conversation-id"])
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def blocks(bodies: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [b for body in bodies for m in body["messages"] if isinstance(m["content"], list)
            for b in m["content"] if b["type"] == kind]


async def test_follow_ups_of_tool_calls_pull_over_messages() -> None:
    workload = agent_workload(
        byte_template_counter, conversations=3, turns=5, system_tokens=400, user_tokens=60,
        answer_tokens=12, pacing=Pacing(ThinkTime("constant", 1.0), arrival_mean_s=0.0),
        tool_p=0.7, tool_time=ThinkTime("constant", 2.0), seed=1, salt="msgs")
    kinds = [t.tool_call for c in workload.conversations for t in c.turns[:-1]]
    assert any(kinds) and not all(kinds)  # follow-ups of both kinds
    async with routed() as r:
        gaps: list[float] = []

        async def settle(seconds: float) -> None:  # a think or tool time: D's report lands
            gaps.append(seconds)
            await r.settle()

        sent = Recording()
        async with MessagesClient(r.url, "tiny", transport=sent) as client:
            records = await run_workload(workload, client, mode="m", sleep=settle)
        assert {rec.endpoint for rec in r.cluster.decode[0].records} == {"messages"}
        assert all(rec.error is None for rec in records), [rec.error for rec in records]
        assert len(records) == workload.num_turns
        assert sorted(gaps) == sorted(t.think_s for c in workload.conversations
                                      for t in c.turns[1:])
        for rec, spec in zip(records, (t for c in workload.conversations for t in c.turns),
                             strict=True):
            assert rec.tool_call == spec.tool_call == rec.made_tool_call, rec
            if rec.turn == 1:
                assert rec.action == "recompute" and not rec.after_tool_call
                continue
            # every follow-up pulled what D kept of the previous turn
            assert rec.action == "pull" and (rec.reused_tokens or 0) > 0, rec
        after_tool = [rec for rec in records if rec.after_tool_call]
        after_reply = [rec for rec in records if rec.turn > 1 and not rec.after_tool_call]
        assert after_tool and after_reply
    # forced tool choice on the tool-call turns only; each follow-up of a call sent its
    # tool_result for the tool_use id the server gave; the same tools on every request
    for conv in workload.conversations:
        assert [b.get("tool_choice") is not None for b, c in zip(
            sent.bodies, sent.conversations, strict=True) if c == conv.conversation_id
        ] == [t.tool_call for t in conv.turns]
    assert len({json.dumps(b["tools"]) for b in sent.bodies}) == 1
    results = blocks(sent.bodies, "tool_result")
    assert results and {b["tool_use_id"] for b in results} == {
        b["id"] for b in blocks(sent.bodies, "tool_use")}
    assert all(set(b["input"]) == {"input"} for b in blocks(sent.bodies, "tool_use"))
