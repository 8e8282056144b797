"""The Responses API (``/v1/responses``) and the Anthropic Messages API (``/v1/messages``)
through the router in front of fake vLLM P/D engines: follow-ups pull without any id (found
by the history each turn re-sends, in that API's form), every reply equals a recompute, the
API's cached-token field is the prompt tokens P did not compute (streamed and not alike),
nothing internal reaches the client, what P/D cannot carry is refused in the API's error
shape, and the two harnesses' request shapes (``tests/data/harness``) chain id-free."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.fakevllm import FakeEngine
from kvrelay.router.engine_check import MIN_INTERVAL_S
from tests.component.router_fake import (
    ENGINE_CONFIG,
    GUARD_CONFIGS,
    STOCK_CONFIG,
    Routed,
    routed,
    until,
)
from tests.component.router_rig import walk_keys

HARNESS = Path(__file__).parents[1] / "data" / "harness"
FIRST = "Tell me everything about the rivers of Europe, in order of length. " * 6
FOLLOW_UPS = ["And Asia?", "Which one is the longest overall?", "Summarize in one line."]
PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}


def sse(text: str) -> list[tuple[str, Any]]:
    """``(event name, data)`` of a Responses or Messages stream."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            head, _, data = block.partition("\n")
            assert head.startswith("event: ") and data.startswith("data: "), block
            out.append((head[7:], json.loads(data[6:])))
    return out


def assert_clean(text: str, payloads: list[Any]) -> None:
    assert "kvrelay_" not in text and "kv_transfer_params" not in text
    for payload in payloads:
        for key, _ in walk_keys(payload):
            assert key not in ("remote_block_ids", "remote_engine_id"), payload


class Reply:
    """One answer as the client saw it, in its API's form."""

    def __init__(self, api: str, text: str, stream: bool) -> None:
        self.raw = text
        if not stream:
            obj = json.loads(text)
            self.payloads = [obj]
            final = obj
        else:
            events = sse(text)
            self.payloads = [data for _, data in events]
            if api == "responses":
                assert events[-1][0] == "response.completed"
                final = events[-1][1]["response"]
            else:
                assert events[-1][0] == "message_stop"
                final = next(d for k, d in events if k == "message_delta")
        self.usage = final["usage"]
        if api == "responses":
            self.output = final["output"]
            self.text = "".join(p["text"] for item in final["output"]
                                if item["type"] == "message" for p in item["content"])
        elif not stream:
            self.output = final["content"]
            self.text = "".join(b["text"] for b in final["content"] if b["type"] == "text")
        else:
            self.text = "".join(d["delta"].get("text", "") for k, d in events
                                if k == "content_block_delta")
            self.output = [{"type": "text", "text": self.text}]

    def cached(self, api: str) -> int:
        if api == "responses":
            return int(self.usage["input_tokens_details"]["cached_tokens"])
        return int(self.usage["cache_read_input_tokens"])

    def prompt(self, api: str) -> int:
        if api == "responses":
            return int(self.usage["input_tokens"])
        return int(self.usage["input_tokens"] + self.usage["cache_read_input_tokens"])


def first_body(api: str, stream: bool) -> dict[str, Any]:
    if api == "responses":
        return {"model": "tiny", "instructions": "Be brief.", "store": False,
                "input": [{"role": "user", "content": FIRST}], "max_output_tokens": 24,
                "stream": stream}
    return {"model": "tiny", "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": FIRST}]}],
            "max_tokens": 24, "stream": stream}


def follow_up(api: str, body: dict[str, Any], reply: Reply, user: str) -> dict[str, Any]:
    """The next turn as a harness sends it: the whole history, D's answer as it came, the
    new user message. Messages moves its ``cache_control`` marker to the last message (as
    Claude Code does) and sends a new ``metadata`` each turn."""
    body = json.loads(json.dumps(body))
    if api == "responses":
        body["input"] += [*reply.output, {"role": "user", "content": user}]
        return body
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else ():
            block.pop("cache_control", None)
    body["messages"] += [
        {"role": "assistant", "content": reply.output},
        {"role": "user", "content": [{"type": "text", "text": user,
                                      "cache_control": {"type": "ephemeral"}}]}]
    body["metadata"] = {"turn": len(body["messages"])}
    return body


