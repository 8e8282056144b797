"""Turn path v2 on the real cluster (issue #11): reuse without any conversation id, many
conversations sharing a prefix, no stealing, the prefix guard in both modes (kvrelay's
connector on P; the router with P's /tokenize), and P's connector proving a wrong
fingerprint down to the prefix that really matches."""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from msgspec.structs import replace

from kvrelay.client.pd import PDClient
from kvrelay.client.prometheus import external_kv_tokens
from kvrelay.cluster.launcher import ServiceProcess, free_port_block
from kvrelay.core.fingerprint import held_fingerprint
from tests.e2e.conftest import (
    GATEWAY_HEADER,
    RealCluster,
    chat,
    p_external,
    start_extra_router,
    words,
)

pytestmark = pytest.mark.e2e

Message = dict[str, object]


class Answer:
    def __init__(self, text: str, headers: httpx.Headers, usage: dict[str, int]) -> None:
        self.text = text
        self.action = headers["x-kvrelay-action"]
        self.reason = headers["x-kvrelay-reason"]
        self.reused = int(headers["x-kvrelay-reused-tokens"])
        self.prompt_tokens = usage["prompt_tokens"]
        self.held_by_d = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        details = usage.get("prompt_tokens_details") or {}
        self.cached = details.get("cached_tokens") if isinstance(details, dict) else None


def answer_ids(model: str) -> list[int]:
    """The ids of ``model``'s answer tokens (``kvrelay.models.answer_token_ids``)."""
    from transformers import AutoTokenizer

    from kvrelay.cluster.launcher import resolve_model
    from kvrelay.models import answer_token_ids

    return answer_token_ids(AutoTokenizer.from_pretrained(str(resolve_model(model))))


def send(url: str, model: str, messages: Sequence[Message], *, stream: bool = False,
         conversation_id: str | None = None, gateway_id: str | None = None,
         temperature: float = 0.0, max_tokens: int = 16,
         extra: dict[str, object] | None = None) -> Answer:
    """One chat turn; ``conversation_id`` goes in the body (it narrows the lookup),
    ``gateway_id`` in the gateway's header (bound: an edited history continues its entry)."""
    body: dict[str, object] = {"model": model, "messages": list(messages),
                               "max_tokens": max_tokens, "temperature": temperature,
                               "stream": stream, **(extra or {})}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    headers = {GATEWAY_HEADER: gateway_id} if gateway_id is not None else None
    return Answer(*chat(url, body, headers))


def recompute(cluster: RealCluster, messages: Sequence[Message], stream: bool = False) -> Answer:
    """The same request through the router in a fresh conversation-id scope: nothing to
    continue, so P computes it all (the baseline)."""
    answer = send(cluster.router_url, cluster.model, messages, stream=stream,
                  conversation_id=f"baseline-{secrets.token_hex(8)}")
    assert (answer.action, answer.reason) == ("recompute", "no_entry")
    return answer


def opening(seed: int, system: str | None = None, task: str | None = None) -> list[Message]:
    rng = random.Random(seed)
    return [{"role": "system", "content": system or "You are a coding agent. " + words(150, rng)},
            {"role": "user", "content": task or "Task: " + words(40, rng)}]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_eight_turns_without_any_id_pull_from_turn_two_and_match_recompute(
    real_cluster: RealCluster, stream: bool
) -> None:
    rng = random.Random(30 + stream)
    messages = opening(30 + stream)
    turns: list[Answer] = []
    requests: list[list[Message]] = []
    for i in range(8):
        if i:
            messages += [{"role": "assistant", "content": turns[-1].text},
                         {"role": "user", "content": f"Tool result {i}: " + words(50, rng)}]
        requests.append(list(messages))
        before = p_external(real_cluster)
        turns.append(send(real_cluster.router_url, real_cluster.model, messages, stream=stream))
        pulled = p_external(real_cluster) - before
        if i:
            assert (turns[-1].action, turns[-1].reason) == ("pull", "pull"), i
            assert turns[-1].reused == pulled > 0, "P's vLLM metrics must agree with the router"
            assert turns[-1].reused == turns[-2].held_by_d, "all of the previous turn"
            assert turns[-1].cached == turns[-1].reused, "usage.cached_tokens"
    assert (turns[0].action, turns[0].reason) == ("recompute", "no_entry")
    baseline = [recompute(real_cluster, r, stream) for r in requests]
    assert [t.text for t in turns] == [b.text for b in baseline]
    assert all(t.text for t in turns)


