"""Agent conversations over the Responses API on ``kvrelay up`` (real vLLM P/D, default
model), with no conversation id:

* the ``openai`` SDK's ``responses.create``, 6 turns, streamed and not, with a function tool
  and its ``function_call`` / ``function_call_output`` round trip (twice): turns 2..6 pull,
  each answer equals a recompute (greedy), P's external-KV counter grows by exactly what the
  router reused, and ``usage.input_tokens_details.cached_tokens`` says so;
* ``previous_response_id`` chains with the router's response store on: they pull too;
* the OpenAI Agents SDK with its default (Responses) model: its follow-ups (the whole input
  re-sent, and its server-managed ``previous_response_id`` option) pull.

The random default model never calls a tool on its own: the tool turns are steered with a
``structured_outputs`` regex (vLLM's guided decoding) to Qwen3's ``<tool_call>`` format,
which vLLM's hermes parser turns into a ``function_call`` output item.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvrelay.cluster.launcher import ServiceProcess
from tests.e2e.conftest import ADMIN_KEY, RealCluster, p_external, start_extra_router, words
from tests.ports import free_port_block

pytestmark = pytest.mark.e2e

CITIES = ("Oslo", "Rome")
TOOLS: list[Any] = [{
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False},
}]
STEER_TO_TOOL_CALL = {"structured_outputs": {"regex": (
    '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)"\\}\\}'
    "\\n</tool_call>")}}
MAX_OUTPUT_TOKENS = 12
STEER_TO_AN_END = {"structured_outputs": {"regex": "(Pack|Bring) (a coat|boots)\\."}}
"""The Agents SDK raises on an ``incomplete`` response, and the random model never stops on
its own: its answers are steered to a short sentence, after which vLLM's grammar ends it."""
TOOL_CALL_TOKENS = 200


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def instructions(seed: int) -> str:
    return "You are a travel agent. Use tools when useful. " + words(120, random.Random(seed))


class Answer:
    """One turn as the client saw it: the router's decision, the response, its output as the
    next turn's input items, and what a recompute must match (text and function calls)."""

    def __init__(self, headers: httpx.Headers, response: Any) -> None:
        self.reason = headers["x-kvrelay-reason"]
        self.reused = int(headers["x-kvrelay-reused-tokens"])
        self.response = response
        self.items = [o.model_dump(exclude_none=True) for o in response.output]
        self.calls = [(o.name, o.arguments) for o in response.output
                      if o.type == "function_call"]
        self.outcome = (response.output_text, self.calls)


def create(client: openai.OpenAI, body: dict[str, Any], stream: bool) -> Answer:
    if not stream:
        raw = client.responses.with_raw_response.create(**body)
        return Answer(raw.headers, raw.parse())
    with client.responses.with_streaming_response.create(**body, stream=True) as raw:
        headers = raw.headers
        done = [e for e in raw.parse() if e.type == "response.completed"]
    assert len(done) == 1
    return Answer(headers, done[0].response)


