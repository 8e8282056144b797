"""The router end to end over HTTP in front of fake vLLM P/D engines: multi-turn pulls give
exactly the output of a recompute (with or without a conversation id, chat and completions,
in both guard modes), the fake's records prove what was reused, ``cached_tokens`` tells the
client, a wrong or stale fingerprint costs reuse but never correctness, the openai SDK works
unmodified, and internal fields never reach the client."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from msgspec.structs import replace

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.client.sse import line_chunks, sse_events
from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.params import parse_remote_blocks
from kvrelay.fakevllm import FakeEngine
from kvrelay.fakevllm.config import RequestRecord
from kvrelay.tune.trace import read_turns
from tests.component.fake_engine_helpers import BLOCK, cdiv
from tests.component.router_fake import (
    GUARD_CONFIGS,
    PermitSleep,
    Routed,
    last_prefill_record,
    routed,
    until,
)
from tests.component.router_rig import assert_no_internal_fields, stream_text

FIRST = "Tell me everything about the rivers of Europe, in order of length. " * 6
FOLLOW_UPS = ["And Asia?", "Which one is the longest overall?", "Summarize in one line."]
GUARDS = list(GUARD_CONFIGS)


@dataclass
class Sent:
    """One turn as the client saw it: the body sent, the reply text, and
    ``usage.prompt_tokens_details.cached_tokens`` (``None`` if absent)."""

    body: dict[str, Any]
    text: str
    cached_tokens: int | None


def usage_cached_tokens(payloads: list[Any]) -> int | None:
    for payload in payloads:
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            return details.get("cached_tokens")  # type: ignore[no-any-return]
    return None


async def run_conversation(
    r: Routed, conversation_id: str | None, *, stream: bool, endpoint: str = "chat"
) -> list[Sent]:
    """Four turns (streams ask for ``include_usage``), each settled before the next; asserts
    the client saw nothing internal."""
    sent: list[Sent] = []
    messages: list[dict[str, Any]] = []
    prompt = ""
    async with r.client() as c:
        for user in [FIRST, *FOLLOW_UPS]:
            if endpoint == "chat":
                messages.append({"role": "user", "content": user})
                body: dict[str, Any] = {"model": "tiny", "messages": list(messages),
                                        "max_tokens": 24, "stream": stream}
                path = "/v1/chat/completions"
            else:
                prompt += user
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "stream": stream}
                path = "/v1/completions"
            if stream:
                body["stream_options"] = {"include_usage": True}
            if conversation_id is not None:
                body["conversation_id"] = conversation_id
            resp = await c.post(path, json=body)
            assert resp.status_code == 200, resp.text
            payloads = sse_events(resp.text) if stream else [resp.json()]
            assert_no_internal_fields(payloads)
            assert "kvrelay_" not in resp.text
            if stream:
                assert payloads[-1] == "[DONE]"
                text = stream_text(payloads)
            else:
                choice = payloads[0]["choices"][0]
                text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
            sent.append(Sent(body, text, usage_cached_tokens(payloads)))
            if endpoint == "chat":
                messages.append({"role": "assistant", "content": text})
            else:
                prompt += text
            await r.settle()
    return sent


def check_pulls(
    p: FakeEngine, d: FakeEngine, records: list[RequestRecord], decisions: list[dict[str, Any]],
    sent: list[Sent], guard: str,
) -> None:
    """Turn 1 computes; turns 2..N pull from D exactly what P proved, the client is told."""
    assert [x["reason"] for x in decisions] == ["no_entry", "pull", "pull", "pull"]
    assert [x["turn"] for x in decisions] == [1, 2, 3, 4]
    assert len({x["key"] for x in decisions}) == 1  # one conversation, one tag
    assert records[0].plan == "none" and sent[0].cached_tokens == 0
    for rec, decision, turn in zip(records[1:], decisions[1:], sent[1:], strict=True):
        assert rec.plan == "pull" and rec.pulled_from_engine == d.engine_id
        assert rec.pulled_tokens == decision["reused_tokens"] > 0
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert not rec.read_freed_blocks
        # OpenAI's convention: prompt tokens P did not compute (no prefix cache on P)
        assert turn.cached_tokens == rec.pulled_tokens + rec.local_cache_hit_tokens
        if guard == "connector":  # P's connector proved the prefix; the router did not
            assert rec.guard == "pull" and decision["exact"] is False
            assert decision["verified_tokens"] == rec.verified_tokens == rec.pulled_tokens
        else:  # stock P: the router proved it from P's /tokenize
            assert rec.guard is None and decision["exact"] is True
            assert decision["verified_tokens"] == rec.pulled_tokens
    assert not d.freed_reads


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_turns_two_to_n_pull_and_match_a_recompute(
    stream: bool, endpoint: str, guard: str
) -> None:
    """With a conversation id, and then the same conversation without any id (found by its
    history alone): turns 2..4 pull, and every reply equals a plain recompute."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        with_id = await run_conversation(r, "conv-1", stream=stream, endpoint=endpoint)
        decisions = (await r.stats())["decisions"]["recent"]
        check_pulls(p, d, p.records[:4], decisions, with_id, guard)
        metrics = parse_prometheus(p.metrics_text())
        pulled_with_id = sum(x["reused_tokens"] for x in decisions)
        assert external_kv_tokens(metrics) == pulled_with_id

        id_free = await run_conversation(r, None, stream=stream, endpoint=endpoint)
        decisions = (await r.stats())["decisions"]["recent"][4:]
        check_pulls(p, d, p.records[4:8], decisions, id_free, guard)
        metrics = parse_prometheus(p.metrics_text())
        assert external_kv_tokens(metrics) == pulled_with_id + sum(
            x["reused_tokens"] for x in decisions)

        replies = [turn.text for turn in with_id]
        assert [turn.text for turn in id_free] == replies
        assert [await r.recompute(turn.body, endpoint) for turn in id_free] == replies  # type: ignore[arg-type]