def test_conversations_sharing_a_prefix_each_continue_their_own(
    real_cluster: RealCluster,
) -> None:
    """Eight conversations of one agent: identical long system prompt and first message,
    sampled first answers. Each follow-up pulls its own conversation's whole history, a new
    conversation with only the system prompt in common takes no entry, and every answer
    equals a recompute of the same request."""
    url, model = real_cluster.router_url, real_cluster.model
    shared = opening(40)
    n = 8

    allowed = answer_ids(model)

    def first(i: int) -> Answer:
        # the model's answer tokens only (what it answers in greedily): sampled text that
        # renders back to the same tokens in the next prompt
        return send(url, model, shared, temperature=1.0, max_tokens=24,
                    extra={"allowed_token_ids": allowed})

    with ThreadPoolExecutor(n) as pool:
        firsts = list(pool.map(first, range(n)))
    assert all((a.action, a.reason) == ("recompute", "no_entry") for a in firsts)
    assert len({a.text for a in firsts}) == n, "sampled first answers must differ"

    stranger = opening(40, system=str(shared[0]["content"]), task="A different task entirely.")
    taker = send(url, model, stranger)
    assert (taker.action, taker.reason) == ("recompute", "no_entry")

    conversations = [[*shared, {"role": "assistant", "content": a.text},
                      {"role": "user", "content": f"Continue, step {i}."}]
                     for i, a in enumerate(firsts)]
    before = p_external(real_cluster)
    with ThreadPoolExecutor(n) as pool:
        seconds = list(pool.map(lambda m: send(url, model, m), conversations))
    pulled = p_external(real_cluster) - before
    for answer, previous in zip(seconds, firsts, strict=True):
        assert (answer.action, answer.reason) == ("pull", "pull")
        assert answer.reused == previous.held_by_d, "its own conversation's whole history"
    assert pulled == sum(a.reused for a in seconds)
    for messages, answer in zip(conversations, seconds, strict=True):
        assert recompute(real_cluster, messages).text == answer.text


