"""Every decision reason and failure path with fake vLLM engines behind the router (real HTTP,
real D-side reports, one shared ManualClock for TTLs). The prefix-guard reasons are checked in
both guard modes: with kvrelay's connector on P (P proves and cuts the pull; the router's
decision is ``pull`` and P's record and answer tell what was proven) and with stock vLLM on
P (the router proves it from P's ``/tokenize``: ``prefix_mismatch``, ``below_threshold``,
``partial_reuse_unsafe``). Reports that are late, held or never come, which play out
differently for vLLM 0.32 and 0.33 D nodes, are in ``test_router_fake_versions.py``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kvrelay.client.sse import sse_events
from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.params import parse_remote_blocks
from kvrelay.fakevllm import FakeEngine
from kvrelay.fakevllm.config import RequestRecord
from kvrelay.router.blocks import infer_block_size
from tests.component.router_fake import (
    ENGINE_CONFIG,
    GUARD_CONFIGS,
    Routed,
    routed,
    until,
)
from tests.component.router_rig import assert_no_internal_fields, stream_text

FIRST = "Describe the water cycle for a curious ten year old, step by step. " * 5
GUARDS = list(GUARD_CONFIGS)
LONG_QUESTION = "Describe the water cycle for a curious ten year old, step by step. " * 12
CHUNK = 16
"""The prefix fingerprint's chunk: what a guard proves is a whole number of these."""


def proven_prefix(held: RequestRecord, sent: RequestRecord) -> int:
    """The tokens a guard can prove: the whole 16-token chunks of the prefix D's held context
    (``held``'s prompt and answer) shares with the prompt of the request ``sent`` to P."""
    context = [*held.prompt_token_ids, *held.output_token_ids]
    same = 0
    for a, b in zip(context, sent.prompt_token_ids, strict=False):
        if a != b:
            break
        same += 1
    return same // CHUNK * CHUNK


class Conversation:
    def __init__(self, r: Routed, conversation_id: str | None = "c", stream: bool = False,
                 max_tokens: int = 16) -> None:
        self.r = r
        self.id = conversation_id
        self.stream = stream
        self.max_tokens = max_tokens
        self.messages: list[dict[str, Any]] = []

    def body(self, user: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": self.max_tokens,
                                "stream": self.stream,
                                "messages": [*self.messages, {"role": "user", "content": user}]}
        if self.id is not None:
            body["conversation_id"] = self.id
        return body

    async def turn(self, user: str, settle: bool = True) -> tuple[int, str, list[Any]]:
        body = self.body(user)
        async with self.r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        ok_stream = self.stream and resp.status_code == 200
        payloads = sse_events(resp.text) if ok_stream else [resp.json()]
        assert_no_internal_fields(payloads)
        text = ""
        if resp.status_code == 200:
            text = (stream_text(payloads) if self.stream
                    else payloads[0]["choices"][0]["message"]["content"])
            self.messages = [*body["messages"], {"role": "assistant", "content": text}]
        if settle:
            await self.r.settle()
        return resp.status_code, text, payloads

    async def recompute_of_last(self) -> str:
        """The last reply as a plain recompute gives it (the reference engine, no KV)."""
        return await self.r.recompute({"model": "tiny", "max_tokens": self.max_tokens,
                                       "messages": self.messages[:-1]})

    async def entry(self) -> ConversationEntry | None:
        """The entry the conversation's next turn would continue."""
        found = await self.r.find(self.body("next"))
        return found.entry if found is not None else None


def holds(d: FakeEngine, record: RequestRecord) -> bool:
    """Whether D still holds the KV it retained for ``record``."""
    return record.internal_request_id in [h.request_id for h in d.held()]


async def two_turns(r: Routed, between: Any = None, **kw: Any) -> dict[str, Any]:
    conv = Conversation(r, **kw)
    status, _, _ = await conv.turn(FIRST)
    assert status == 200
    if between is not None:
        await between(conv)
    status, text, payloads = await conv.turn("And what happens in winter?")
    assert status == 200
    decision = dict(await r.last_decision())
    decision["payloads"] = payloads
    if decision["prefill_node"] is not None:  # P's record of turn 2, before the recompute
        decision["p_record"] = r.cluster.engine(decision["prefill_node"]).records[-1]
    assert text == await conv.recompute_of_last()
    return decision


