"""The agents' APIs on ``kvrelay up`` (real vLLM P/D, default model), with no conversation
id: the ``openai`` SDK's Responses API and the ``anthropic`` SDK's Messages API (``create``
and ``messages.stream``), each follow-up pulls, P's external-KV counter grows by exactly what
the router reused, and each API's cached-token field says so."""

from __future__ import annotations

import random
import secrets
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.conftest import GATEWAY_HEADER, RealCluster, p_external, words

pytestmark = pytest.mark.e2e

TURNS = 4


def opening(seed: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    return ("You are a coding agent. " + words(120, rng),
            [f"Tool result {i}: " + words(40, rng) for i in range(TURNS)])


def test_openai_responses_follow_ups_pull(real_cluster: RealCluster) -> None:
    client = openai.OpenAI(base_url=f"{real_cluster.router_url}/v1", api_key="unused",
                           max_retries=0)
    instructions, users = opening(22)
    items: list[Any] = [{"role": "user", "content": users[0]}]
    for turn in range(TURNS):
        before = p_external(real_cluster)
        common: dict[str, Any] = {"model": real_cluster.model, "instructions": instructions,
                                  "input": items, "store": False, "max_output_tokens": 12,
                                  "temperature": 0.0}
        if turn % 2 == 0:
            raw = client.responses.with_raw_response.create(**common)
            headers, response = raw.headers, raw.parse()
        else:
            with client.responses.with_streaming_response.create(**common, stream=True) as raw:
                headers = raw.headers
                done = [e for e in raw.parse() if e.type == "response.completed"]
            assert len(done) == 1
            response = done[0].response
        reused = int(headers["x-kvrelay-reused-tokens"])
        assert headers["x-kvrelay-reason"] == ("no_entry" if turn == 0 else "pull"), turn
        assert p_external(real_cluster) - before == reused
        assert response.usage is not None
        assert response.usage.input_tokens_details.cached_tokens == reused
        if turn:
            assert reused > 0
        items += [o.model_dump(exclude_none=True) for o in response.output]
        if turn + 1 < TURNS:
            items.append({"role": "user", "content": users[turn + 1]})
    client.close()


def test_anthropic_messages_create_and_stream_follow_ups_pull(real_cluster: RealCluster
                                                              ) -> None:
    client = anthropic.Anthropic(base_url=real_cluster.router_url, api_key="unused",
                                 max_retries=0)
    system, users = opening(23)
    messages: list[Any] = [{"role": "user", "content": users[0]}]
    for turn in range(TURNS):
        before = p_external(real_cluster)
        common: dict[str, Any] = {"model": real_cluster.model, "max_tokens": 12,
                                  "system": [{"type": "text", "text": system,
                                              "cache_control": {"type": "ephemeral"}}],
                                  "messages": messages,
                                  # this SDK's create() takes no temperature argument
                                  "extra_body": {"temperature": 0.0}}
        if turn % 2 == 0:
            raw = client.messages.with_raw_response.create(**common)
            headers, message = raw.headers, raw.parse()
        else:
            with client.messages.stream(**common) as stream:
                headers = stream.response.headers
                message = stream.get_final_message()
        reused = int(headers["x-kvrelay-reused-tokens"])
        assert headers["x-kvrelay-reason"] == ("no_entry" if turn == 0 else "pull"), turn
        assert p_external(real_cluster) - before == reused
        assert (message.usage.cache_read_input_tokens or 0) == reused
        if turn:
            assert reused > 0
        text = "".join(b.text for b in message.content if b.type == "text")
        messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        if turn + 1 < TURNS:
            messages.append({"role": "user", "content": users[turn + 1]})
    client.close()


#: A tool whose whole input is one of two literals: with ``strict`` vLLM's hermes structural
#: tag constrains the arguments to this schema, and an ``enum`` of objects compiles to the
#: literal JSON texts (no whitespace for the random model to pad until ``max_tokens``).
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "input_schema": {"type": "object", "enum": [{"city": "Oslo"}, {"city": "Rome"}]}}
FORCE_TOOL: dict[str, Any] = {"type": "tool", "name": "get_weather",
                              "disable_parallel_tool_use": True}