@pytest.fixture(scope="module")
def tokenize_router(real_cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[str]:
    """A second router in front of the session cluster whose prefix guard runs in the router
    (P's /tokenize), as for a P that runs stock vLLM."""
    log: Path = tmp_path_factory.mktemp("tokenize-router") / "router.log"
    router: ServiceProcess = start_extra_router(
        real_cluster, free_port_block(2, start=18500), log, ["--guard", "tokenize"])
    try:
        assert router.url is not None
        stats = httpx.get(f"{router.url}/stats", timeout=30).json()
        assert stats["guard"]["mode"] == "tokenize"
        yield router.url
    finally:
        router.stop()


def edit_earlier_user_message(messages: list[Message]) -> None:
    messages[1] = {"role": "user", "content": "Task: something else entirely"}


def change_system_prompt(messages: list[Message]) -> None:
    messages[0] = {"role": "system", "content": "You are a different agent."}


def alter_previous_answer(messages: list[Message]) -> None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            messages[i] = {"role": "assistant", "content": f"EDITED {messages[i]['content']}"}
            return


@pytest.mark.parametrize("mode", ["connector", "tokenize"])
@pytest.mark.parametrize("edit", [edit_earlier_user_message, change_system_prompt,
                                  alter_previous_answer])
def test_prefix_guard_cases_equal_recompute_in_both_modes(
    real_cluster: RealCluster, tokenize_router: str, mode: str, edit: object
) -> None:
    """A bound id's (the gateway header's) edited history continues its latest entry; the
    guard (P's connector, or the router with P's /tokenize) lets only the prefix that still
    matches be reused."""
    url = real_cluster.router_url if mode == "connector" else tokenize_router
    conversation_id = f"guard-{mode}-{secrets.token_hex(4)}"
    messages = opening(50)
    turns: list[Answer] = []
    for i in range(3):
        if i:
            messages += [{"role": "assistant", "content": turns[-1].text},
                         {"role": "user", "content": f"Next step {i}."}]
        turns.append(send(url, real_cluster.model, messages, gateway_id=conversation_id))
    assert (turns[-1].action, turns[-1].reason) == ("pull", "pull")
    edited = [*messages, {"role": "assistant", "content": turns[-1].text},
              {"role": "user", "content": "next"}]
    edit(edited)  # type: ignore[operator]
    before = p_external(real_cluster)
    guarded = send(url, real_cluster.model, edited, gateway_id=conversation_id)
    pulled = p_external(real_cluster) - before
    assert guarded.text == recompute(real_cluster, edited).text
    assert guarded.reused == pulled
    if edit is change_system_prompt:
        assert (guarded.action, guarded.reason) == ("recompute", "prefix_mismatch")
        assert pulled == 0
    else:
        # The part before the edit is still D's KV: pulled, capped at the verified prefix.
        assert guarded.action == "pull" and 0 < guarded.reused < turns[-1].held_by_d
    stats = httpx.get(f"{url}/stats", timeout=30).json()
    assert stats["decisions"]["by_reason"][guarded.reason] >= 1


def test_an_answer_resent_with_other_whitespace_pulls_what_still_matches(
    real_cluster: RealCluster,
) -> None:
    """Without any id: the re-sent answer matches D's by content (its digest ignores outer
    whitespace) but renders other tokens; P's connector pulls up to where they differ."""
    url, model = real_cluster.router_url, real_cluster.model
    messages = opening(60)
    first = send(url, model, messages)
    follow = [*messages, {"role": "assistant", "content": "\n\n" + first.text + "  "},
              {"role": "user", "content": "Go on."}]
    before = p_external(real_cluster)
    answer = send(url, model, follow)
    pulled = p_external(real_cluster) - before
    assert (answer.action, answer.reason) == ("pull", "pull")
    assert 0 < answer.reused == pulled < first.held_by_d
    assert answer.text == recompute(real_cluster, follow).text


def test_a_wrong_fingerprint_makes_p_pull_only_the_verified_prefix(
    real_cluster: RealCluster,
) -> None:
    """P's connector proves D's tokens against its own prompt ids: given D's params whose
    fingerprint is wrong from token 700 on (as a stale or forged one would be), P pulls only
    the prefix before it, and the answer equals a recompute."""
    with PDClient(real_cluster.prefill_url, real_cluster.decode_url, real_cluster.model) as c:
        # a long system prompt: the tampered token (700) lies well inside D's held tokens
        messages = opening(70, system="You are a coding agent. " + words(800, random.Random(70)))
        first = c.turn(messages, max_tokens=16)
        held = first.retained
        assert held is not None and held.fingerprint is not None
        assert held.fingerprint.num_tokens == held.num_tokens
        follow = [*messages, {"role": "assistant", "content": first.text},
                  {"role": "user", "content": "And then?"}]
        tokens = httpx.post(f"{real_cluster.prefill_url}/tokenize", timeout=60,
                            json={"model": real_cluster.model, "messages": follow}).json()
        ids = list(tokens["tokens"])
        assert len(ids) > held.num_tokens > 800
        wrong = list(ids[: held.num_tokens])
        wrong[700] = (wrong[700] + 1) % 200
        tampered = replace(held, fingerprint=held_fingerprint(wrong, [], held.num_tokens))
        before = external_kv_tokens(c.metrics(real_cluster.prefill_url))
        pulled_turn = c.turn(follow, max_tokens=16, reuse=tampered)
        pulled = external_kv_tokens(c.metrics(real_cluster.prefill_url)) - before
        recomputed = c.turn(follow, max_tokens=16)
    assert pulled == 700 // 16 * 16, "only the verified prefix (whole fingerprint chunks)"
    assert pulled_turn.prefill.blocks.verified_tokens is not None
    assert pulled_turn.text == recomputed.text
