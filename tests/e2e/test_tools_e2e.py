"""Agent traffic on ``kvrelay up``: chat requests with ``tools`` through the router to the real
cluster, with the unmodified OpenAI SDK.

``kvrelay up`` enables auto tool choice with the ``hermes`` parser for the default (Qwen3)
model. Its random weights never choose to call a tool, so the tool calls here are *steered*:
with ``tool_choice="auto"`` a ``structured_outputs`` regex (vLLM's guided decoding) makes the
model write Qwen3's ``<tool_call>`` JSON, which the hermes parser turns into ``tool_calls``
(non-streamed, and as streamed deltas), and the conversation goes on with a ``tool`` message
as an agent's does.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import RealCluster, p_external

pytestmark = pytest.mark.e2e

CITIES = ("Oslo", "Rome")
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False},
}}]
#: Qwen3's tool-call format, as the default model's chat template renders it. (A tool with
#: ``"strict": true`` would make vLLM impose its own tool-call grammar instead of this one.)
STEER_TO_TOOL_CALL = {"structured_outputs": {"regex": (
    '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)"\\}\\}'
    "\\n</tool_call>")}}


def client_for(cluster: RealCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused")


def opening() -> list[Any]:
    return [{"role": "system", "content": "You are a travel agent. Use tools when useful."},
            {"role": "user", "content": "What should I pack for Oslo this week? " * 8}]


def decision(headers: httpx.Headers) -> tuple[str, str, int]:
    return (headers["x-kvrelay-action"], headers["x-kvrelay-reason"],
            int(headers["x-kvrelay-reused-tokens"]))


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_tools_with_auto_choice_answer_200(real_cluster: RealCluster, stream: bool):
    raw = client_for(real_cluster).chat.completions.with_raw_response.create(
        model=real_cluster.model, messages=opening(), tools=TOOLS, max_tokens=8,
        temperature=0, stream=stream)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-kvrelay-action"] == "recompute"
    if stream:
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    assert text


def test_tool_choice_none_answers_text(real_cluster: RealCluster):
    answer = client_for(real_cluster).chat.completions.create(
        model=real_cluster.model, messages=opening(), tools=TOOLS, tool_choice="none",
        max_tokens=8, temperature=0)
    message = answer.choices[0].message
    assert message.content and not message.tool_calls


def test_named_tool_choice_constrains_the_output_to_that_tool(real_cluster: RealCluster):
    """vLLM forces the named tool's call format (a grammar over ``<tool_call>{"name":
    "get_weather", "arguments": <JSON>}</tool_call>``); the random model (greedy) completes
    the call within the budget with the shortest JSON value it prefers, and the hermes parser
    returns it as a call of that tool and nothing else. What matters here: the request is
    served, and constrained."""
    raw = client_for(real_cluster).chat.completions.with_raw_response.create(
        model=real_cluster.model, messages=opening(), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48, temperature=0)
    assert raw.http_response.status_code == 200
    choice = raw.parse().choices[0]
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"], (choice.finish_reason, calls)
    json.loads(calls[0].function.arguments)  # the grammar made it JSON
    assert not choice.message.content


def test_steered_tool_call_round_trips_and_the_tool_turn_pulls(real_cluster: RealCluster):
    """Turn 1: the hermes parser turns the model's ``<tool_call>`` into ``tool_calls``. Turn 2
    sends that call back with a ``tool`` result, as an agent does: P pulls the history from D
    instead of recomputing it. Turn 3, streamed: the call arrives as deltas, and pulls."""
    client = client_for(real_cluster)
    extra = {"conversation_id": f"tools-{secrets.token_hex(4)}"}
    messages = opening()

    raw = client.chat.completions.with_raw_response.create(
        model=real_cluster.model, messages=messages, tools=TOOLS, max_tokens=200,
        temperature=0, extra_body={**extra, **STEER_TO_TOOL_CALL})
    first = raw.parse().choices[0]
    assert decision(raw.headers) == ("recompute", "no_entry", 0)
    assert first.finish_reason == "tool_calls"
    calls = first.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    city = json.loads(calls[0].function.arguments)["city"]
    assert city in CITIES

    messages += [
        {"role": "assistant", "content": first.message.content,
         "tool_calls": [{"id": c.id, "type": "function",
                         "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": f"{city}: 3 C, rain"},
    ]
    before = p_external(real_cluster)
    raw = client.chat.completions.with_raw_response.create(
        model=real_cluster.model, messages=messages, tools=TOOLS, max_tokens=12,
        temperature=0, stream=True, extra_body=extra)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    action, _, reused = decision(raw.headers)
    assert text
    assert action == "pull" and reused > 0
    assert p_external(real_cluster) - before == reused, "P's vLLM metrics must agree"

    messages += [{"role": "assistant", "content": text},
                 {"role": "user", "content": "And for Rome?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=real_cluster.model, messages=messages, tools=TOOLS, max_tokens=200,
        temperature=0, stream=True, extra_body={**extra, **STEER_TO_TOOL_CALL})
    chunks = list(raw.parse())
    assert decision(raw.headers)[0] == "pull"
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_weather"]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments)["city"] in CITIES
    assert any(c.choices and c.choices[0].finish_reason == "tool_calls" for c in chunks)