# -- TTL on the shared clock --------------------------------------------------------------


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize(
    ("advance_s", "reason"), [(481.0, "expired"), (458.0, "near_expiry"), (400.0, "pull")]
)
async def test_ttl(advance_s: float, reason: str, guard: str) -> None:
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        async def wait(conv: Conversation) -> None:
            r.clock.advance(advance_s)

        decision = await two_turns(r, wait)
        assert decision["reason"] == reason
        assert (decision["p_record"].plan == "pull") == (reason == "pull")


# -- a follow-up D must refuse for its length ---------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("over", "guard"), [
    ("budget", "connector"), ("budget", "tokenize"),
    ("prompt", "tokenize"),  # only the router holding the prompt's ids knows its length
])
async def test_a_follow_up_vllm_refuses_for_its_length_leaves_the_kv_for_its_retry(
        over: str, guard: str, stream: bool) -> None:
    """Probe 9, finding 4: a follow-up vLLM must refuse for its length was pulled first.
    With an output budget over ``max_model_len``, P (asked for one token) accepts it and
    reads D's blocks, which frees D's only copy, before D answers 400; with a prompt over
    it P refuses, but the router's claim was spent. Either way the client's corrected retry
    recomputed (``no_entry``). The router reads D's ``max_model_len`` from its
    ``/v1/models`` and does not spend the entry on such a turn (``too_long``); the client
    still gets vLLM's own 400, and the retry pulls."""
    config = replace(GUARD_CONFIGS[guard], max_model_len=1024)
    async with routed(engine_config=config) as r:
        await r.ctx.nodes.check_all()
        assert r.ctx.nodes.state("decode-0").max_model_len == 1024  # type: ignore[union-attr]
        d = r.cluster.engine("decode-0")
        conv = Conversation(r, stream=stream)
        assert (await conv.turn(FIRST))[0] == 200
        turn1 = d.records[-1]
        assert holds(d, turn1)

        question = "And what happens in winter?"
        if over == "budget":
            conv.max_tokens = 1025
            status, _, payloads = await conv.turn(question)
            message = "max_tokens=1025 cannot be greater than max_model_len=1024"
        else:
            status, _, payloads = await conv.turn(question + " Really?" * 600)
            message = "maximum context length is 1024 tokens"
        assert status == 400 and message in payloads[0]["error"]["message"]
        decision = await r.last_decision()
        assert (decision["action"], decision["reason"]) == ("recompute", "too_long")
        assert holds(d, turn1) and await conv.entry() is not None

        conv.max_tokens = 16
        status, text, _ = await conv.turn(question)
        assert status == 200
        decision = await r.last_decision()
        assert (decision["action"], decision["reason"]) == ("pull", "pull")
        assert decision["reused_tokens"] > 0
        assert text == await conv.recompute_of_last()


@pytest.mark.parametrize("stream", [False, True])
async def test_max_completion_tokens_is_the_budget_whatever_max_tokens_says(
        stream: bool) -> None:
    """vLLM generates up to ``max_completion_tokens`` when a chat request gives it, even
    where ``max_tokens`` is smaller. The router took the smaller as the cap D's report
    must keep to, and refused D's genuine report of a longer answer (``mismatch_tokens``):
    the turn never committed, and its follow-up recomputed."""
    async with routed() as r:
        conv = Conversation(r, stream=stream, max_tokens=2)
        body = conv.body(FIRST)
        body["max_completion_tokens"] = 16
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        await r.settle()
        d_answer = r.cluster.engine("decode-0").records[-1]
        assert len(d_answer.output_token_ids) > 2
        text = (stream_text(sse_events(resp.text)) if stream
                else resp.json()["choices"][0]["message"]["content"])
        conv.messages = [*body["messages"], {"role": "assistant", "content": text}]
        status, _, _ = await conv.turn("And what happens in winter?")
        assert status == 200
        decision = await r.last_decision()
        assert (decision["action"], decision["reason"]) == ("pull", "pull")


