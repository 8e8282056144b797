"""Fault matrix (issue #7) with fake vLLM engines behind the router over real HTTP.

Each fault is injected at the worst moment, then the same invariants are checked:

* non-streamed turns succeed (the router retries on another node, or P recomputes);
* a stream cut by a dead D ends with a clean SSE error event and ``[DONE]``;
* no later turn reuses KV from a dead or restarted engine (the fakes' request records);
* every reply equals the recompute of the same conversation (fake output is a pure function
  of the prompt tokens): the reference is a plain request straight to a live engine.

Every fault runs in both guard modes: kvrelay's connector on the engines (P proves pulls, no
``/tokenize``) and stock vLLM (the router calls P's ``/tokenize`` before a pull).

Already covered elsewhere, not repeated here: D crashed *between* turns, P resetting the
connection of a pull (``die_after_tokens=0``), D dying mid-stream with ``die_after_tokens``
(``test_router_fake_reasons.py``), and every retry/translation rule against a scripted mock
(``test_router_failures.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from kvrelay.client.sse import sse_events
from kvrelay.core.conversation import ConversationEntry
from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig
from kvrelay.router.index import EntryRef
from tests.component.router_fake import (
    ENGINE_CONFIG,
    GUARD_CONFIGS,
    PermitSleep,
    Routed,
    routed,
    until,
)
from tests.component.router_rig import assert_no_internal_fields, stream_text

FIRST = "Explain how a glacier shapes a valley, with examples from the Alps. " * 5
MAX_TOKENS = 16


@dataclass
class Reply:
    status: int
    text: str
    events: list[Any]
    headers: httpx.Headers


class Chat:
    """One conversation through the router; the history grows only on a complete reply."""

    def __init__(
        self, r: Routed, ref: FakeEngine, conversation_id: str, *, stream: bool = False
    ) -> None:
        self.r = r
        self.ref = ref
        self.id = conversation_id
        self.stream = stream
        self.messages: list[dict[str, Any]] = []

    def body(self, user: str) -> dict[str, Any]:
        messages = [*self.messages, {"role": "user", "content": user}]
        return {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS,
                "stream": self.stream, "conversation_id": self.id}

    async def turn(self, user: str, *, settle: bool = True) -> Reply:
        body = self.body(user)
        messages = body["messages"]
        async with self.r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        if self.stream and resp.status_code == 200:
            events = sse_events(resp.text)
            text = stream_text(events)
            complete = events[-1] == "[DONE]" and not any(
                isinstance(e, dict) and "error" in e for e in events)
        else:
            events = [resp.json()]
            text = events[0]["choices"][0]["message"]["content"] if resp.is_success else ""
            complete = resp.is_success
        assert_no_internal_fields(events)
        if complete:
            assert text == await reference(self.ref, messages), "differs from recompute"
            self.messages = [*messages, {"role": "assistant", "content": text}]
        if settle:
            await self.r.settle()
        return Reply(resp.status_code, text, events, resp.headers)


@pytest.fixture(params=list(GUARD_CONFIGS))
def guard(request: pytest.FixtureRequest) -> str:
    """The guard mode the engines put the router in (``connector`` or ``tokenize``)."""
    return str(request.param)


@pytest.fixture
def config(guard: str) -> FakeEngineConfig:
    return GUARD_CONFIGS[guard]


@pytest.fixture
async def ref() -> AsyncIterator[FakeEngine]:
    """A fault-free engine of its own (same model and seed), for reference replies."""
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        yield cluster.prefill[0]


async def reference(engine: FakeEngine, messages: list[dict[str, Any]]) -> str:
    """The reply a plain recompute gives: the request to the reference engine, no KV."""
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        resp = await c.post(engine.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


class ReuseAudit:
    """Checks every engine's request records: no wrong or freed-block reuse ever, and no read
    from an engine incarnation after it died."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.dead: dict[str, dict[str, int]] = {}  # engine id -> records per engine at death

    def died(self, engine: FakeEngine, engine_id: str) -> None:
        self.dead[engine_id] = {e.name: len(e.records) for e in self.cluster.engines}

    def check(self) -> None:
        for engine in self.cluster.engines:
            for i, rec in enumerate(engine.records):
                assert not rec.wrong_reuse, (engine.name, rec)
                assert not rec.read_freed_blocks, (engine.name, rec)
                if rec.pulled_tokens:
                    assert rec.pulled_matches_prompt, (engine.name, rec)
                for dead_id, seen in self.dead.items():
                    if i >= seen.get(engine.name, 0):
                        assert rec.pulled_from_engine != dead_id, (engine.name, rec)
            if engine.running:
                assert not engine.freed_reads, engine.name