FORCE_ANY: dict[str, Any] = {"type": "any", "disable_parallel_tool_use": True}
#: Per turn: (streamed, the tool_choice forcing a tool_use, or None for a text answer).
TOOL_TURNS: list[tuple[bool, dict[str, Any] | None]] = [
    (False, FORCE_TOOL), (True, FORCE_ANY), (False, None),
    (True, FORCE_TOOL), (False, None), (True, None)]


def answer_of(message: Any) -> list[dict[str, Any]]:
    """An assistant answer as a client re-sends it, and as two answers compare (tool_use ids
    are vLLM's random ids: the comparison leaves them out)."""
    return [b.model_dump(exclude_none=True) for b in message.content]


def without_ids(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


def test_anthropic_tool_use_round_trips_pull_and_equal_recompute(real_cluster: RealCluster
                                                                 ) -> None:
    """Six turns through the ``anthropic`` SDK (``messages.create`` and ``messages.stream``
    alternating) with a tool: ``tool_choice`` (``tool`` and ``any``) forces vLLM to answer a
    ``tool_use`` block, the client answers each with a ``tool_result`` block, and the
    history with those blocks is found id-free: turns 2..6 pull, P's external-KV counter
    grows by exactly the router's reused tokens, ``cache_read_input_tokens`` (in the final
    ``message_delta`` event when streamed) equals them, and every answer equals the same
    request recomputed (a fresh gateway id: nothing to continue)."""
    client = anthropic.Anthropic(base_url=real_cluster.router_url, api_key="unused",
                                 max_retries=0)
    system, users = opening(24)
    messages: list[Any] = [{"role": "user", "content": "What should I pack for Oslo? "
                            + users[0]}]
    bodies: list[dict[str, Any]] = []
    answers: list[list[dict[str, Any]]] = []
    for turn, (streamed, choice) in enumerate(TOOL_TURNS):
        common: dict[str, Any] = {"model": real_cluster.model, "system": system,
                                  "tools": [WEATHER_TOOL], "messages": list(messages),
                                  "max_tokens": 12 if choice is None else 120,
                                  "extra_body": {"temperature": 0.0}}
        if choice is not None:
            common["tool_choice"] = choice
        bodies.append(common)
        before = p_external(real_cluster)
        if not streamed:
            raw = client.messages.with_raw_response.create(**common)
            headers, message = raw.headers, raw.parse()
            final_cache_read = message.usage.cache_read_input_tokens
        else:
            with client.messages.stream(**common) as stream:
                headers = stream.response.headers
                deltas = [e for e in stream if e.type == "message_delta"]
                message = stream.get_final_message()
            assert len(deltas) == 1
            final_cache_read = deltas[0].usage.cache_read_input_tokens
        reused = int(headers["x-kvrelay-reused-tokens"])
        assert headers["x-kvrelay-reason"] == ("no_entry" if turn == 0 else "pull"), turn
        assert p_external(real_cluster) - before == reused, turn
        assert final_cache_read == reused, turn
        assert (message.usage.cache_read_input_tokens or 0) == reused, turn
        if turn:
            assert reused > 0, turn
        content = answer_of(message)
        answers.append(content)
        uses = [b for b in content if b["type"] == "tool_use"]
        if choice is None:
            assert not uses, (turn, content)
            reply: list[dict[str, Any]] = [{"type": "text", "text": users[turn % len(users)]}]
        else:
            assert message.stop_reason == "tool_use", (turn, content)
            assert [(u["name"], u["input"]["city"] in ("Oslo", "Rome")) for u in uses] \
                == [("get_weather", True)], (turn, content)
            reply = [{"type": "tool_result", "tool_use_id": uses[0]["id"],
                      "content": f"{uses[0]['input']['city']}: 3 C, rain"}]
            if TOOL_TURNS[(turn + 1) % len(TOOL_TURNS)][1] is None:
                reply.append({"type": "text", "text": "Thanks. What should I pack?"})
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": reply}]
    for turn, common in enumerate(bodies):
        raw = client.messages.with_raw_response.create(
            **common, extra_headers={GATEWAY_HEADER: f"baseline-{secrets.token_hex(8)}"})
        assert (raw.headers["x-kvrelay-action"], raw.headers["x-kvrelay-reason"]) \
            == ("recompute", "no_entry")
        assert without_ids(answer_of(raw.parse())) == without_ids(answers[turn]), turn
    client.close()