async def test_a_budget_that_only_does_not_fit_with_the_prompt_is_clamped_and_pulls() -> None:
    """vLLM 0.32 / 0.33 clamp an output budget to what the prompt leaves of
    ``max_model_len`` (``get_max_tokens``) instead of refusing it: such a follow-up pulls,
    and D generates what fits."""
    async with routed(engine_config=replace(ENGINE_CONFIG, max_model_len=1024)) as r:
        await r.ctx.nodes.check_all()
        conv = Conversation(r)
        assert (await conv.turn(FIRST))[0] == 200
        conv.max_tokens = 1000
        status, _, payloads = await conv.turn("And what happens in winter?")
        assert status == 200
        decision = await r.last_decision()
        assert (decision["action"], decision["reason"]) == ("pull", "pull")
        usage = payloads[0]["usage"]
        assert usage["prompt_tokens"] + 1000 > 1024
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 1024


# -- nodes going down, restarting ---------------------------------------------------------


async def test_unhealthy_d_is_marked_down_and_its_entries_dropped() -> None:
    async with routed(num_decode=2) as r:
        async def fail(conv: Conversation) -> None:
            d0 = r.cluster.engine("decode-0")
            d0.faults.unhealthy = True
            await r.ctx.nodes.check_all()
            await r.ctx.nodes.check_all()
            assert not r.ctx.nodes.state("decode-0").up  # type: ignore[union-attr]
            assert len(r.ctx.index) == 0

        decision = await two_turns(r, fail)
        assert (decision["reason"], decision["decode_node"]) == ("no_entry", "decode-1")
        r.cluster.engine("decode-0").faults.unhealthy = False
        await r.ctx.nodes.check_all()
        assert r.ctx.nodes.state("decode-0").up  # type: ignore[union-attr]


async def test_node_down_when_the_turn_finished_after_d_went_down() -> None:
    async with routed(num_decode=2) as r:
        d0 = r.cluster.engine("decode-0")
        conv = Conversation(r)
        d0.faults.hang = True
        turn1 = asyncio.create_task(conv.turn(FIRST))
        await until(lambda: d0.faults.num_hung == 1, "turn 1 held by D0")
        d0.faults.unhealthy = True
        await r.ctx.nodes.check_all()
        await r.ctx.nodes.check_all()
        d0.faults.hang = False
        assert (await turn1)[0] == 200
        entry = await conv.entry()
        assert entry is not None and entry.decode_node_id == "decode-0"
        status, text, _ = await conv.turn("And then?")
        assert status == 200 and text == await conv.recompute_of_last()
        decision = await r.last_decision()
        assert (decision["reason"], decision["decode_node"]) == ("node_down", "decode-1")


async def test_engine_restarted_once_the_new_engine_id_is_known() -> None:
    async with routed() as r:
        async def restart(conv: Conversation) -> None:
            d0 = r.cluster.engine("decode-0")
            await d0.restart()
            await Conversation(r, "other").turn("Hello there, how are you today? " * 4)
            assert r.ctx.nodes.state("decode-0").engine_id == d0.engine_id  # type: ignore[union-attr]

        decision = await two_turns(r, restart)
        assert decision["reason"] == "engine_restarted"
        assert decision["p_record"].plan == "none"


async def test_restart_not_yet_seen_is_caught_by_the_engine_id_in_the_params() -> None:
    """Before the router learns D restarted it pulls; P's read fails on the engine id and P
    recomputes (policy ``recompute``): the answer is still exactly right, and the turn is
    told as what it was, a recompute (``not_loaded``: P's answer says it loaded nothing;
    it was told as a pull of 0 tokens: probe 6, finding 6)."""
    async with routed() as r:
        async def restart(conv: Conversation) -> None:
            await r.cluster.engine("decode-0").restart()

        decision = await two_turns(r, restart)
        assert (decision["action"], decision["reason"], decision["reused_tokens"]) == (
            "recompute", "not_loaded", 0)
        rec = decision["p_record"]
        assert rec.load_failure == "engine_mismatch" and rec.recomputed_after_failure


async def test_crashed_d_is_retried_on_the_other_d() -> None:
    async with routed(num_decode=2) as r:
        async def crash(conv: Conversation) -> None:
            await r.cluster.engine("decode-0").crash()

        conv = Conversation(r)
        assert (await conv.turn(FIRST))[0] == 200
        await crash(conv)
        status, text, _ = await conv.turn("And what happens in winter?")
        assert status == 200 and text == await conv.recompute_of_last()
        decision = await r.last_decision()
        assert decision["decode_node"] == "decode-1" and decision["retries"] == 1
        assert not r.ctx.nodes.state("decode-0").up  # type: ignore[union-attr]
        entry = await conv.entry()
        assert entry is not None and entry.decode_node_id == "decode-1"