async def test_streamed_tokens_are_relayed_as_they_are_generated() -> None:
    gate = PermitSleep()
    config_slow = {"slow_stream_s": 0.001}
    async with routed(sleep=gate) as r:
        d = r.cluster.decode[0]
        d.faults.update(config_slow)
        body = {"model": "tiny", "messages": [{"role": "user", "content": FIRST}],
                "max_tokens": 6, "stream": True, "conversation_id": "live"}
        async with r.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            seen: list[Any] = []
            gate.grant(2)  # D may emit two tokens, then waits
            while sum(1 for e in seen if isinstance(e, dict) and stream_text([e])) < 2:
                seen.extend(line_chunks([await anext(lines)]))
            await until(lambda: gate.waiting == 1, "D waiting for its third token")
            assert len(d.records[-1].output_token_ids) == 2  # the client has them already
            gate.grant(10)
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert len([x for x in rest if x != "data: [DONE]"]) == 4  # the other 4 tokens


async def test_openai_sdk_streaming_and_not() -> None:
    async with routed() as r:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
        try:
            messages: list[Any] = [{"role": "user", "content": FIRST}]
            first = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=16,
                extra_body={"conversation_id": "sdk"},
            )
            text = first.choices[0].message.content or ""
            # 16 answer tokens, each a space and a word
            assert first.usage is not None and first.usage.completion_tokens == 16
            assert len(text.split()) == 16 and text.startswith(" ")
            assert getattr(first, "kv_transfer_params", None) is None
            assert first.usage is not None and first.usage.prompt_tokens_details is not None
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            await r.settle()
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "More please."}]
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=16, stream=True,
                stream_options={"include_usage": True}, extra_body={"conversation_id": "sdk"},
            )
            parts: list[str] = []
            usage = None
            async for chunk in stream:
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                usage = chunk.usage or usage
            assert usage is not None and usage.completion_tokens == 16
            assert len([p for p in parts if p]) == 16 == len("".join(parts).split())
            decision = await r.last_decision()
            assert decision["reason"] == "pull" and decision["reused_tokens"] > 0
            assert usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == decision["reused_tokens"]
            await r.settle()
            comp = await client.completions.create(
                model="tiny", prompt=FIRST, max_tokens=8, extra_body={"conversation_id": "c2"})
            assert comp.usage is not None and comp.usage.completion_tokens == 8
            assert len(comp.choices[0].text.split()) == 8
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model="tiny", messages=[], extra_body={"conversation_id": "x"})
            assert bad.value.status_code == 400
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=messages)
        finally:
            await client.close()


