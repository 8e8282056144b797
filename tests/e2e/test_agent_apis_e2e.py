"""The agents' APIs on ``kvrelay up`` (real vLLM P/D, default model), with no conversation
id: the ``openai`` SDK's Responses API and the ``anthropic`` SDK's Messages API (``create``
and ``messages.stream``), each follow-up pulls, P's external-KV counter grows by exactly what
the router reused, and each API's cached-token field says so."""

from __future__ import annotations

import random
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.conftest import RealCluster, p_external, words

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