async def test_p_dropping_the_pull_is_retried_on_the_other_p_as_recompute() -> None:
    async with routed(num_prefill=2) as r:
        async def break_p0(conv: Conversation) -> None:
            r.cluster.engine("prefill-0").faults.die_after_tokens = 0  # reset, no answer

        decision = await two_turns(r, break_p0)
        assert (decision["decided"], decision["action"]) == ("pull/pull", "recompute")
        assert decision["reason"] == "prefill_failed" and decision["reused_tokens"] == 0
        assert decision["prefill_node"] == "prefill-1" and decision["retries"] == 1
        assert decision["p_record"].plan == "none"  # P-0 got the pull: the entry is spent
        assert [rec.plan for rec in r.cluster.engine("prefill-0").records][:2] == ["none", "pull"]


@pytest.mark.parametrize("guard", GUARDS)
async def test_crashed_p_is_replaced(guard: str) -> None:
    """P-0 died between turns. On stock P the router finds out at P-0's ``/tokenize``, before
    anything is sent with D's params, so P-1 pulls. With kvrelay's connector there is no
    ``/tokenize``: the pull goes to P-0 and cannot connect; P-0 never received D's params, so
    D's blocks are untouched and (``core.consequences.params_spent``) the retry on P-1 is the
    same pull. Either way P-1 pulls and the answer is right."""
    async with routed(num_prefill=2, engine_config=GUARD_CONFIGS[guard]) as r:
        async def crash(conv: Conversation) -> None:
            await r.cluster.engine("prefill-0").crash()

        decision = await two_turns(r, crash)
        assert (decision["reason"], decision["prefill_node"]) == ("pull", "prefill-1")
        assert not r.ctx.nodes.state("prefill-0").up  # type: ignore[union-attr]
        assert decision["p_record"].plan == "pull"
        assert decision["reused_tokens"] == decision["p_record"].pulled_tokens > 0
        assert decision["retries"] == (0 if guard == "tokenize" else 1)