async def test_a_stream_without_include_usage_gets_no_usage_event() -> None:
    async with routed() as r:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "stream": True,
                                "messages": [{"role": "user", "content": FIRST}]}
        async with r.client() as c:
            first = await c.post("/v1/chat/completions", json=body)
            await r.settle()
            body["messages"] = [*body["messages"], {
                "role": "assistant", "content": stream_text(sse_events(first.text))},
                {"role": "user", "content": "More."}]
            second = await c.post("/v1/chat/completions", json=body)
        assert second.headers["x-kvrelay-action"] == "pull"
        assert int(second.headers["x-kvrelay-reused-tokens"]) > 0
        events = sse_events(second.text)
        assert events[-1] == "[DONE]" and len(events) > 2
        assert all(not e.get("usage") for e in events[:-1])


@pytest.mark.parametrize("conversation_id", ["race", None])
async def test_concurrent_turns_pull_d_blocks_at_most_once(conversation_id: str | None) -> None:
    """Four identical follow-ups at once (forks of one entry): exactly one claims and pulls,
    the others recompute; all answers are the same."""
    async with routed(num_prefill=2, num_decode=2) as r:
        messages = [{"role": "user", "content": FIRST}]
        extra = {"conversation_id": conversation_id} if conversation_id else {}
        async with r.client() as c:
            first = (await c.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 16, **extra})).json()
            await r.settle()
            messages += [{"role": "assistant", "content": first["choices"][0]["message"][
                "content"]}, {"role": "user", "content": "next"}]
            body = {"messages": messages, "max_tokens": 16, **extra}
            results = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body) for _ in range(4)))
        assert all(x.status_code == 200 for x in results)
        texts = {x.json()["choices"][0]["message"]["content"] for x in results}
        assert texts == {await r.recompute(body)}  # every turn, pulled or not, is right
        assert sorted(x.headers["x-kvrelay-reason"] for x in results) == [
            "no_entry", "no_entry", "no_entry", "pull"]
        records = [rec for p in r.cluster.prefill for rec in p.records if rec.plan == "pull"]
        assert len(records) == 1
        assert all(not rec.wrong_reuse and not rec.read_freed_blocks for rec in records)
        assert not any(d.freed_reads for d in r.cluster.decode)