def recompute(client: openai.OpenAI, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """The same request in a fresh scope (its own ``user``): nothing to continue, so P
    computes the whole prompt."""
    answer = create(client, {**body, "user": f"baseline-{secrets.token_hex(8)}"}, False)
    assert (answer.reason, answer.reused) == ("no_entry", 0)
    return answer.outcome


def checked_turn(cluster: RealCluster, client: openai.OpenAI, body: dict[str, Any],
                 stream: bool, turn: int) -> Answer:
    before = p_external(cluster)
    answer = create(client, body, stream)
    assert answer.reason == ("no_entry" if turn == 0 else "pull"), (turn, answer.reason)
    assert p_external(cluster) - before == answer.reused, "P's vLLM metrics must agree"
    assert answer.response.usage is not None
    assert answer.response.usage.input_tokens_details.cached_tokens == answer.reused
    if turn:
        assert answer.reused > 0
    return answer


def tool_result(answer: Answer) -> dict[str, Any]:
    assert [name for name, _ in answer.calls] == ["get_weather"], answer.items
    city = json.loads(answer.calls[0][1])["city"]
    assert city in CITIES
    call = next(o for o in answer.response.output if o.type == "function_call")
    return {"type": "function_call_output", "call_id": call.call_id,
            "output": f"{city}: 3 C, rain"}


def test_openai_responses_with_a_function_tool_six_turns_pull(real_cluster: RealCluster
                                                               ) -> None:
    """Turns: a steered tool call; its result; a user message; a steered (streamed) tool call;
    its result; a user message. Streamed and not alternate."""
    client = client_for(real_cluster.router_url)
    rng = random.Random(31)
    items: list[Any] = [{"role": "user", "content": "What should I pack for Oslo? "
                         + words(30, rng)}]
    plan = [(True, False), (False, True), (False, False), (True, True), (False, False),
            (False, True)]  # (steered to a tool call, streamed)
    answers: list[Answer] = []
    for turn, (steered, stream) in enumerate(plan):
        body: dict[str, Any] = {
            "model": real_cluster.model, "instructions": instructions(31), "input": items,
            "tools": TOOLS, "store": False, "temperature": 0.0,
            "max_output_tokens": TOOL_CALL_TOKENS if steered else MAX_OUTPUT_TOKENS}
        if steered:
            body["extra_body"] = STEER_TO_TOOL_CALL
        answer = checked_turn(real_cluster, client, body, stream, turn)
        assert recompute(client, body) == answer.outcome, turn
        answers.append(answer)
        items = [*items, *answer.items]
        if steered:
            items.append(tool_result(answer))
        else:
            assert answer.response.output_text
            items.append({"role": "user", "content": words(12, rng)})
    client.close()


@pytest.fixture(scope="module")
def store_router(real_cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[str]:
    """A router with the response store on, in front of the session cluster."""
    port = free_port_block(2, start=18500)
    log = tmp_path_factory.mktemp("store-router") / "router.log"
    router: ServiceProcess = start_extra_router(
        real_cluster, port, log, ["--response-store", "memory", "--admin-key", ADMIN_KEY])
    try:
        yield router.url or ""
    finally:
        router.stop()


def test_previous_response_id_chain_pulls_with_the_store_on(real_cluster: RealCluster,
                                                            store_router: str) -> None:
    client = client_for(store_router)
    rng = random.Random(32)
    previous: str | None = None
    history: list[Any] = []
    for turn in range(4):
        user = words(40 if turn == 0 else 12, rng)
        body: dict[str, Any] = {"model": real_cluster.model, "instructions": instructions(32),
                                "input": user, "temperature": 0.0,
                                "max_output_tokens": MAX_OUTPUT_TOKENS}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = checked_turn(real_cluster, client, body, stream=turn % 2 == 1, turn=turn)
        assert answer.response.previous_response_id == previous
        history.append({"role": "user", "content": user})
        whole = {**{k: v for k, v in body.items() if k != "previous_response_id"},
                 "input": list(history), "store": False}
        assert recompute(client, whole) == answer.outcome, turn
        assert client.responses.retrieve(answer.response.id).output_text == \
            answer.response.output_text
        history += answer.items
        previous = answer.response.id
    client.close()


def last_decision(url: str) -> dict[str, Any]:
    stats = httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=30).json()
    recent: list[dict[str, Any]] = stats["decisions"]["recent"]
    return recent[-1]


def agents_run(cluster: RealCluster, url: str, turns: list[str], server_managed: bool
               ) -> list[tuple[str, int, float]]:
    """``turns`` through an Agents SDK agent on its default (Responses) model, each follow-up
    the whole input re-sent (``to_input_list``) or, ``server_managed``, only the new message
    with ``previous_response_id``: per turn the router's reason, its reused tokens and P's
    external-KV delta."""
    from agents import Agent, ModelSettings, RunConfig, Runner, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
    agent: Agent[None] = Agent(
        name="travel", instructions=instructions(33), model=cluster.model,
        model_settings=ModelSettings(temperature=0.0, max_tokens=24,
                                     extra_body=STEER_TO_AN_END))
    seen: list[tuple[str, int, float]] = []

    async def run() -> None:
        history: list[Any] = []
        previous: str | None = None
        for text in turns:
            before = p_external(cluster)
            if server_managed:
                result = await Runner.run(agent, text, previous_response_id=previous,
                                          run_config=config)
                previous = result.last_response_id
            else:
                result = await Runner.run(agent, [*history, {"role": "user", "content": text}],
                                          run_config=config)
                history = result.to_input_list()
            assert result.final_output
            decision = last_decision(url)
            seen.append((decision["reason"], int(decision["reused_tokens"]),
                         p_external(cluster) - before))
        await client.close()

    asyncio.run(run())
    return seen


def test_agents_sdk_default_model_follow_ups_pull(real_cluster: RealCluster) -> None:
    rng = random.Random(34)
    turns = [words(40, rng), words(12, rng), words(12, rng)]
    seen = agents_run(real_cluster, real_cluster.router_url, turns, server_managed=False)
    assert [s[0] for s in seen] == ["no_entry", "pull", "pull"], seen
    for _, reused, delta in seen[1:]:
        assert reused > 0 and delta == reused


def test_agents_sdk_previous_response_id_pulls_with_the_store_on(real_cluster: RealCluster,
                                                                 store_router: str) -> None:
    rng = random.Random(35)
    turns = [words(40, rng), words(12, rng), words(12, rng)]
    seen = agents_run(real_cluster, store_router, turns, server_managed=True)
    assert [s[0] for s in seen] == ["no_entry", "pull", "pull"], seen
    for _, reused, delta in seen[1:]:
        assert reused > 0 and delta == reused