@pytest.mark.parametrize("stream", [False, True])
async def test_d_failing_after_a_pull_is_reported_as_the_recompute_it_became(
        stream: bool) -> None:
    """P pulled, then the D given P's params answered 500 before a byte reached the client:
    P's blocks may have been read, so P recomputes and the other D decodes. The turn is
    reported as that recompute (``decode_failed``, nothing reused), not as the pull it was
    decided as (probe 14, K7: headers, /stats and the metrics said pull/pull, 0 reused)."""
    async with routed(num_decode=2) as r:
        async def fail_d0_once(conv: Conversation) -> None:
            r.cluster.engine("decode-0").faults.update({"error_status": 500, "error_count": 1})

        decision = await two_turns(r, fail_d0_once, stream=stream)
        assert (decision["decided"], decision["action"], decision["reason"]) == (
            "pull/pull", "recompute", "decode_failed")
        assert decision["reused_tokens"] == 0 and decision["retries"] == 1
        assert decision["decode_node"] == "decode-1"
        assert [rec.plan for rec in r.cluster.engine("prefill-0").records][-2:] == [
            "pull", "none"]
        payloads = decision["payloads"]
        if not stream:
            assert payloads[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_p_5xx_once_is_retried() -> None:
    async with routed() as r:
        p = r.cluster.prefill[0]
        p.faults.update({"error_status": 503, "error_count": 1})
        status, _, _ = await Conversation(r).turn(FIRST)
        assert status == 200
        assert (await r.last_decision())["retries"] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_d_5xx_on_the_only_d_is_a_502(stream: bool) -> None:
    async with routed() as r:
        r.cluster.decode[0].faults.update({"error_status": 500})
        status, _, payloads = await Conversation(r, stream=stream).turn(FIRST)
        assert status == 502 and payloads[0]["error"]["code"] == 502
        assert len(r.ctx.desk) == 0 and len(r.ctx.index) == 0


async def test_d_dying_mid_stream() -> None:
    async with routed() as r:
        conv = Conversation(r, stream=True)
        assert (await conv.turn(FIRST))[0] == 200
        r.cluster.decode[0].faults.die_after_tokens = 3
        status, text, payloads = await conv.turn("more", settle=False)
        died = r.cluster.decode[0].records[-1]
        assert status == 200 and len(died.output_token_ids) == 3
        assert text == r.cluster.decode[0].model.decode(died.output_token_ids)
        assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == 502
        await r.settle()
        assert len(r.ctx.index) == 0
        r.cluster.decode[0].faults.die_after_tokens = None
        assert (await conv.turn("again"))[0] == 200
        assert (await r.last_decision())["reason"] == "no_entry"


# -- policy reasons -----------------------------------------------------------------------


@pytest.mark.parametrize("guard", GUARDS)
async def test_prefix_mismatch(guard: str) -> None:
    """After a short question, the answer is re-sent with a leading space: the request still
    continues the entry (answers compare stripped), but its tokens part from D's right after
    the question, so fewer than the threshold are proven. On stock P the router proves it
    (``prefix_mismatch``) and recomputes; with kvrelay's connector the router decides ``pull``
    from estimates and P's guard finds the mismatch: nothing is loaded, D is notified and
    frees its blocks, and the turn is reported as the recompute it was. The answer equals a
    recompute."""
    async with routed(engine_config=GUARD_CONFIGS[guard]) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        conv = Conversation(r, max_tokens=64)
        assert (await conv.turn("Hi there, what is the water cycle?"))[0] == 200
        turn1 = d.records[-1]
        assert len(turn1.prompt_token_ids) + 64 - 1 >= ENGINE_CONFIG.kv_recompute_threshold
        conv.messages[-1]["content"] = " " + conv.messages[-1]["content"]
        status, text, payloads = await conv.turn("And then?")
        assert status == 200 and text == await conv.recompute_of_last()
        decision = await r.last_decision()
        rec = p.records[-1]
        # the tokens part right after the question (BPE may fold the answer's added space
        # into the template's last token): some whole chunks, fewer than the threshold
        proven = proven_prefix(turn1, rec)
        assert len(turn1.prompt_token_ids) - CHUNK <= proven <= len(turn1.prompt_token_ids)
        assert 0 < proven < ENGINE_CONFIG.kv_recompute_threshold
        assert decision["verified_tokens"] == proven and decision["reused_tokens"] == 0
        assert payloads[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert rec.pulled_tokens == 0 and rec.computed_tokens == len(rec.prompt_token_ids)
        assert (decision["action"], decision["reason"]) == ("recompute", "prefix_mismatch")
        if guard == "connector":  # decided from estimates; P's guard refused it
            assert decision["decided"] == "pull/pull"
            assert (rec.guard, rec.verified_tokens, rec.plan) == (
                "prefix_mismatch", proven, "local_hit")
            assert rec.notified_engine == d.engine_id and not holds(d, turn1)
        else:
            assert decision["decided"] == "recompute/prefix_mismatch"
            assert decision["exact"] is True and rec.plan == "none" and rec.guard is None


@pytest.mark.parametrize("guard", GUARDS)
async def test_below_threshold(guard: str) -> None:
    """The router's threshold above anything D holds: ``below_threshold`` from estimates
    (connector mode) or from P's ``/tokenize`` (stock P); nothing is sent to D's blocks."""
    async with routed(engine_config=GUARD_CONFIGS[guard], kv_recompute_threshold=100_000) as r:
        decision = await two_turns(r)
        assert (decision["action"], decision["reason"]) == ("recompute", "below_threshold")
        assert decision["exact"] is (guard == "tokenize")
        assert decision["p_record"].plan == "none"
        assert decision["p_record"].request_kv_transfer_params == {"do_remote_decode": True}


@pytest.mark.parametrize("guard", GUARDS)
async def test_below_p_threshold_p_recomputes_and_frees_d(guard: str) -> None:
    """Only P's own threshold is above what D holds: the router pulls, P loads nothing
    (kvrelay's guard: every token matched, too few; stock vLLM: its scheduler's threshold) and
    notifies D, which frees its blocks. The answer equals a recompute, and the turn is
    told as one (``not_loaded``: P's answer says it loaded nothing)."""
    config = replace(GUARD_CONFIGS[guard], kv_recompute_threshold=100_000)
    async with routed(engine_config=config) as r:
        d = r.cluster.decode[0]
        decision = await two_turns(r)
        rec: RequestRecord = decision["p_record"]
        assert (decision["action"], decision["reason"]) == ("recompute", "not_loaded")
        assert decision["reused_tokens"] == rec.pulled_tokens == 0
        assert rec.notified_engine == d.engine_id
        assert not holds(d, d.records[0])
        held = len(d.records[0].prompt_token_ids) + 16 - 1
        if guard == "connector":
            assert (rec.guard, rec.verified_tokens, rec.plan) == (
                "below_threshold", held, "local_hit")
            assert decision["verified_tokens"] == held
        else:
            assert (rec.guard, rec.plan) == (None, "below_threshold")
            assert decision["verified_tokens"] == held and decision["exact"] is True


@pytest.mark.parametrize("guard", GUARDS)
async def test_partial_reuse_needs_the_block_size(guard: str) -> None:
    """The answer re-sent with a leading space after a long question proves only the question.
    The router is not told D's block size (96) and cannot infer it from D's params (not a
    power of two). Stock D does not say it either, so the block list cannot be cut:
    ``partial_reuse_unsafe``, recompute. kvrelay's D declares it with its params
    (``kvrelay_block_size``), so the proven prefix is pulled."""
    config = replace(GUARD_CONFIGS[guard], block_size=96)
    async with routed(engine_config=config, block_size=None) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        conv = Conversation(r)
        # ~310 prompt tokens: 4 blocks of 96, a count no power-of-two block size gives
        assert (await conv.turn(LONG_QUESTION))[0] == 200
        turn1 = d.records[-1]
        params = turn1.kv_transfer_params
        assert params is not None and len(params["remote_block_ids"][0]) == 4
        assert infer_block_size(parse_remote_blocks(params)) is None
        conv.messages[-1]["content"] = " " + conv.messages[-1]["content"]
        status, text, _ = await conv.turn("And then?")
        assert status == 200 and text == await conv.recompute_of_last()
        decision = await r.last_decision()
        rec = p.records[-1]
        proven = proven_prefix(turn1, rec)  # the question, in whole chunks
        assert len(turn1.prompt_token_ids) - CHUNK <= proven <= len(turn1.prompt_token_ids)
        assert decision["verified_tokens"] == proven
        if guard == "connector":
            assert decision["reason"] == "pull" and decision["reused_tokens"] == proven
            assert (rec.guard, rec.plan, rec.pulled_tokens) == ("pull", "pull", proven)
            assert rec.pulled_matches_prompt and not rec.wrong_reuse
        else:
            assert decision["reason"] == "partial_reuse_unsafe"
            assert rec.plan == "none" and rec.pulled_tokens == 0


async def test_cost_model() -> None:
    async with routed(pull_cost_factor=1e9) as r:
        assert (await two_turns(r))["reason"] == "cost_model"


async def test_without_a_conversation_id_the_history_finds_the_entry() -> None:
    """No id, no session header: the follow-up that re-sends the history pulls (TURNPATH 1:
    ``no_conversation_id`` is gone), and the turn's own entry takes the consumed one's place."""
    async with routed() as r:
        decision = await two_turns(r, conversation_id=None)
        assert (decision["reason"], decision["turn"]) == ("pull", 2)
        rec: RequestRecord = decision["p_record"]
        assert rec.plan == "pull" and rec.pulled_tokens == decision["reused_tokens"] > 0
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert len(r.ctx.index) == 1


async def test_direct_reuses_d_prefix_cache() -> None:
    async with routed(direct_enabled=True) as r:
        decision = await two_turns(r)
        assert decision["reason"] == "direct"
        d = r.cluster.decode[0]
        routed_rec = [rec for rec in d.records if rec.local_cache_hit_tokens > 0]
        assert routed_rec and not routed_rec[0].wrong_reuse
        assert len(r.cluster.prefill[0].records) == 1  # turn 1 only: turn 2 skipped P
        usage = decision["payloads"][-1]["usage"]  # D's own: the plan is not D's truth
        assert usage["prompt_tokens_details"] is None