async def conversation(r: Routed, api: str, stream: bool) -> tuple[list[dict[str, Any]],
                                                                  list[Reply]]:
    bodies, replies = [first_body(api, stream)], []
    async with r.client() as c:
        for user in [*FOLLOW_UPS, None]:
            resp = await c.post(PATHS[api], json=bodies[-1])
            assert resp.status_code == 200, resp.text
            reply = Reply(api, resp.text, stream)
            assert_clean(resp.text, reply.payloads)
            replies.append(reply)
            await r.settle()
            if user is not None:
                bodies.append(follow_up(api, bodies[-1], reply, user))
    return bodies, replies


async def recompute(engine: FakeEngine, api: str, body: dict[str, Any]) -> str:
    plain = {k: v for k, v in body.items() if k != "stream"}
    async with r_client() as c:
        resp = await c.post(engine.url + PATHS[api], json=plain)
    assert resp.status_code == 200, resp.text
    return Reply(api, resp.text, False).text


def r_client() -> Any:
    import httpx

    return httpx.AsyncClient(timeout=30.0, trust_env=False)


@pytest.mark.parametrize("guard", list(GUARD_CONFIGS))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_follow_ups_pull_without_an_id_and_match_a_recompute(
    api: str, stream: bool, guard: str
) -> None:
    """Turns 2..4 pull with the kvrelay connector on P; stock vLLM (``/tokenize`` mode)
    cannot render these APIs' prompts for the router's guard, nor return their token ids
    for a fingerprint, so no turn becomes an entry and they recompute. The turns stock D
    retained are released through P (``StockReleases.unheld``): before, each stayed on D
    for its TTL with nothing that could ever pull it."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        bodies, replies = await conversation(r, api, stream)
        decisions = (await r.stats())["decisions"]["recent"]
        if guard == "tokenize":
            assert [x["reason"] for x in decisions] == ["no_entry"] * 4
            assert all(rec.plan == "none" for rec in p.records)
            if stream and r.cluster.decode_config.vllm_version == "0.32":
                return  # a stock 0.32 D streams no params and reports nothing: unknown
            assert len(d.held()) == 4
            assert await r.ctx.stock_releases.run_once() == 4
            await until(lambda: not d.held(), "the turns no entry points at released")
            return
        assert [x["reason"] for x in decisions] == ["no_entry", "pull", "pull", "pull"]
        assert len({x["key"] for x in decisions}) == 1
        assert replies[0].cached(api) == 0
        for rec, decision, reply in zip(p.records[1:], decisions[1:], replies[1:],
                                        strict=True):
            assert rec.plan == "pull" and rec.pulled_from_engine == d.engine_id
            assert rec.pulled_tokens == decision["reused_tokens"] > 0
            assert rec.pulled_matches_prompt and not rec.wrong_reuse
            assert reply.cached(api) == rec.pulled_tokens + rec.local_cache_hit_tokens
            assert reply.prompt(api) == len(rec.prompt_token_ids)
        metrics = parse_prometheus(p.metrics_text())
        assert external_kv_tokens(metrics) == sum(x["reused_tokens"] for x in decisions)
        assert [await recompute(r.reference, api, b) for b in bodies] == [
            x.text for x in replies]


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_stock_p_recomputes_unverifiable_and_d_keeps_only_the_last_turn(
        api: str) -> None:
    """kvrelay's connector on D, stock vLLM on P: the router cannot prove a pull of these
    APIs' prompts (no ``/tokenize`` for them), so each follow-up recomputes, reported as
    ``unverifiable`` in the conversation it continues, and supersedes the turn it continued:
    D is ordered to release it and holds only the last turn. Before, the router dropped the
    entry it found, so the follow-up was reported as a new conversation (``no_entry``) and
    every turn stayed on D until its retention ran out, with nothing that could pull it."""
    async with routed(prefill_config=STOCK_CONFIG) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        await conversation(r, api, False)
        decisions = (await r.stats())["decisions"]["recent"]
        assert [x["reason"] for x in decisions] == ["no_entry"] + ["unverifiable"] * 3
        assert [x["turn"] for x in decisions] == [1, 2, 3, 4]
        assert len({x["key"] for x in decisions}) == 1
        assert all(rec.plan == "none" for rec in p.records)
        assert d.state.syncer is not None
        await d.state.syncer.sync_now()
        await until(lambda: len(d.held()) == 1, "the superseded turns released")
        assert d.held()[0].request_id == d.records[-1].internal_request_id


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_router_asks_p_at_its_health_check_so_its_first_follow_up_pulls(
        api: str) -> None:
    """A router learns whether P runs kvrelay's connector from P's answers. One that had
    sent P no turn yet (a replica, a router restarted on shared state) did not know, and
    recomputed its first Responses or Messages follow-up (probe 13, H3). Now P is asked at
    its first passing health check (``EngineChecks.learn``), as a D is its engine."""
    async with routed() as r:
        p = r.cluster.prefill[0]
        assert not r.ctx.nodes.verifies_pulls("prefill-0")
        await r.ctx.nodes.check_all()
        assert r.ctx.nodes.verifies_pulls("prefill-0")
        assert r.ctx.nodes.trusted_identity("prefill-0")[0] == p.engine_id
        checks = r.ctx.metrics.engine_checks
        assert checks.labels("prefill-0", "learned")._value.get() == 1
        await r.ctx.nodes.check_all()  # known now: not asked again
        assert checks.labels("prefill-0", "learned")._value.get() == 1
        await r.ctx.nodes.mark_down("prefill-0", "test")
        assert not r.ctx.nodes.verifies_pulls("prefill-0")  # it may come back without it
        r.clock.advance(MIN_INTERVAL_S)
        await r.ctx.nodes.check_all()
        assert r.ctx.nodes.verifies_pulls("prefill-0")
    async with routed(prefill_config=STOCK_CONFIG) as r:
        await r.ctx.nodes.check_all()
        assert not r.ctx.nodes.verifies_pulls("prefill-0")
        assert r.ctx.metrics.engine_checks.labels("prefill-0", "learned")._value.get() == 1


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_streamed_and_non_streamed_usage_agree(api: str) -> None:
    usage: dict[bool, list[tuple[int, int, str]]] = {}
    for stream in (False, True):
        async with routed() as r:
            _, replies = await conversation(r, api, stream)
            usage[stream] = [(x.prompt(api), x.cached(api), x.text) for x in replies]
    assert usage[True] == usage[False]
    assert all(cached > 0 for _, cached, _ in usage[True][1:])


def load_harness(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((HARNESS / name).read_text())
    return data


@pytest.mark.parametrize(("name", "api"), [("codex_turn1.json", "responses"),
                                           ("claude_code_turn1.json", "messages")])
@pytest.mark.parametrize("with_headers", [True, False])
async def test_harness_sessions_pull_on_follow_ups(name: str, api: str,
                                                    with_headers: bool) -> None:
    """The harness's own request shape, re-sent with its history as it does, pulls on every
    follow-up: with its session ids (headers, ``prompt_cache_key``, ``metadata.user_id``)
    and with none of them (found by the history alone; ``follow_up`` changes ``metadata``
    and moves ``cache_control`` every turn)."""
    harness = load_harness(name)
    config = replace(ENGINE_CONFIG, max_model_len=131072)
    async with routed(engine_config=config) as r:
        body = harness["body"]
        headers = harness["headers"] if with_headers else {}
        if not with_headers:
            body = {k: v for k, v in body.items() if k not in ("prompt_cache_key", "metadata")}
        async with r.client() as c:
            for turn in range(3):
                resp = await c.post(harness["path"], json=body, headers=headers)
                assert resp.status_code == 200, resp.text
                expected = "no_entry" if turn == 0 else "pull"
                assert resp.headers["x-kvrelay-reason"] == expected
                reply = Reply(api, resp.text, bool(body.get("stream")))
                assert_clean(resp.text, reply.payloads)
                if turn:
                    assert reply.cached(api) > 0
                await r.settle()
                metadata = body.get("metadata")
                body = follow_up(api, body, reply, f"Now check step {turn}.")
                if with_headers and metadata is not None:
                    body["metadata"] = metadata  # Claude Code's session stays


async def test_what_p_d_cannot_carry_is_refused_in_each_apis_shape() -> None:
    async with routed() as r:
        base = first_body("responses", False)
        cases: list[tuple[str, dict[str, Any] | bytes, int, str]] = [
            ("/v1/responses", {**base, "previous_response_id": "resp_1"}, 400, "store: false"),
            ("/v1/responses", {**base, "conversation": "conv_1"}, 400, "whole conversation"),
            ("/v1/responses", {**base, "tools": [{"type": "web_search_preview"}]}, 400,
             "built-in"),
            ("/v1/responses", {**base, "tools": [{"type": "mcp", "server_label": "x"}]}, 400,
             "tool server"),
            ("/v1/responses", {**base, "background": True}, 400, "background"),
            ("/v1/responses", {**base, "input": []}, 400, "input"),
            ("/v1/responses", {**base, "max_output_tokens": 0}, 400, "max_output_tokens"),
            ("/v1/responses", {**base, "kv_transfer_params": {}}, 400, "reserved"),
            ("/v1/responses", b"{not json", 400, "Invalid JSON"),
        ]
        mbase = first_body("messages", False)
        mcases: list[tuple[str, dict[str, Any] | bytes, int, str]] = [
            ("/v1/messages", {**mbase, "messages": []}, 400, "messages"),
            ("/v1/messages?beta=true", {**mbase, "messages": [{"role": "tool",
                                                               "content": "x"}]},
             400, "role"),
            ("/v1/messages", {**mbase, "max_tokens": -1}, 400, "max_tokens"),
            ("/v1/messages", {**mbase, "stream": "yes"}, 400, "stream"),
            ("/v1/messages", {**mbase, "kv_transfer_params": {}}, 400, "reserved"),
            ("/v1/messages", b"[1, 2", 400, "Invalid JSON"),
            ("/v1/messages", {**mbase, "model": "nope"}, 404, "nope"),
            ("/v1/messages/count_tokens", {"model": "tiny", "messages": "x"}, 400, "messages"),
        ]
        before = len(r.cluster.prefill[0].received)
        for path, body, status, words in [*cases, *mcases]:
            resp = await r.post(path, body)
            assert resp.status_code == status, (path, body, resp.text)
            err = resp.json()
            if path.startswith("/v1/messages"):
                assert err["type"] == "error" and set(err) == {"type", "error"}
                assert set(err["error"]) == {"type", "message"}
                assert words in err["error"]["message"]
                assert err["error"]["type"] == ("not_found_error" if status == 404
                                                else "invalid_request_error")
            else:
                assert set(err["error"]) == {"message", "type", "param", "code"}
                named = {"previous_response_id": "previous_response_not_found"}  # OpenAI's
                assert words in err["error"]["message"]
                assert err["error"]["code"] == named.get(err["error"]["param"], status)
        p = r.cluster.prefill[0]
        # only the unknown model reached P (vLLM judges models), nothing else did
        assert len([x for x in list(p.received)[before:] if x.path.startswith("/v1/")]) == 1


async def test_store_true_is_served_as_store_false_and_count_tokens_answers() -> None:
    async with routed() as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        resp = await r.post("/v1/responses", {**first_body("responses", False), "store": True})
        assert resp.status_code == 200
        sent = [json.loads(x.body) for e in (p, d) for x in e.received
                if x.path == "/v1/responses"]
        assert len(sent) == 2 and all(b["store"] is False for b in sent)
        counted = await r.post("/v1/messages/count_tokens", {
            "model": "tiny", "messages": [{"role": "user", "content": FIRST}]})
        assert counted.status_code == 200
        # the chat prompt's tokens (the template around FIRST), counted by the engine's tokenizer
        assert counted.json()["input_tokens"] == len(
            p.model.encode_chat([{"role": "user", "content": FIRST}]))
        assert counted.json()["input_tokens"] > len(p.model.encode_prompt(FIRST, False))


async def test_the_openai_and_anthropic_sdks_work_unmodified() -> None:
    async with routed() as r:
        oa = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=r.url, api_key="unused", max_retries=0)
        try:
            items: list[Any] = [{"role": "user", "content": FIRST}]
            first = await oa.responses.create(model="tiny", input=items, store=False,
                                              max_output_tokens=16)
            await r.settle()
            items += [o.model_dump(exclude_none=True) for o in first.output]
            items.append({"role": "user", "content": "More please."})
            async with await oa.responses.create(model="tiny", input=items, store=False,
                                                 max_output_tokens=16, stream=True) as stream:
                done = [e async for e in stream if e.type == "response.completed"]
            assert done and done[0].response.usage is not None
            assert done[0].response.usage.input_tokens_details.cached_tokens == (
                await r.last_decision())["reused_tokens"] > 0
            with pytest.raises(openai.BadRequestError):
                await oa.responses.create(model="tiny", input="x", previous_response_id="r1")
            await r.settle()
            messages: list[Any] = [{"role": "user", "content": FIRST}]
            reply = await an.messages.create(model="tiny", max_tokens=16, messages=messages)
            await r.settle()
            messages += [{"role": "assistant", "content": reply.content[0].text},  # type: ignore[union-attr]
                         {"role": "user", "content": "More please."}]
            async with an.messages.stream(model="tiny", max_tokens=16,
                                          messages=messages) as ms:
                final = await ms.get_final_message()
            decision = await r.last_decision()
            assert decision["reason"] == "pull"
            assert final.usage.cache_read_input_tokens == decision["reused_tokens"] > 0
            with pytest.raises(anthropic.BadRequestError) as bad:
                await an.messages.create(model="tiny", max_tokens=16, messages=[])
            assert bad.value.status_code == 400
        finally:
            await oa.close()
            await an.close()


WEATHER: dict[str, Any] = {"name": "get_weather", "description": "Current weather",
                           "strict": True, "input_schema": {"type": "object", "enum": [
                               {"city": "Oslo"}, {"city": "Rome"}]}}
#: Per turn: (streamed, the tool_choice forcing a tool_use, or None for a text answer).
TOOL_TURNS: list[tuple[bool, dict[str, Any] | None]] = [
    (False, {"type": "tool", "name": "get_weather"}), (True, {"type": "any"}),
    (False, None), (True, {"type": "tool", "name": "get_weather"}), (False, None)]


def without_ids(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


async def test_forced_tool_use_round_trips_pull_without_an_id() -> None:
    """The ``anthropic`` SDK with a tool whose use ``tool_choice`` forces (``tool``, ``any``;
    the fake answers a ``tool_use`` block as vLLM does): the client answers each call with a
    ``tool_result`` block and the history with those blocks is found id-free, including
    after a streamed call (its input read from ``input_json_delta`` events): turns 2..5
    pull, ``cache_read_input_tokens`` is what P pulled, and each answer (its ``tool_use``
    ids aside) equals the same request recomputed."""
    async with routed() as r:
        p = r.cluster.prefill[0]
        client = anthropic.AsyncAnthropic(base_url=r.url, api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": FIRST}]
        try:
            for turn, (streamed, choice) in enumerate(TOOL_TURNS):
                body: dict[str, Any] = {"model": "tiny", "max_tokens": 16 if choice is None
                                        else 96, "tools": [WEATHER], "messages": list(messages)}
                if choice is not None:
                    body["tool_choice"] = choice
                if streamed:
                    async with client.messages.stream(**body) as stream:
                        finals = [e async for e in stream if e.type == "message_delta"]
                        message = await stream.get_final_message()
                    assert len(finals) == 1
                    cache_read = finals[0].usage.cache_read_input_tokens
                else:
                    message = await client.messages.create(**body)
                    cache_read = message.usage.cache_read_input_tokens
                await r.settle()
                decision = await r.last_decision()
                assert decision["reason"] == ("no_entry" if turn == 0 else "pull"), turn
                assert cache_read == decision["reused_tokens"] == p.records[-1].pulled_tokens
                if turn:
                    assert cache_read > 0 and p.records[-1].pulled_matches_prompt
                content = [b.model_dump(exclude_none=True) for b in message.content]
                async with r_client() as c:
                    again = await c.post(r.reference.url + "/v1/messages", json=body)
                assert without_ids(again.json()["content"]) == without_ids(content), turn
                if choice is None:
                    assert [b["type"] for b in content] == ["text"], turn
                    reply: list[dict[str, Any]] = [{"type": "text", "text": FOLLOW_UPS[0]}]
                else:
                    assert message.stop_reason == "tool_use", turn
                    assert [(b["type"], b["name"]) for b in content] == [
                        ("tool_use", "get_weather")], turn
                    reply = [{"type": "tool_result", "tool_use_id": content[0]["id"],
                              "content": "3 C, rain"}]
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": reply}]
        finally:
            await client.close()


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_d_dying_mid_stream_ends_with_the_apis_error_event(api: str) -> None:
    """D resets the connection after 3 deltas: the client gets them, then the API's error
    event (Responses': numbered after the last event relayed), and the turn leaves no
    entry; the next turn recomputes and is served."""
    async with routed() as r:
        d = r.cluster.decode[0]
        d.faults.die_after_tokens = 3
        async with r.client() as c:
            resp = await c.post(PATHS[api], json=first_body(api, True))
        events = sse(resp.text)
        assert resp.status_code == 200
        deltas = [e for k, e in events if k in ("response.output_text.delta",
                                                "content_block_delta")]
        assert len(deltas) == 3 and len(d.records[-1].output_token_ids) == 3
        kind, error = events[-1]
        assert kind == "error"
        if api == "responses":
            assert error["code"] == "502"
            assert error["sequence_number"] == events[-2][1]["sequence_number"] + 1
        else:
            assert error == {"type": "error", "error": {
                "type": "api_error", "message": "the decode node failed mid-stream"}}
        assert_clean(resp.text, [e for _, e in events])
        await r.settle()
        assert len(r.ctx.index) == 0 and (await r.last_decision())["outcome"] == \
            "failed_mid_stream"
        async with r.client() as c:  # not streamed: no answer from D at all
            cut = await c.post(PATHS[api], json=first_body(api, False))
        assert cut.status_code == 502
        assert ("error" in cut.json()) and (cut.json().get("type") == "error") == (
            api == "messages")
        d.faults.die_after_tokens = None
        async with r.client() as c:
            again = await c.post(PATHS[api], json=first_body(api, False))
        assert again.status_code == 200


async def test_a_streamed_tool_use_cut_before_its_arguments_is_found_again() -> None:
    """A forced call cut by ``max_tokens`` before its first argument streams a ``tool_use``
    block with no ``input_json_delta``; the SDK keeps its start ``input: {}`` and re-sends
    it, and the follow-up with the ``tool_result`` pulls (it recomputed, ``no_entry``)."""
    async with routed() as r:
        client = anthropic.AsyncAnthropic(base_url=r.url, api_key="unused", max_retries=0)
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "tools": [WEATHER],
                                "tool_choice": {"type": "tool", "name": "get_weather"},
                                "messages": [{"role": "user", "content": FIRST}]}
        try:
            async with client.messages.stream(**body) as stream:
                deltas = [e async for e in stream if e.type == "content_block_delta"]
                message = await stream.get_final_message()
            assert deltas == [] and message.stop_reason == "max_tokens"
            content = [b.model_dump(exclude_none=True) for b in message.content]
            assert [(b["type"], b["input"]) for b in content] == [("tool_use", {})]
            await r.settle()
            body["messages"] = [*body["messages"], {"role": "assistant", "content": content},
                                {"role": "user", "content": [{
                                    "type": "tool_result", "tool_use_id": content[0]["id"],
                                    "content": "3 C, rain"}]}]
            await client.messages.create(**{**body, "tool_choice": {"type": "auto"}})
            assert (await r.last_decision())["reason"] == "pull"
        finally:
            await client.close()
