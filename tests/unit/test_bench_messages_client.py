"""The bench's Messages client against ``httpx.MockTransport``: streamed text and tool-call
answers, TTFT at the first delta, usage and decision, failures returned, and the bodies it
sends for histories with tool calls (``bench.messages_client``, ``bench.tool_calls``)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvrelay.bench.client import ChatClient
from kvrelay.bench.messages_client import TOOLS, MessagesClient, messages_body
from kvrelay.bench.tool_calls import ToolUse, answer_tool_results

SSE = {"content-type": "text/event-stream"}
DECISION = {"x-kvrelay-action": "pull", "x-kvrelay-reason": "pull",
            "x-kvrelay-reused-tokens": "384"}
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Task: go"}]


def stream(*events: dict[str, Any]) -> str:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def start(input_tokens: int = 10, cache_read: int = 90) -> dict[str, Any]:
    return {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "tiny",
        "usage": {"input_tokens": input_tokens, "cache_read_input_tokens": cache_read,
                  "output_tokens": 0}}}


def block(content: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": 0, "content_block": content}


def text(piece: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": piece}}


def json_piece(piece: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": piece}}


def stop(output_tokens: int, reason: str = "max_tokens") -> tuple[dict[str, Any], ...]:
    return ({"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": reason},
             "usage": {"input_tokens": 10, "cache_read_input_tokens": 90,
                       "output_tokens": output_tokens}},
            {"type": "message_stop"})


def ticks() -> Callable[[], float]:
    """A clock that reads 0, 1, 2, ...: the client reads it once before sending and once per
    event, so a time is the event's position in the stream."""
    counter = itertools.count()
    return lambda: float(next(counter))


class Server:
    """Answers every request with ``respond(request)``, keeping the requests."""

    def __init__(self, respond: Callable[[httpx.Request], httpx.Response]) -> None:
        self.respond = respond
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)

    def client(self) -> MessagesClient:
        return MessagesClient("http://router", "tiny", clock=ticks(),
                              transport=httpx.MockTransport(self))

    def body(self, i: int = -1) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.requests[i].content)
        return result


async def test_a_streamed_text_answer_is_measured_from_its_first_block() -> None:
    server = Server(lambda r: httpx.Response(200, headers={**SSE, **DECISION}, text=stream(
        start(), block({"type": "text", "text": ""}), {"type": "ping"}, text("Hel"),
        text("lo"), text(" you"), *stop(3))))
    async with server.client() as client:
        r = await client.chat(HISTORY, max_tokens=3, conversation_id="c1")
    assert r.ok, r.error
    # event 1 is message_start, the answer's block starts with the 2nd; the first delta is
    # the 4th (after a ping), the last the 6th: TPOT over the deltas
    assert (r.ttft_s, r.tpot_s, r.e2e_s) == (2.0, 1.0, 10.0)
    assert (r.text, r.prompt_tokens, r.completion_tokens, r.tool_call) == (
        "Hello you", 100, 3, None)
    assert r.decision is not None
    assert (r.decision.action, r.decision.reused_tokens) == ("pull", 384)
    request = server.requests[0]
    assert request.url.path == "/v1/messages"
    assert request.headers["x-conversation-id"] == "c1"
    body = server.body()
    assert body["stream"] is True and body["max_tokens"] == 3
    assert body["tools"] == [dict(t) for t in TOOLS] and "tool_choice" not in body
    assert body["system"] == "be brief"
    assert body["messages"] == [{"role": "user", "content": "Task: go"}]


async def test_a_streamed_tool_call_is_parsed_from_its_json_deltas() -> None:
    server = Server(lambda r: httpx.Response(200, headers=SSE, text=stream(
        start(), block({"type": "tool_use", "id": "toolu_7", "name": "run", "input": {}}),
        json_piece('{"inp'), json_piece('ut": "ls'), json_piece(' -la"}'),
        *stop(60, "tool_use"))))
    async with server.client() as client:
        r = await client.chat(HISTORY, max_tokens=60, tool_call=True)
    assert r.ok, r.error
    assert r.tool_call == ToolUse("toolu_7", "run", '{"input": "ls -la"}')
    assert r.tool_call.input == {"input": "ls -la"}
    assert (r.ttft_s, r.text, r.completion_tokens) == (2.0, "", 60)
    assert r.tpot_s == 1.0  # over the argument deltas: the call's head came before them
    assert server.body()["tool_choice"] == {"type": "tool", "name": "run"}


