"""The router on the real local cluster (1 P + 1 D, default model): multi-turn pulls, the
prefix guard, and the unmodified OpenAI SDK."""

from __future__ import annotations

import random
import secrets
from collections.abc import Sequence

import httpx
import openai
import pytest

from kvrelay.client.prometheus import parse_prometheus
from tests.e2e.conftest import RealCluster, chat, p_external, words

pytestmark = pytest.mark.e2e

Message = dict[str, object]


class Turn:
    def __init__(self, text: str, action: str, reason: str, reused: int, pulled: float,
                 usage: dict[str, int]):
        self.text, self.action, self.reason = text, action, reason
        self.reused, self.pulled = reused, pulled
        self.held_by_d = usage["prompt_tokens"] + usage["completion_tokens"] - 1


def send(cluster: RealCluster, messages: Sequence[Message], conversation_id: str | None,
         stream: bool, max_tokens: int = 16) -> Turn:
    body: dict[str, object] = {"model": cluster.model, "messages": list(messages),
                               "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                               **({"stream_options": {"include_usage": True}} if stream else {})}
    if conversation_id:
        body["conversation_id"] = conversation_id
    before = p_external(cluster)
    text, headers, usage = chat(cluster.router_url, body)
    return Turn(text, headers["x-kvrelay-action"], headers["x-kvrelay-reason"],
                int(headers["x-kvrelay-reused-tokens"]), p_external(cluster) - before, usage)


def router_reused_tokens(cluster: RealCluster) -> float:
    """``prompt_tokens_total{source="reused"}``: a request-size series, which the router
    serves on its internal listener (``kvrelay up``: port + 1), not to an open scrape."""
    base, _, port = cluster.router_url.rpartition(":")
    internal = f"{base}:{int(port) + 1}"
    metrics = parse_prometheus(httpx.get(f"{internal}/metrics", timeout=30).text)
    return sum(v for k, v in metrics.items()
               if k.startswith("kvrelay_router_prompt_tokens_total") and 'source="reused"' in k)


def agent_conversation(turns: int, seed: int) -> tuple[list[Message], list[Message]]:
    rng = random.Random(seed)
    opening: list[Message] = [
        {"role": "system", "content": "You are a coding agent. " + words(120, rng)},
        {"role": "user", "content": "Task: " + words(40, rng)},
    ]
    later: list[Message] = [{"role": "user", "content": f"Tool result {i}: " + words(60, rng)}
                            for i in range(turns)]
    return opening, later


def run(cluster: RealCluster, opening: list[Message], later: list[Message], turns: int,
        conversation_id: str | None, stream: bool, answers: list[str] | None = None,
        fresh_ids: bool = False) -> tuple[list[Turn], list[Message]]:
    """Run ``turns`` turns; with ``answers`` the previous answers are replayed, and with
    ``fresh_ids`` every turn goes in a new conversation-id scope, so nothing is continued
    (the recompute baseline)."""
    messages = list(opening)
    out: list[Turn] = []
    for i in range(turns):
        if i:
            previous = answers[i - 1] if answers is not None else out[-1].text
            messages += [{"role": "assistant", "content": previous}, later[i - 1]]
        cid = f"baseline-{secrets.token_hex(8)}" if fresh_ids else conversation_id
        out.append(send(cluster, messages, cid, stream))
    return out, messages


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_eight_turns_pull_from_turn_two_and_match_recompute(real_cluster: RealCluster,
                                                           stream: bool):
    opening, later = agent_conversation(8, seed=10 + stream)
    router_before = router_reused_tokens(real_cluster)
    reuse, _ = run(real_cluster, opening, later, 8, f"e2e-{secrets.token_hex(4)}", stream)
    router_reused = router_reused_tokens(real_cluster) - router_before
    baseline = run(real_cluster, opening, later, 8, None, stream,
                   answers=[t.text for t in reuse], fresh_ids=True)[0]

    assert (reuse[0].action, reuse[0].reason) == ("recompute", "no_entry")
    for turn in reuse[1:]:
        assert (turn.action, turn.reason) == ("pull", "pull")
        assert turn.reused > 0
        assert turn.pulled == turn.reused, "P's vLLM metrics must agree with the router"
    assert router_reused == sum(t.pulled for t in reuse) > 0, "router /metrics vs P's metrics"
    assert all(t.action == "recompute" and t.pulled == 0 for t in baseline)
    assert [t.text for t in reuse] == [t.text for t in baseline]
    assert all(t.text for t in reuse)


def test_openai_sdk_through_the_router(real_cluster: RealCluster):
    client = openai.OpenAI(base_url=f"{real_cluster.router_url}/v1", api_key="unused")
    conversation_id = f"sdk-{secrets.token_hex(4)}"
    messages: list[dict[str, str]] = [{"role": "user", "content": "Say something " * 150}]
    first = client.chat.completions.create(model=real_cluster.model, messages=messages,
                                           max_tokens=12, temperature=0,
                                           extra_body={"conversation_id": conversation_id})
    answer = first.choices[0].message.content or ""
    assert answer
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    before = p_external(real_cluster)
    stream = client.chat.completions.create(model=real_cluster.model, messages=messages,
                                            max_tokens=12, temperature=0, stream=True,
                                            extra_body={"conversation_id": conversation_id})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed
    assert p_external(real_cluster) > before
    assert [m.id for m in client.models.list().data] == [real_cluster.model]
