"""Issue #23, finding 5: how many messages, content parts, tools, tool calls and stop
sequences one request may carry, and a node is not marked down because one client made it
slow.

The router before the fix took 150 000 tiny messages (2.3 s of its CPU, on its event loop)
or 80 000 tools, and four such requests made the fake P too busy to answer its health
checks, so the router marked it down. Now each count has a limit (defaults far above real
agents), checked before anything is digested: beyond it 400 with an OpenAI error that names
the field, and no node sees the request. The limits are configurable (a TOML file here).
A health check that times out does not count against a node that keeps answering requests;
once it answers none, the same timeouts mark it down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.component.router_process import (
    Rig,
    eventually,
    fake_rig,
    openai_error_of,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "Name three rivers."}


def chat(messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2, "messages": messages or [USER], **extra}


def parts(n: int) -> list[dict[str, str]]:
    return [{"type": "text", "text": "x"} for _ in range(n)]


def tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {}}}
            for i in range(n)]


def calls(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"call_{start + i}", "type": "function",
             "function": {"name": "tool_0", "arguments": "{}"}} for i in range(n)]


def with_tool_calls(per_message: int, messages: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [USER]
    for m in range(messages):
        out.append({"role": "assistant", "content": "",
                    "tool_calls": calls(per_message, m * per_message)})
        out.append(USER)
    return out


#: (what, body, the error's param): one over each default limit.
OVER_DEFAULTS = [
    ("10 001 messages", chat([USER] * 10_001), "messages"),
    ("1 001 content parts in one message",
     chat([{"role": "user", "content": parts(1_001)}]), "messages"),
    ("20 001 content parts in all",
     chat([{"role": "user", "content": parts(1_000)}] * 20
          + [{"role": "user", "content": parts(1)}]), "messages"),
    ("1 001 tools", chat(tools=tools(1_001)), "tools"),
    ("10 001 tool calls in the history", chat(with_tool_calls(1_000, 10)
                                              + with_tool_calls(1, 1)), "messages"),
    ("65 stop sequences", chat(stop=[f"s{i}" for i in range(65)]), "stop"),
]

SMALL = """\
max_messages = 4
max_content_parts = 3
max_content_parts_total = 5
max_tools = 2
max_tool_calls = 3
max_stop_sequences = 2
health_timeout_s = 0.5
"""

#: (what, at the limit, one over): with the limits of ``SMALL``.
AT_AND_OVER = [
    ("messages", chat([USER] * 4), chat([USER] * 5)),
    ("content parts in one message", chat([{"role": "user", "content": parts(3)}]),
     chat([{"role": "user", "content": parts(4)}])),
    ("content parts in all",
     chat([{"role": "user", "content": parts(3)}, {"role": "user", "content": parts(2)}]),
     chat([{"role": "user", "content": parts(3)}, {"role": "user", "content": parts(3)}])),
    ("tools", chat(tools=tools(2)), chat(tools=tools(3))),
    ("tool calls", chat(with_tool_calls(3, 1)), chat(with_tool_calls(2, 2))),
    ("stop sequences", chat(stop=["a", "b"]), chat(stop=["a", "b", "c"])),
]


#: (what, path, body, the field named): one over a default limit through the other APIs
#: (probe 8b, finding 2: Responses ``input`` and Messages ``stop_sequences`` were counted
#: nowhere; a 250 000-item ``input`` cost the engines 7-8 s of CPU).
OVER_IN_OTHER_APIS = [
    ("10 001 Responses input items", "/v1/responses",
     {"model": "tiny", "max_output_tokens": 16, "input": [USER] * 10_001}, "input"),
    ("1 001 content parts in one input item", "/v1/responses",
     {"model": "tiny", "max_output_tokens": 16, "input": [
         {"role": "user", "content": [{"type": "input_text", "text": "x"}] * 1_001}]},
     "input"),
    ("65 Messages stop_sequences", "/v1/messages",
     {"model": "tiny", "max_tokens": 2, "messages": [USER],
      "stop_sequences": [f"s{i}" for i in range(65)]}, "stop_sequences"),
    # probe 12, finding G1: count_tokens was counted nowhere (150 000 messages answered)
    ("10 001 messages to count", "/v1/messages/count_tokens",
     {"model": "tiny", "messages": [USER] * 10_001}, "messages"),
    # finding G2: a namespace counted as one tool; vLLM renders every tool in it
    ("1 001 tools in a Responses namespace", "/v1/responses",
     {"model": "tiny", "max_output_tokens": 16, "input": "hi", "tools": [
         {"type": "namespace", "name": "ns", "description": "d", "tools": [
             {"type": "function", "name": f"f{i}", "parameters": {}}
             for i in range(1_001)]}]}, "tools"),
    ("1 001 tools across namespaces", "/v1/responses",
     {"model": "tiny", "max_output_tokens": 16, "input": "hi", "tools": [
         {"type": "namespace", "name": f"ns{n}", "description": "d", "tools": [
             {"type": "function", "name": f"f{i}", "parameters": {}}
             for i in range(143)]} for n in range(7)]}, "tools"),
    # probe 13, H1: a tool carrying a ``tools`` list counted as the list's (none)
    ("1 001 chat tools each carrying an empty tools list", "/v1/chat/completions",
     chat(tools=[{**t, "tools": []} for t in tools(1_001)]), "tools"),
    ("1 001 Messages tools to count, each with an empty tools list",
     "/v1/messages/count_tokens",
     {"model": "tiny", "messages": [USER], "tools": [
         {"name": f"t{i}", "input_schema": {"type": "object"}, "tools": []}
         for i in range(1_001)]}, "tools"),
    # finding G4: parts nested below an item's content were not counted
    ("1 001 blocks in a Messages tool_result", "/v1/messages",
     {"model": "tiny", "max_tokens": 2, "messages": [
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                       "content": [{"type": "text", "text": "x"}] * 1_001}]}]},
     "messages"),
    ("1 001 Messages system blocks", "/v1/messages",
     {"model": "tiny", "max_tokens": 2, "messages": [USER],
      "system": [{"type": "text", "text": "x"}] * 1_001}, "system"),
    ("1 001 parts in a function_call_output", "/v1/responses",
     {"model": "tiny", "max_output_tokens": 16, "input": [
         USER, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "c1",
          "output": [{"type": "input_text", "text": "x"}] * 1_001}]}, "input"),
    ("1 001 parts in a reasoning item's summary", "/v1/responses",
     {"model": "tiny", "max_output_tokens": 16, "input": [
         USER, {"type": "reasoning", "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "x"}] * 1_001}, USER]},
     "input"),
    ("20 001 nested parts in all", "/v1/messages",
     {"model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "x"}],
      "messages": [{"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": f"t{i}",
           "content": [{"type": "text", "text": "x"}] * 1_000}]} for i in range(20)]},
     "messages"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-counts")) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    log_dir = tmp_path_factory.mktemp("router-counts-small")
    config = Path(log_dir) / "router.toml"
    config.write_text(SMALL)
    async with fake_rig(log_dir, "--config", str(config), "--health-interval-s", "0.2") \
            as started:
        yield started


async def test_requests_over_the_default_counts_get_400_and_reach_no_node(rig: Rig) -> None:
    before = rig.generation_requests()
    problems = []
    async with rig.router.client() as c:
        for what, body, param in OVER_DEFAULTS:
            resp = await c.post(CHAT, json=body)
            if resp.status_code != 400:
                problems.append(f"{what}: HTTP {resp.status_code}")
                continue
            error = openai_error_of(resp)["error"]
            if error["param"] != param or "array too long" not in error["message"]:
                problems.append(f"{what}: {error}")
        reached = rig.generation_requests() - before
        ok = await c.post(CHAT, json=chat())
    assert not problems, "\n".join(problems)
    assert reached == 0, f"refused requests reached a node {reached} times"
    assert ok.status_code == 200, ok.text


async def test_every_api_s_lists_are_counted_and_refused_in_its_own_error_shape(
    rig: Rig,
) -> None:
    before = rig.generation_requests()
    problems = []
    async with rig.router.client() as c:
        for what, path, body, field in OVER_IN_OTHER_APIS:
            resp = await c.post(path, json=body)
            doc = resp.json() if resp.status_code == 400 else {}
            error = doc.get("error", {})
            if path.startswith("/v1/messages"):  # Anthropic's shape: the field in the text
                ok = doc.get("type") == "error" and f"'{field}" in error.get("message", "")
            else:
                ok = error.get("param") == field
            if not ok or "array too long" not in error.get("message", ""):
                problems.append(f"{what}: HTTP {resp.status_code} {resp.text[:300]}")
        reached = rig.generation_requests() - before
    assert not problems, "\n".join(problems)
    assert reached == 0, f"refused requests reached a node {reached} times"


async def test_the_counts_are_configurable_and_a_request_at_each_limit_is_served(
    small: Rig,
) -> None:
    problems = []
    async with small.router.client() as c:
        for what, at_limit, over in AT_AND_OVER:
            resp = await c.post(CHAT, json=at_limit)
            if resp.status_code != 200:
                problems.append(f"{what} at the limit: HTTP {resp.status_code} {resp.text}")
            resp = await c.post(CHAT, json=over)
            if resp.status_code != 400 or "array too long" not in resp.text:
                problems.append(f"{what} over the limit: HTTP {resp.status_code} {resp.text}")
    assert not problems, "\n".join(problems)


def p_up(metrics: Any) -> float | None:
    return metrics.value("kvrelay_router_node_up", role="prefill")


async def test_a_node_that_keeps_answering_is_not_marked_down_by_health_timeouts(
    small: Rig,
) -> None:
    """P's ``/health`` hangs (an API server too busy to answer it) while a client keeps
    being served: P stays up for many timed-out checks; once nobody is served, the same
    timeouts mark it down (``health_failures_to_down`` 2)."""
    p = small.cluster.prefill[0]
    router = small.router
    stop = asyncio.Event()
    statuses: list[int] = []

    async def keep_chatting() -> None:
        async with router.client() as c:
            while not stop.is_set():
                statuses.append((await c.post(CHAT, json=chat())).status_code)

    p.faults.health_hang = True
    client = asyncio.create_task(keep_chatting())
    try:
        start = p.num_health_requests
        await until(lambda: p.num_health_requests >= start + 6 or client.done(),
                    "six health checks of P while the client is served")
        stop.set()
        await client
        assert p_up(await router.metrics()) == 1.0, (
            "P was marked down by health checks that timed out while it answered requests")
        assert statuses and set(statuses) == {200}, statuses
        await eventually(router.metrics, lambda m: p_up(m) == 0.0,
                         "P marked down once it answers nothing and its checks time out")
    finally:
        stop.set()
        p.faults.health_hang = False
        with contextlib.suppress(Exception):
            await client
    await eventually(router.metrics, lambda m: p_up(m) == 1.0, "P up again")