async def test_a_call_cut_off_is_no_tool_call() -> None:
    server = Server(lambda r: httpx.Response(200, headers=SSE, text=stream(
        start(), block({"type": "tool_use", "id": "toolu_8", "name": "run", "input": {}}),
        json_piece('{"input": "ab'), *stop(20))))
    async with server.client() as client:
        r = await client.chat(HISTORY, max_tokens=20, tool_call=True)
    assert r.ok and r.tool_call is None and r.ttft_s == 2.0


async def test_without_a_block_start_the_first_delta_is_the_first_token() -> None:
    server = Server(lambda r: httpx.Response(200, headers=SSE, text=stream(
        start(), {"type": "ping"}, text("Hi"), text("!"), *stop(2))))
    async with server.client() as client:
        r = await client.chat(HISTORY, max_tokens=2)
    assert r.ok and (r.ttft_s, r.text) == (3.0, "Hi!")


async def test_failures_are_returned_not_raised() -> None:
    error_event = Server(lambda r: httpx.Response(200, headers=SSE, text=stream(
        start(), block({"type": "text", "text": ""}), text("a"),
        {"type": "error", "error": {"type": "internal_error", "message": "KV load failed"}},
        text("never read"))))
    refused = Server(lambda r: httpx.Response(
        503, json={"type": "error", "error": {"type": "overloaded_error", "message": "full"}}))
    empty = Server(lambda r: httpx.Response(200, headers=SSE, text=stream(start(), *stop(0))))

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    results = []
    for server in (error_event, refused, empty, Server(unreachable)):
        async with server.client() as client:
            results.append(await client.chat(HISTORY, max_tokens=4))
    assert [r.ok for r in results] == [False] * 4
    assert "KV load failed" in (results[0].error or "") and results[0].text == "a"
    assert (results[1].status, "overloaded_error" in (results[1].error or "")) == (503, True)
    assert results[2].error == "stream ended without content"
    assert (results[3].error or "").startswith("ConnectError")


async def test_a_whole_answer_carries_its_tool_call() -> None:
    server = Server(lambda r: httpx.Response(200, headers=DECISION, json={
        "id": "msg_2", "type": "message", "role": "assistant", "model": "tiny",
        "content": [{"type": "tool_use", "id": "toolu_9", "name": "run",
                     "input": {"input": "make"}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 5, "output_tokens": 70}}))
    async with server.client() as client:
        r = await client.chat(HISTORY, max_tokens=80, stream=False, tool_call=True)
    assert r.ok and r.tool_call == ToolUse("toolu_9", "run", '{"input": "make"}')
    assert (r.prompt_tokens, r.completion_tokens, r.ttft_s == r.e2e_s) == (5, 70, True)
    assert server.body()["stream"] is False


def test_a_history_with_a_tool_call_and_its_result_in_messages_form() -> None:
    call = ToolUse("toolu_1", "run", '{"input": "ls"}')
    history = [
        *HISTORY, call.message(),
        *answer_tool_results([{"role": "tool", "content": "Tool result:\nREADME"}], call),
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Task: next"},
    ]
    body = messages_body("tiny", history, max_tokens=32, stream=True, tool_call=False,
                         extra_body={"ignore_eos": True})
    assert body == {
        "model": "tiny", "max_tokens": 32, "temperature": 0.0, "stream": True,
        "ignore_eos": True, "tools": [dict(t) for t in TOOLS], "system": "be brief",
        "messages": [
            {"role": "user", "content": "Task: go"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "run", "input": {"input": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": "Tool result:\nREADME"}]},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Task: next"},
        ]}
    with pytest.raises(ValueError, match="tool_use_id"):
        messages_body("tiny", [*HISTORY, {"role": "tool", "content": "x"}], max_tokens=1,
                      stream=True, tool_call=False)


def test_the_tool_call_convention_round_trips() -> None:
    call = ToolUse("toolu_1", "run", '{"input": "ls"}')
    assert ToolUse.of_message(call.message()) == call
    assert ToolUse.of_message({"role": "assistant", "content": "text"}) is None
    assert ToolUse.of_message({"role": "user", "content": "x"}) is None
    # after an answer that made no call, the tool's result goes as the user's text
    assert answer_tool_results([{"role": "tool", "content": "r"}], None) == [
        {"role": "user", "content": "r"}]
    with pytest.raises(ValueError):
        _ = ToolUse("t", "run", "[1]").input


async def test_the_chat_client_refuses_to_force_a_tool_call() -> None:
    async with ChatClient("http://router", "tiny",
                          transport=httpx.MockTransport(lambda r: httpx.Response(500))) as c:
        with pytest.raises(ValueError, match="tool call"):
            await c.chat(HISTORY, max_tokens=4, tool_call=True)