async def long_first_turn(
    r: Routed, headers: dict[str, str] | None = None,
) -> tuple[list[Any], RequestRecord]:
    """A 1,200-token question and a 200-token answer (conversation ``edit``, or the id in
    ``headers``); returns the history after it and D's record of the turn."""
    messages: list[Any] = [{"role": "user", "content": FIRST * 3}]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 200, "conversation_id": "edit"}
    async with r.client() as c:
        reply = (await c.post("/v1/chat/completions", json=body, headers=headers)).json()
    await r.settle()
    answer = reply["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}], r.cluster.decode[0].records[-1]


def held_tokens(d_record: RequestRecord) -> int:
    """Tokens whose KV D holds after a request: prompt + output - 1."""
    return len(d_record.prompt_token_ids) + len(d_record.output_token_ids) - 1


@pytest.mark.parametrize("guard", GUARDS)
async def test_reply_resent_with_other_whitespace_pulls_only_the_verified_prefix(
    guard: str,
) -> None:
    """A client re-sends the answer with a leading space: the request still continues the
    entry (answers are compared stripped), but its tokens part from D's at the answer. Only
    the proven prefix is pulled, cut at a block boundary with its block list, and the output
    equals a recompute. With kvrelay's connector, P proves and cuts; on stock P, the router."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p = r.cluster.prefill[0]
        history, held = await long_first_turn(r)
        d_blocks = parse_remote_blocks(held.kv_transfer_params).block_ids[0]
        history[-1] = {"role": "assistant", "content": " " + history[-1]["content"]}
        messages = [*history, {"role": "user", "content": "go on"}]
        body = {"messages": messages, "max_tokens": 200, "conversation_id": "edit"}
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        decision = await r.last_decision()
        assert decision["reason"] == "pull"
        rec = last_prefill_record(p)
        proven = len(held.prompt_token_ids) // 16 * 16  # the fingerprint's 16-token chunks
        assert rec.plan == "pull" and rec.pulled_tokens == proven < held_tokens(held)
        assert rec.pulled_block_ids == d_blocks[: cdiv(proven, BLOCK)]
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert decision["reused_tokens"] == proven == decision["verified_tokens"]
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == proven
        if guard == "connector":
            assert rec.guard == "pull" and rec.verified_tokens == proven
            assert decision["exact"] is False
        else:
            assert rec.guard is None and decision["exact"] is True
        assert resp.json()["choices"][0]["message"]["content"] == await r.recompute(body)


async def test_edited_reply_without_an_id_is_no_entry_and_takes_nothing() -> None:
    """An edited answer means the request does not contain the entry's turn: without an id it
    is not a continuation (``no_entry``), the entry stays for the conversation that does
    continue it, and both answers equal a recompute."""
    async with routed() as r:
        p = r.cluster.prefill[0]
        history, held = await long_first_turn(r)
        edited = [*history[:-1], {"role": "assistant",
                                  "content": history[-1]["content"][:150] + "[edited]"}]
        body = {"messages": [*edited, {"role": "user", "content": "go on"}], "max_tokens": 200}
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
            assert resp.headers["x-kvrelay-reason"] == "no_entry"
            assert last_prefill_record(p).plan == "none"
            assert resp.json()["choices"][0]["message"]["content"] == await r.recompute(body)
            await r.settle()
            body = {"messages": [*history, {"role": "user", "content": "go on"}],
                    "max_tokens": 200, "conversation_id": "edit"}
            resp = await c.post("/v1/chat/completions", json=body)
        assert resp.headers["x-kvrelay-reason"] == "pull"
        rec = last_prefill_record(p)
        assert rec.plan == "pull" and rec.pulled_matches_prompt and not rec.wrong_reuse
        assert rec.pulled_tokens == held_tokens(held)
        assert rec.pulled_from_request == held.internal_request_id
        assert resp.json()["choices"][0]["message"]["content"] == await r.recompute(body)


@pytest.mark.parametrize("guard", GUARDS)
async def test_edited_reply_with_its_id_pulls_only_the_unedited_prefix(guard: str) -> None:
    """Under its own bound conversation id (a gateway's header) an edited history continues
    the id's latest entry; the guard proves the prefix before the edit, only that is pulled,
    the answer equals a recompute."""
    bound = {"x-gw-session": "edit"}
    async with routed(engine_config=GUARD_CONFIGS[guard],
                      gateway_id_headers=("x-gw-session",)) as r:
        p = r.cluster.prefill[0]
        history, held = await long_first_turn(r, bound)
        edited = [*history[:-1], {"role": "assistant",
                                  "content": history[-1]["content"][:150] + "[edited]"}]
        body = {"messages": [*edited, {"role": "user", "content": "go on"}], "max_tokens": 200}
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body, headers=bound)
        decision = await r.last_decision()
        rec = last_prefill_record(p)
        assert decision["reason"] == "pull" and rec.plan == "pull"
        assert len(held.prompt_token_ids) < rec.pulled_tokens < held_tokens(held)
        assert rec.pulled_tokens == decision["reused_tokens"]
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert resp.json()["choices"][0]["message"]["content"] == await r.recompute(body)


def image_part(data: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


async def test_a_swapped_image_under_a_bound_id_never_pulls_the_old_images_kv() -> None:
    """Under a bound id, a history whose image was swapped (same size: the engine's
    placeholder tokens are equal, so the guard's token proof passes) must not continue the
    id's latest entry: it recomputes. The history as sent, image unchanged, still pulls
    (probe 5, finding 1: the swap pulled image A's KV for image B)."""
    bound = {"x-gw-session": "img"}
    async with routed(gateway_id_headers=("x-gw-session",)) as r:
        first: list[Any] = [{"role": "user", "content": [
            {"type": "text", "text": FIRST * 3}, image_part("QUFBQQ==")]}]
        async with r.client() as c:
            reply = (await c.post("/v1/chat/completions", headers=bound, json={
                "messages": first, "max_tokens": 64})).json()
            await r.settle()
            answer = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            swapped = [{"role": "user", "content": [first[0]["content"][0],
                                                    image_part("QkJCQg==")]}]
            resp = await c.post("/v1/chat/completions", headers=bound, json={
                "messages": [*swapped, answer, {"role": "user", "content": "and now?"}],
                "max_tokens": 8})
            assert resp.headers["x-kvrelay-action"] == "recompute"
            assert resp.headers["x-kvrelay-reason"] == "no_entry"
            resp = await c.post("/v1/chat/completions", headers=bound, json={
                "messages": [*first, answer, {"role": "user", "content": "and now?"}],
                "max_tokens": 8})
            assert resp.headers["x-kvrelay-reason"] == "pull"


@pytest.mark.parametrize("guard", GUARDS)
async def test_under_a_bound_id_another_model_never_pulls_this_models_kv(guard: str) -> None:
    """A LoRA adapter shares its base model's tokenizer, so the guard's token proof passes
    the base's KV for the adapter's request. Under a bound id, a turn of another model (the
    history re-sent as it was, or edited) must not continue the id's latest entry: it
    recomputes; the same model still pulls (probe 8b, finding 1: the adapter's turn pulled
    354 tokens of the base model's KV)."""
    config = dataclasses.replace(GUARD_CONFIGS[guard], lora_modules=("tiny-lora",))
    async with routed(engine_config=config, gateway_id_headers=("x-gw-session",)) as r:
        p = r.cluster.prefill[0]
        for edit in (False, True):
            bound = {"x-gw-session": f"lora-{edit}"}
            history, _ = await long_first_turn(r, bound)
            follow = [*history, {"role": "user", "content": "go on"}]
            sent = [*history[:-1], {"role": "assistant",
                                    "content": history[-1]["content"][:150] + "[edited]"},
                    {"role": "user", "content": "go on"}] if edit else follow
            async with r.client() as c:
                resp = await c.post("/v1/chat/completions", headers=bound, json={
                    "model": "tiny-lora", "messages": sent, "max_tokens": 8})
                assert resp.status_code == 200
                assert resp.headers["x-kvrelay-action"] == "recompute"
                assert resp.headers["x-kvrelay-reason"] == "no_entry"
                assert last_prefill_record(p).plan != "pull"
                resp = await c.post("/v1/chat/completions", headers=bound, json={
                    "messages": follow, "max_tokens": 8})
                assert resp.headers["x-kvrelay-reason"] == "pull"


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize(("wrong_at", "proven"), [(5, 0), (2 * BLOCK + 5, 2 * BLOCK)])
async def test_a_wrong_fingerprint_costs_reuse_never_correctness(
    guard: str, wrong_at: int, proven: int
) -> None:
    """The entry's fingerprint is tampered with (one held token differs at ``wrong_at``), as
    if the router had picked a wrong candidate: only the prefix before the difference is
    proven. Too short to pull, nothing is loaded (D is still told, and frees its blocks);
    otherwise exactly the proven blocks. The answer equals a recompute either way."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        history, held = await long_first_turn(r)
        body = {"messages": [*history, {"role": "user", "content": "go on"}],
                "max_tokens": 200, "conversation_id": "edit"}
        found = await r.find(body)
        assert found is not None and found.entry.num_tokens == held_tokens(held)
        tokens = [*held.prompt_token_ids, *held.output_token_ids]
        tokens[wrong_at] += 1
        bad = held_fingerprint(tokens, [], found.entry.num_tokens)
        entry = replace(found.entry, blocks=replace(found.entry.blocks, fingerprint=bad))
        await r.ctx.index.put(found.ref, entry, tenant="default")
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        decision = await r.last_decision()
        rec = last_prefill_record(p)
        assert rec.pulled_tokens == decision["reused_tokens"] == proven
        assert int(resp.headers["x-kvrelay-reused-tokens"]) == proven
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == proven
        assert decision["verified_tokens"] == proven
        if guard == "connector":  # the router pulls; P's connector proves and cuts
            assert decision["decided"] == "pull/pull"
            assert decision["reason"] == ("prefix_mismatch" if proven == 0 else "pull")
            assert rec.guard == ("prefix_mismatch" if proven == 0 else "pull")
            assert rec.verified_tokens == proven
        else:  # the router proves and cuts (or recomputes) itself
            assert decision["reason"] == ("prefix_mismatch" if proven == 0 else "pull")
        if proven:
            assert rec.plan == "pull"
            assert rec.pulled_block_ids == entry.blocks.block_ids[0][: cdiv(proven, BLOCK)]
            assert rec.pulled_matches_prompt and not rec.wrong_reuse
        elif guard == "connector":  # nothing loaded, D notified
            assert rec.plan == "local_hit" and rec.notified_engine == d.engine_id
        else:  # the router never sent the pull: D keeps its blocks until its TTL
            assert rec.plan == "none" and rec.request_kv_transfer_params == {
                "do_remote_decode": True}
        assert rec.computed_tokens == len(rec.prompt_token_ids) - proven
        still_held = held.internal_request_id in [h.request_id for h in d.held()]
        assert still_held == (guard == "tokenize" and proven == 0)
        assert resp.json()["choices"][0]["message"]["content"] == await r.recompute(body)


@pytest.mark.parametrize("guard", GUARDS)
async def test_a_stale_fingerprint_proves_only_what_it_covers(guard: str) -> None:
    """The turn-2 entry carries turn 1's fingerprint (stale: it covers fewer tokens than D
    now holds, all of them a prefix of the prompt). P pulls exactly the tokens it proves,
    from D's first blocks, and the answer equals a recompute."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p = r.cluster.prefill[0]
        history, _ = await long_first_turn(r)
        body: dict[str, Any] = {"messages": [*history, {"role": "user", "content": "go on"}],
                                "max_tokens": 16, "conversation_id": "edit"}
        found = await r.find(body)
        assert found is not None
        stale = found.entry.fingerprint
        async with r.client() as c:
            second = (await c.post("/v1/chat/completions", json=body)).json()
            await r.settle()
            body["messages"] = [*body["messages"], {
                "role": "assistant", "content": second["choices"][0]["message"]["content"]},
                {"role": "user", "content": "and then?"}]
            found = await r.find(body)
            assert found is not None and found.entry.num_tokens > stale.num_tokens
            entry = replace(found.entry, blocks=replace(found.entry.blocks, fingerprint=stale))
            await r.ctx.index.put(found.ref, entry, tenant="default")
            resp = await c.post("/v1/chat/completions", json=body)
        decision = await r.last_decision()
        assert decision["reason"] == "pull"
        rec = last_prefill_record(p)
        assert rec.plan == "pull" and rec.pulled_tokens == stale.num_tokens
        assert rec.pulled_block_ids == entry.blocks.block_ids[0][
            : cdiv(stale.num_tokens, BLOCK)]
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert decision["reused_tokens"] == stale.num_tokens
        assert resp.json()["choices"][0]["message"]["content"] == await r.recompute(body)


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("client_asks_ids", [False, True])
async def test_token_id_prompts_without_an_id_pull(
    guard: str, stream: bool, client_asks_ids: bool
) -> None:
    """A completions prompt of token ids, continued with the answer's ids (asked from D with
    ``return_token_ids``, or tokenized by the client itself): the router finds the entry
    from the ids alone. It asks D for the output ids itself, and the client gets none it did
    not ask for."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        prompt = list(d.model.encode_prompt(FIRST))
        async with r.client() as c:
            for turn in range(3):
                body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                        "stream": stream}
                if client_asks_ids:
                    body["return_token_ids"] = True
                resp = await c.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                payloads = sse_events(resp.text) if stream else [resp.json()]
                choices = [x["choices"][0] for x in payloads
                           if isinstance(x, dict) and x.get("choices")]
                shown = [t for ch in choices for t in ch.get("token_ids") or []]
                output = list(d.records[-1].output_token_ids)
                assert shown == (output if client_asks_ids else [])
                await r.settle()
                decision = await r.last_decision()
                assert decision["reason"] == ("no_entry" if turn == 0 else "pull")
                if turn:
                    rec = last_prefill_record(p)
                    assert rec.pulled_tokens == decision["reused_tokens"] > 0
                    assert rec.pulled_matches_prompt and not rec.wrong_reuse
                more = d.model.encode_prompt(" and then?", add_special_tokens=False)
                prompt = [*prompt, *output, *more]
        assert not d.freed_reads


@pytest.mark.parametrize("stream", [False, True])
async def test_turn_log_records_each_turn_as_it_happened(tmp_path: Any, stream: bool) -> None:
    """``--turn-log``: one line per turn once its entry settled, one key per conversation
    (id-less too), the decision as it happened, the reused tokens P reported, what D retains;
    no content; ``kvrelay tune`` reads it back."""
    path = tmp_path / "turns.jsonl"
    async with routed(turn_log=str(path)) as r:
        d = r.cluster.decode[0]
        sent = await run_conversation(r, None, stream=stream)
        decisions = (await r.stats())["decisions"]["recent"]
        assert r.ctx.turn_log is not None
        r.ctx.turn_log.flush()
        held = [len(rec.prompt_token_ids) + len(rec.output_token_ids) - 1 for rec in d.records]
    text = path.read_text()
    assert FIRST.split()[0] not in text and sent[0].text[:8] not in text
    records = [json.loads(line) for line in text.splitlines()]
    assert [x["action"] for x in records] == ["recompute", "pull", "pull", "pull"]
    assert [x["reason"] for x in records] == ["no_entry", "pull", "pull", "pull"]
    assert len({x["key"] for x in records}) == 1 and records[0]["key"] == decisions[0]["key"]
    assert [x["reused_tokens"] for x in records] == [x["reused_tokens"] for x in decisions]
    assert [x["prompt_tokens"] for x in records] == [x["prompt_tokens"] for x in decisions]
    assert [x["retained_tokens"] for x in records] == held
    assert records[0]["gap_s"] is None and all(x["gap_s"] == 0.0 for x in records[1:])
    assert all(x["decode_node"] == "decode-0" for x in records)
    assert all((x["ttft_s"] is not None) == stream for x in records)
    turns = list(read_turns(path))
    assert [t.reused_tokens for t in turns] == [x["reused_tokens"] for x in records]
    assert [t.retained_tokens for t in turns] == held