def p_records(r: Routed, node: str) -> list[Any]:
    return r.cluster.engine(node).records


# -- (a) a P killed mid-prefill ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_p_killed_mid_prefill_is_retried_on_another_p(
    stream: bool, ref: FakeEngine, config: FakeEngineConfig
) -> None:
    """P-0 has read D's KV for a pull and is computing when it dies (connections reset). The
    turn is recomputed on P-1; the pulled entry is not used twice."""
    gate = PermitSleep()  # fast engines: only slow_stream_s sleeps, and they wait for permits
    async with routed(num_prefill=2, sleep=gate, engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        chat = Chat(r, ref, "a", stream=stream)
        assert (await chat.turn(FIRST)).status == 200
        p0, p1 = r.cluster.engine("prefill-0"), r.cluster.engine("prefill-1")
        p0.faults.slow_stream_s = 0.01  # P-0 stops after its prefill, before answering
        turn2 = asyncio.create_task(chat.turn("And in Norway?"))
        await until(lambda: gate.waiting == 1, "P-0 inside the turn-2 prefill")
        inflight = p0.records[-1]
        assert inflight.plan == "pull" and inflight.pulled_tokens > 0  # D's KV was read
        old_p0 = p0.engine_id
        await p0.crash()
        audit.died(p0, old_p0)
        reply = await turn2
        assert reply.status == 200
        decision = await r.last_decision()
        assert (decision["decided"], decision["prefill_node"]) == ("pull/pull", "prefill-1")
        assert (decision["action"], decision["reason"]) == ("recompute", "prefill_failed")
        assert decision["retries"] == 1 and reply.headers["x-kvrelay-reused-tokens"] == "0"
        assert p1.records[-1].plan == "none"  # a recompute: the pulled entry stays spent
        # the next turns pull again, from D's newest entry, even with P-0 back
        p0.faults.slow_stream_s = 0.0  # faults survive a restart
        await p0.start()
        await r.ctx.nodes.check_all()
        for user in ("And in Canada?", "Summarize."):
            assert (await chat.turn(user)).status == 200
            assert (await r.last_decision())["reason"] == "pull"
        audit.check()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_p_dead_before_d_reads_its_kv(
    policy: str, ref: FakeEngine, config: FakeEngineConfig
) -> None:
    """P-0 answers the prefill and dies before D-0 reads P-0's blocks. With ``recompute`` D
    recomputes in place; with ``fail`` D answers 500 after its failed read, so P-0's params
    are useless: the router prefills again (on P-1) before retrying on D-1."""
    config = replace(config, kv_load_failure_policy=policy)
    async with routed(num_prefill=2, num_decode=2, engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        p0, d0 = r.cluster.engine("prefill-0"), r.cluster.engine("decode-0")
        chat = Chat(r, ref, "a")
        assert (await chat.turn(FIRST)).status == 200
        d0.faults.hang = True  # D-0 holds the turn-2 request before reading P's KV
        turn2 = asyncio.create_task(chat.turn("And in Greenland?"))
        await until(lambda: d0.faults.num_hung == 1, "D-0 got the turn")
        assert p0.records[-1].plan == "pull" and p0.records[-1].finish_reason == "length"
        old_p0 = p0.engine_id
        await p0.crash()
        audit.died(p0, old_p0)
        d0.faults.hang = False
        reply = await turn2
        assert reply.status == 200
        read = d0.records[-1] if policy == "recompute" else next(
            rec for rec in d0.records if rec.load_failure is not None)
        assert read.load_failure == "unreachable"
        decision = await r.last_decision()
        if policy == "fail":
            assert decision["retries"] == 2  # D-0 failed, then P-1 and D-1
            assert (decision["prefill_node"], decision["decode_node"]) == (
                "prefill-1", "decode-1")
        assert (await chat.turn("And in Alaska?")).status == 200
        assert (await r.last_decision())["reason"] == "pull"
        audit.check()


# -- (b) a D killed mid-stream -------------------------------------------------------------


async def test_d_killed_mid_stream(ref: FakeEngine, config: FakeEngineConfig) -> None:
    """D-0 dies after 3 streamed tokens: the client gets 3 tokens, an SSE error event and
    [DONE]; no later turn of any conversation reuses D-0's KV, before or after it restarts."""
    gate = PermitSleep()
    async with routed(num_decode=2, sleep=gate, engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        d0 = r.cluster.engine("decode-0")
        a, b = Chat(r, ref, "a", stream=True), Chat(r, ref, "b")
        assert (await a.turn(FIRST)).status == 200
        assert (await b.turn("A different question about deserts and dunes. " * 4)).status \
            == 200
        held_a = await r.find(a.body("Go on."))
        assert held_a is not None and held_a.entry.decode_node_id == "decode-0"
        d0.faults.slow_stream_s = 0.01
        turn2 = asyncio.create_task(a.turn("Go on.", settle=False))
        gate.grant(3)
        await until(lambda: len(d0.records[-1].output_token_ids) == 3 and gate.waiting == 1,
                    "D-0 streamed 3 tokens")
        old_d0 = d0.engine_id
        streamed = list(d0.records[-1].output_token_ids)
        await d0.crash()
        audit.died(d0, old_d0)
        reply = await turn2
        assert reply.status == 200 and reply.text == d0.model.decode(streamed)  # 3 tokens
        assert reply.events[-1] == "[DONE]"
        err = reply.events[-2]["error"]
        assert err["code"] == 502 and set(err) == {"message", "type", "param", "code"}
        expected = await reference(ref, [*a.messages, {"role": "user", "content": "Go on."}])
        assert expected.startswith(reply.text)
        await r.settle()
        assert await r.find(a.body("Go on.")) is None
        assert (await r.last_decision())["outcome"] == "failed_mid_stream"
        # the client retries the turn; both conversations go on without D-0's KV
        a.stream = False
        assert (await a.turn("Go on.")).status == 200
        assert (await b.turn("And in the Sahara?")).status == 200
        assert not r.ctx.nodes.state("decode-0").up  # type: ignore[union-attr]
        d0.faults.slow_stream_s = 0.0  # faults survive a restart
        await d0.start()  # back with a new engine id
        await r.ctx.nodes.check_all()
        assert r.ctx.nodes.state("decode-0").up  # type: ignore[union-attr]
        for chat in (a, b):
            for user in ("More, please.", "Thanks."):
                assert (await chat.turn(user)).status == 200
        audit.check()


# -- (c) a D restarted with a new engine id between turns -----------------------------------


async def test_d_restarted_between_turns_never_serves_old_kv(
    ref: FakeEngine, config: FakeEngineConfig
) -> None:
    """Two conversations hold KV on D; D restarts. The first turn after it pulls with the old
    engine id (the router cannot know yet): P's read fails and P recomputes. From D's answer
    the router learns the new id, and the other conversation's entry is rejected."""
    async with routed(engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        d = r.cluster.engine("decode-0")
        a, b = Chat(r, ref, "a"), Chat(r, ref, "b")
        assert (await a.turn(FIRST)).status == 200
        assert (await b.turn("Tell me about volcanoes and how they form, in detail. " * 4)
                ).status == 200
        old = d.engine_id
        await d.restart()
        audit.died(d, old)
        assert (await a.turn("And in Iceland?")).status == 200
        rec = r.cluster.prefill[0].records[-1]
        assert rec.load_failure == "engine_mismatch" and rec.recomputed_after_failure
        assert r.ctx.nodes.state("decode-0").engine_id == d.engine_id  # type: ignore[union-attr]
        assert (await b.turn("Which one is the tallest?")).status == 200
        assert (await r.last_decision())["reason"] in ("engine_restarted", "no_entry")
        assert r.cluster.prefill[0].records[-1].plan == "none"
        for chat in (a, b):  # from here on, pulls from the new engine only
            assert (await chat.turn("Tell me more.")).status == 200
            assert (await r.last_decision())["reason"] == "pull"
            assert r.cluster.prefill[0].records[-1].pulled_from_engine == d.engine_id
        audit.check()


# -- (d) D's NIXL side channel unreachable --------------------------------------------------


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_d_side_channel_unreachable(
    policy: str, ref: FakeEngine, config: FakeEngineConfig
) -> None:
    """P cannot read D's KV: with vLLM's ``recompute`` policy P recomputes in place; with
    ``fail`` P answers 500 and the router retries the turn as a recompute."""
    config = replace(config, kv_load_failure_policy=policy)
    async with routed(engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        chat = Chat(r, ref, "a")
        assert (await chat.turn(FIRST)).status == 200
        d.faults.side_channel_unreachable = True
        for user in ("And in Chile?", "And in Nepal?"):
            before = len(p.records)
            reply = await chat.turn(user)
            assert reply.status == 200 and reply.headers["x-kvrelay-reused-tokens"] == "0"
            tried = p.records[before]
            assert tried.plan == "pull" and tried.load_failure == "unreachable"
            decision = await r.last_decision()
            if policy == "recompute":
                assert tried.recomputed_after_failure and decision["retries"] == 0
            else:
                assert decision["retries"] == 1 and p.records[-1].plan == "none"
        d.faults.side_channel_unreachable = False
        assert (await chat.turn("Which is deepest?")).status == 200
        assert p.records[-1].pulled_from_engine == d.engine_id
        audit.check()


# -- (e) a P that hangs --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_hung_p_times_out_and_the_turn_is_recomputed_elsewhere(
    stream: bool, ref: FakeEngine, config: FakeEngineConfig
) -> None:
    """P-0 accepts the pull and never answers (its ``/tokenize``, on stock P, does): the
    router's read timeout fires and P-1 recomputes the turn. When P-0 wakes up later its
    stale read harms nobody."""
    async with routed(num_prefill=2, read_timeout_s=1.0, engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        p0, p1 = r.cluster.engine("prefill-0"), r.cluster.engine("prefill-1")
        chat = Chat(r, ref, "a", stream=stream)
        assert (await chat.turn(FIRST)).status == 200
        p0.faults.hang = True
        reply = await chat.turn("And in the Andes?")
        assert reply.status == 200
        decision = await r.last_decision()
        assert (decision["decided"], decision["prefill_node"]) == ("pull/pull", "prefill-1")
        assert (decision["action"], decision["reason"]) == ("recompute", "prefill_failed")
        assert decision["retries"] == 1 and p1.records[-1].plan == "none"
        assert reply.headers["x-kvrelay-reused-tokens"] == "0"
        assert p0.faults.num_hung == 1
        assert r.ctx.metrics.upstream_errors.labels("prefill-0", "timeout")._value.get() >= 1
        p0.faults.hang = False  # the stale pull now runs on P-0, its answer goes nowhere
        await until(lambda: p0.faults.num_hung == 0, "P-0 released")
        await asyncio.sleep(0.05)
        for user in ("And in the Rockies?", "Which is biggest?"):
            assert (await chat.turn(user)).status == 200
            assert (await r.last_decision())["reason"] == "pull"
        audit.check()


async def test_the_only_p_hanging_is_a_504(ref: FakeEngine, config: FakeEngineConfig) -> None:
    async with routed(read_timeout_s=0.5, engine_config=config) as r:
        chat = Chat(r, ref, "a")
        assert (await chat.turn(FIRST)).status == 200
        r.cluster.prefill[0].faults.hang = True
        reply = await chat.turn("And then?")
        assert reply.status == 504 and reply.events[0]["error"]["code"] == 504
        r.cluster.prefill[0].faults.hang = False
        assert (await chat.turn("And then?")).status == 200


# -- (f) an entry that expires between the decision and its use -----------------------------


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_entry_expiring_between_decision_and_pull(
    policy: str, monkeypatch: pytest.MonkeyPatch, ref: FakeEngine, config: FakeEngineConfig
) -> None:
    """The policy decides ``pull`` on a live entry; before the claim the clock passes D's TTL
    (the seam: the index's ``claim``). P declines the expired blocks and recomputes (or fails,
    and the router recomputes): the reply is still the recompute's."""
    config = replace(config, kv_load_failure_policy=policy)
    async with routed(engine_config=config) as r:
        audit = ReuseAudit(r.cluster)
        p = r.cluster.prefill[0]
        chat = Chat(r, ref, "a")
        assert (await chat.turn(FIRST)).status == 200
        index = r.ctx.index
        claim: Callable[[EntryRef, ConversationEntry],
                        Awaitable[ConversationEntry | None]] = index.claim
        advanced: list[float] = []

        async def late_claim(ref: EntryRef, entry: ConversationEntry
                             ) -> ConversationEntry | None:
            if not advanced:
                advanced.append(r.clock.advance(ENGINE_CONFIG.decoder_kv_blocks_ttl + 1))
            return await claim(ref, entry)

        monkeypatch.setattr(index, "claim", late_claim)
        before = len(p.records)
        reply = await chat.turn("And in Patagonia?")
        assert advanced and reply.status == 200
        # P recomputed in place (policy recompute: told as ``not_loaded``), or failed and
        # another try recomputed (``prefill_failed``)
        assert reply.headers["x-kvrelay-action"] == "recompute"
        assert reply.headers["x-kvrelay-reason"] == ("not_loaded" if policy == "recompute"
                                                     else "prefill_failed")
        assert reply.headers["x-kvrelay-reused-tokens"] == "0"
        assert p.records[before].load_failure == "expired"
        assert (await r.last_decision())["retries"] == (0 if policy == "recompute" else 1)
        assert not r.cluster.decode[0].freed_reads
        assert (await chat.turn("Which glacier is largest?")).status == 200
        assert (await r.last_decision())["reason"] == "pull"
        assert p.records[-1].pulled_tokens > 0
        audit.check()
