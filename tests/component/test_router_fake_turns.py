"""The router end to end over HTTP in front of fake vLLM P/D engines: multi-turn pulls give
exactly the output of a recompute, the fake's records prove what was reused, the openai SDK
works unmodified, and internal fields never reach the client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from kvrelay.cluster.pd_client import external_kv_tokens, parse_prometheus
from tests.component.router_fake import PermitSleep, Routed, last_prefill_record, routed, until
from tests.component.router_rig import assert_no_internal_fields, sse_events, stream_text

FIRST = "Tell me everything about the rivers of Europe, in order of length. " * 6
FOLLOW_UPS = ["And Asia?", "Which one is the longest overall?", "Summarize in one line."]


async def run_conversation(
    r: Routed, conversation_id: str | None, *, stream: bool, endpoint: str = "chat"
) -> list[str]:
    """Four turns; returns each reply's text (asserting the client saw nothing internal)."""
    replies: list[str] = []
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
            replies.append(text)
            if endpoint == "chat":
                messages.append({"role": "assistant", "content": text})
            else:
                prompt += text
            await r.settle()
    return replies


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_turns_two_to_n_pull_and_match_a_recompute(stream: bool, endpoint: str) -> None:
    async with routed() as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        reused = await run_conversation(r, "conv-1", stream=stream, endpoint=endpoint)
        stats = await r.stats()
        decisions = stats["decisions"]["recent"]
        assert [x["reason"] for x in decisions] == ["no_entry", "pull", "pull", "pull"]
        pulls = [rec for rec in p.records if rec.plan == "pull"]
        assert len(pulls) == 3
        for rec, decision in zip(pulls, decisions[1:], strict=True):
            assert rec.pulled_from_engine == d.engine_id
            assert rec.pulled_tokens == decision["reused_tokens"] > 0
            assert rec.pulled_matches_prompt and not rec.wrong_reuse
            assert not rec.read_freed_blocks
        assert not d.freed_reads
        metrics = parse_prometheus(p.metrics_text())
        assert external_kv_tokens(metrics) == sum(x["reused_tokens"] for x in decisions)

        recomputed = await run_conversation(r, None, stream=stream, endpoint=endpoint)
        assert recomputed == reused
        assert [x["reason"] for x in (await r.stats())["decisions"]["recent"][4:]] == [
            "no_conversation_id"] * 4


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
                line = await anext(lines)
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
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
            assert len(text) == 16
            assert getattr(first, "kv_transfer_params", None) is None
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
            assert len("".join(parts)) == 16 and usage is not None
            assert (await r.last_decision())["reason"] == "pull"
            await r.settle()
            comp = await client.completions.create(
                model="tiny", prompt=FIRST, max_tokens=8, extra_body={"conversation_id": "c2"})
            assert len(comp.choices[0].text) == 8
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


async def test_concurrent_turns_pull_d_blocks_at_most_once() -> None:
    async with routed(num_prefill=2, num_decode=2) as r:
        messages = [{"role": "user", "content": FIRST}]
        async with r.client() as c:
            first = (await c.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 16, "conversation_id": "race"})).json()
            await r.settle()
            messages += [{"role": "assistant", "content": first["choices"][0]["message"][
                "content"]}, {"role": "user", "content": "next"}]
            body = {"messages": messages, "max_tokens": 16, "conversation_id": "race"}
            results = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body) for _ in range(4)))
        assert all(x.status_code == 200 for x in results)
        texts = {x.json()["choices"][0]["message"]["content"] for x in results}
        assert len(texts) == 1  # every turn, pulled or not, gives the same answer
        records = [rec for p in r.cluster.prefill for rec in p.records if rec.plan == "pull"]
        sources = [rec.pulled_from_request for rec in records]
        assert len(sources) == len(set(sources)) >= 1
        assert all(not rec.wrong_reuse and not rec.read_freed_blocks for rec in records)
        assert not any(d.freed_reads for d in r.cluster.decode)


async def test_long_conversation_across_blocks_with_edit_stays_correct() -> None:
    """An edited assistant reply makes the verified prefix shorter than what D holds: the
    router cuts the pull at a block boundary and the output still equals a recompute."""
    async with routed() as r:
        p = r.cluster.prefill[0]
        async with r.client() as c:
            messages = [{"role": "user", "content": FIRST * 3}]
            body = {"messages": messages, "max_tokens": 200, "conversation_id": "edit"}
            reply = (await c.post("/v1/chat/completions", json=body)).json()
            await r.settle()
            text = reply["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": text[:150] + "[edited]"},
                         {"role": "user", "content": "go on"}]
            routed_reply = (await c.post("/v1/chat/completions", json=body)).json()
            decision = await r.last_decision()
            assert decision["reason"] == "pull"
            held = len(p.model.encode_chat(messages[:1])) + 200 - 1
            assert decision["reused_tokens"] < held
            rec = last_prefill_record(p)
            assert rec.plan == "pull" and rec.pulled_matches_prompt and not rec.wrong_reuse
            plain = (await c.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 200})).json()
        assert routed_reply["choices"][0]["message"] == plain["choices"][0]["message"]
