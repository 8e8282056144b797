"""The fake engine's P/D role semantics follow vLLM 0.32's NixlConnector (pull mode,
bidirectional): turn 1 P->D, turn 2 D->P pull, freed-block reads, TTL and lease expiry,
the recompute threshold, prefix caching, and deterministic output. Where kvrelay's connector
changes what a node does (``FakeEngineConfig.kvrelay_connector``, on by default), both the
stock behaviour and kvrelay's are checked."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace as replace_struct

from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.params import (
    BLOCK_SIZE_KEY,
    FINGERPRINT_KEY,
    GUARD_KEY,
    GUARD_VERSION,
    RETENTION_MODE_KEY,
    parse_remote_blocks,
)
from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig, ManualClock
from kvrelay.fakevllm.model import generate_tokens
from tests.component.fake_engine_helpers import BLOCK, DATA, cdiv, chat, post, text_of, user

CONFIG = FakeEngineConfig(report_delay_s=0.0)
STOCK = replace(CONFIG, kvrelay_connector=False)
PROMPT = user("The quick brown fox jumps over the lazy dog. " * 28)  # 598 tokens
GEN = 16


def captured(name: str) -> Any:
    return json.loads(Path(DATA, name).read_text())


async def turn1(p: FakeEngine, d: FakeEngine, messages: list[dict[str, Any]] = PROMPT) -> Any:
    """P prefill then D decode; returns (P response, D response)."""
    pr = await chat(p, messages, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    dr = await chat(d, messages, max_tokens=GEN, kv_transfer_params=pr["kv_transfer_params"])
    return pr, dr


def turn2_messages(dr: Any, follow_up: str = "And then?") -> list[dict[str, Any]]:
    return [*PROMPT, {"role": "assistant", "content": text_of(dr)}, *user(follow_up)]


@pytest.mark.parametrize("connector", [False, True])
async def test_turn1_prefill_then_decode_pulls_all_prompt_blocks(connector: bool) -> None:
    """Stock engines answer exactly vLLM's keys; kvrelay's connector adds only its own:
    ``kvrelay_guard`` on every answer, the fingerprint of the held tokens and the block size
    on D's retained params."""
    clock = ManualClock()
    config = CONFIG if connector else STOCK
    async with FakeCluster(1, 1, config, clock=clock) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        n = len(p.model.encode_chat(PROMPT))
        pr, dr = await turn1(p, d)

        pp = pr["kv_transfer_params"]
        real_p = captured("chat_turn1.json")["p1"]["kv_transfer_params"]
        assert set(pp) == set(real_p) | ({GUARD_KEY} if connector else set())
        assert pp["do_remote_prefill"] is True and pp["do_remote_decode"] is False
        assert pp["remote_num_tokens"] == n == pr["usage"]["prompt_tokens"]
        assert len(pp["remote_block_ids"][0]) == cdiv(n, BLOCK)
        assert (pp["remote_engine_id"], pp["remote_host"], pp["remote_port"]) == (
            p.engine_id, p.side_channel_host, p.side_channel_port)
        assert pp["remote_prefill_cached_tokens"] == 0
        assert pp["remote_blocks_expiry_time"] is None and pp["transfer_mode"] == "pull"
        assert parse_remote_blocks(pp).direction == "prefill_to_decode"

        rec = d.record(dr["id"])
        assert (rec.plan, rec.pulled_tokens, rec.pulled_from_engine) == ("pull", n, p.engine_id)
        assert rec.pulled_from_request == pp["remote_request_id"]
        assert rec.pulled_matches_prompt and not rec.wrong_reuse and not rec.read_freed_blocks
        assert p.held() == []  # D's read freed P's lease

        dp = dr["kv_transfer_params"]
        real_d = captured("chat_turn1.json")["d1"]["kv_transfer_params"]
        kvrelay_keys = {GUARD_KEY, FINGERPRINT_KEY, BLOCK_SIZE_KEY, RETENTION_MODE_KEY} \
            if connector else set()
        assert set(dp) == set(real_d) | kvrelay_keys
        if connector:
            assert pp[GUARD_KEY] == dp[GUARD_KEY] == GUARD_VERSION
            assert dp[BLOCK_SIZE_KEY] == BLOCK and dp[RETENTION_MODE_KEY] == "managed"
            held = parse_remote_blocks(dp).fingerprint
            assert held is not None and held.num_tokens == n + GEN - 1
            assert held == held_fingerprint(
                d.record(dr["id"]).prompt_token_ids, d.record(dr["id"]).output_token_ids,
                n + GEN - 1)
        assert dp["do_remote_decode"] is True and dp["do_remote_prefill"] is False
        assert dp["remote_num_tokens"] == n + GEN - 1  # measured on vLLM 0.32
        assert len(dp["remote_block_ids"][0]) == cdiv(n + GEN - 1, BLOCK)
        assert dp["remote_engine_id"] == d.engine_id
        assert dp["remote_blocks_expiry_time"] == clock() + CONFIG.decoder_kv_blocks_ttl
        assert [h.request_id for h in d.held()] == [dp["remote_request_id"]]
        # Same context -> D's first token is the one P sampled, as in the captured pair.
        assert d.record(dr["id"]).output_token_ids[0] == p.record(pr["id"]).output_token_ids[0]
        assert text_of(dr).startswith(text_of(pr)) and dr["usage"]["completion_tokens"] == GEN


async def test_turn2_pull_equals_recompute_and_frees_d_blocks() -> None:
    async with FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        dp = dr["kv_transfer_params"]
        messages = turn2_messages(dr)
        n2 = len(p.model.encode_chat(messages))

        p2 = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)
        rec = p.record(p2["id"])
        assert rec.plan == "pull" and rec.kv_role == "prefill"
        assert rec.pulled_tokens == min(dp["remote_num_tokens"], n2)
        assert (rec.pulled_from_engine, rec.pulled_from_request) == (
            d.engine_id, dp["remote_request_id"])
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert rec.computed_tokens == n2 - rec.pulled_tokens
        assert d.held() == []
        assert p2["kv_transfer_params"]["remote_prefill_cached_tokens"] == rec.pulled_tokens

        recomputed = await chat(p, messages, max_tokens=8)
        assert p.record(recomputed["id"]).plan == "none"
        assert text_of(p2) == text_of(recomputed)


async def test_second_read_of_consumed_params_reads_freed_blocks() -> None:
    async with FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        dp = dr["kv_transfer_params"]
        messages = turn2_messages(dr)
        first = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)
        assert not p.record(first["id"]).read_freed_blocks
        assert d.freed_reads == []

        again = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)
        rec = p.record(again["id"])
        assert rec.plan == "pull" and rec.read_freed_blocks
        # Nobody reused D's freed blocks yet: they still hold the same tokens.
        assert rec.pulled_matches_prompt and text_of(again) == text_of(first)
        (seen,) = d.freed_reads
        assert seen.request_id == dp["remote_request_id"]
        assert seen.reader_engine_id == p.engine_id
        assert d.metrics.nixl_notifications_after_expiry == 1


async def test_read_of_reallocated_freed_blocks_is_a_detectable_wrong_reuse() -> None:
    # Without prefix caching D reuses freed blocks first (LIFO), like vLLM's block pool.
    async with FakeCluster(
        1, 1, CONFIG, clock=ManualClock(), decode_prefix_caching=False
    ) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        dp = dr["kv_transfer_params"]
        messages = turn2_messages(dr)
        first = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)

        other = user("Completely different words fill these blocks now. " * 14)
        await chat(d, other, max_tokens=GEN)  # reallocates (and overwrites) the freed blocks

        again = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)
        rec = p.record(again["id"])
        assert rec.read_freed_blocks
        assert rec.pulled_source_token_ids != rec.expected_pulled_token_ids
        assert not rec.pulled_matches_prompt and rec.wrong_reuse
        assert text_of(again) != text_of(first)
        assert d.freed_reads[-1].contents != ()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_read_after_d_ttl_is_declined_and_recomputed_or_failed(policy: str) -> None:
    clock = ManualClock()
    config = replace(CONFIG, kv_load_failure_policy=policy)  # type: ignore[arg-type]
    async with FakeCluster(1, 1, config, clock=clock) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        dp = dr["kv_transfer_params"]
        messages = turn2_messages(dr)
        # vLLM's reader declines 5 s before D's deadline (safety margin); D still holds.
        clock.advance(config.decoder_kv_blocks_ttl - 4)
        assert len(d.held()) == 1
        if policy == "fail":
            body = await post(p, "/v1/chat/completions",
                              {"messages": messages, "max_tokens": 8, "kv_transfer_params": dp},
                              status=500)
            assert body["error"]["code"] == 500
            rec = p.records[-1]
            assert rec.finish_reason == "error"
        else:
            p2 = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)
            rec = p.record(p2["id"])
            assert rec.recomputed_after_failure and rec.pulled_tokens == 0
            assert text_of(p2) == text_of(await chat(p, messages, max_tokens=8))
        assert rec.load_failure == "expired"
        assert p.metrics.nixl_kv_expired_reqs == 1
        assert p.metrics.nixl_failed_transfers == 0

        clock.advance(5)  # D's TTL ends: it frees the blocks and counts the expiry
        assert d.held() == []
        assert d.metrics.nixl_kv_expired_reqs == 1


async def test_ttl_expiry_without_deadline_in_params_still_fails_cleanly() -> None:
    clock = ManualClock()
    async with FakeCluster(1, 1, CONFIG, clock=clock) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        dp = {**dr["kv_transfer_params"], "remote_blocks_expiry_time": None}
        clock.advance(CONFIG.decoder_kv_blocks_ttl + 1)
        p2 = await chat(p, turn2_messages(dr), max_tokens=4, kv_transfer_params=dp)
        rec = p.record(p2["id"])
        assert rec.load_failure == "expired" and rec.recomputed_after_failure
        assert not rec.read_freed_blocks


async def test_prefill_lease_expiry_fails_the_decode_read() -> None:
    clock = ManualClock()
    async with FakeCluster(1, 1, CONFIG, clock=clock) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert len(p.held()) == 1
        clock.advance(CONFIG.kv_lease_duration + 1)
        dr = await chat(d, PROMPT, max_tokens=GEN, kv_transfer_params=pr["kv_transfer_params"])
        rec = d.record(dr["id"])
        assert rec.load_failure == "expired" and rec.recomputed_after_failure
        assert rec.pulled_tokens == 0 and rec.computed_tokens == len(rec.prompt_token_ids)
        assert p.held() == [] and p.metrics.nixl_kv_expired_reqs == 1
        # The recompute gives the same text as a plain request on a fresh engine.
        plain = await chat(cluster.decode[0], PROMPT, max_tokens=GEN)
        assert text_of(dr) == text_of(plain)


@pytest.mark.parametrize("connector", [False, True])
async def test_below_recompute_threshold_recomputes_and_notifies_d(connector: bool) -> None:
    """Stock vLLM's scheduler skips a pull below ``kv_recompute_threshold``; kvrelay's guard
    on P decides it first (every token matched, too few) and sends vLLM zero tokens to load,
    which vLLM treats as a full local hit. Either way D is notified and frees its blocks."""
    config = replace(CONFIG if connector else STOCK, kv_recompute_threshold=100_000)
    async with FakeCluster(1, 1, config, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        messages = turn2_messages(dr)
        p2 = await chat(p, messages, max_tokens=8, kv_transfer_params=dr["kv_transfer_params"])
        rec = p.record(p2["id"])
        if connector:
            assert (rec.guard, rec.plan) == ("below_threshold", "local_hit")
            assert rec.verified_tokens == dr["kv_transfer_params"]["remote_num_tokens"]
            assert p2["kv_transfer_params"]["kvrelay_verified_tokens"] == rec.verified_tokens
        else:
            assert (rec.guard, rec.plan) == (None, "below_threshold")
        assert rec.pulled_tokens == 0
        assert rec.notified_engine == d.engine_id
        assert d.held() == []  # vLLM still notifies D, which frees its blocks
        assert p.metrics.external_kv_transfer == 0
        assert text_of(p2) == text_of(await chat(p, messages, max_tokens=8))


async def test_threshold_compares_remote_tokens_beyond_the_local_prefix_hit() -> None:
    # P with prefix caching: turn 1's prompt blocks are cached on P, so the pull is only
    # min(remote_num_tokens, prompt) - local hit; with 64 that is above the threshold.
    async with FakeCluster(
        1, 1, CONFIG, clock=ManualClock(), prefill_prefix_caching=True
    ) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        n = len(p.model.encode_chat(PROMPT))
        _, dr = await turn1(p, d)
        dp = dr["kv_transfer_params"]
        messages = turn2_messages(dr)
        p2 = await chat(p, messages, max_tokens=8, kv_transfer_params=dp)
        rec = p.record(p2["id"])
        hit = (n // BLOCK) * BLOCK
        assert rec.local_cache_hit_tokens == hit
        expected = dp["remote_num_tokens"] - hit
        assert expected >= CONFIG.kv_recompute_threshold
        assert rec.plan == "pull" and rec.pulled_tokens == expected
        assert rec.pulled_matches_prompt and not rec.wrong_reuse
        assert p2["kv_transfer_params"]["remote_prefill_cached_tokens"] == dp["remote_num_tokens"]


async def test_capped_remote_num_tokens_without_trimming_blocks_misaligns_like_vllm() -> None:
    """vLLM end-trims the remote block list to the local block count: lowering only
    ``remote_num_tokens`` across a block boundary makes P read the *last* blocks."""
    async with FakeCluster(1, 1, STOCK, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        blocks = parse_remote_blocks(dr["kv_transfer_params"])
        capped = replace_struct(blocks, num_tokens=blocks.num_tokens - 2 * BLOCK)
        assert cdiv(capped.num_tokens, BLOCK) < blocks.num_blocks
        p2 = await chat(p, turn2_messages(dr), max_tokens=8, kv_transfer_params=capped.to_json())
        rec = p.record(p2["id"])
        assert rec.plan == "pull" and rec.pulled_tokens == capped.num_tokens
        assert rec.pulled_block_ids == blocks.block_ids[0][-cdiv(capped.num_tokens, BLOCK):]
        assert rec.wrong_reuse and not rec.pulled_matches_prompt


async def test_kvrelay_guard_on_p_cuts_the_block_list_of_a_lowered_count() -> None:
    """The same misaligning params (count lowered, every block kept) with D's fingerprint: P's
    guard caps them itself (``RemoteBlocks.capped``, block list cut), so P reads D's *first*
    blocks and the reuse is correct."""
    async with FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        blocks = parse_remote_blocks(dr["kv_transfer_params"])
        assert blocks.fingerprint is not None
        lowered = replace_struct(blocks, num_tokens=blocks.num_tokens - 2 * BLOCK)
        messages = turn2_messages(dr)
        p2 = await chat(p, messages, max_tokens=8, kv_transfer_params=lowered.to_json())
        rec = p.record(p2["id"])
        assert (rec.guard, rec.plan) == ("pull", "pull")
        assert rec.verified_tokens == lowered.num_tokens == rec.pulled_tokens
        assert rec.pulled_block_ids == blocks.block_ids[0][: cdiv(lowered.num_tokens, BLOCK)]
        assert not rec.wrong_reuse and rec.pulled_matches_prompt
        assert text_of(p2) == text_of(await chat(p, messages, max_tokens=8))


async def test_capping_with_the_block_size_pulls_the_right_blocks() -> None:
    """``RemoteBlocks.capped(n, block_size)`` also cuts the block list, so P pairs its
    blocks with D's first blocks and the reuse is correct."""
    async with FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        blocks = parse_remote_blocks(dr["kv_transfer_params"])
        capped = blocks.capped(blocks.num_tokens - 2 * BLOCK, BLOCK)
        p2 = await chat(p, turn2_messages(dr), max_tokens=8, kv_transfer_params=capped.to_json())
        rec = p.record(p2["id"])
        assert rec.plan == "pull" and rec.pulled_tokens == capped.num_tokens
        assert rec.pulled_block_ids == blocks.block_ids[0][: cdiv(capped.num_tokens, BLOCK)]
        assert not rec.wrong_reuse and rec.pulled_matches_prompt


async def test_bidirectional_off_d_retains_nothing() -> None:
    config = replace(CONFIG, bidirectional_kv_xfer=False)
    async with FakeCluster(1, 1, config, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        _, dr = await turn1(p, d)
        assert dr["kv_transfer_params"] is None
        assert d.held() == [] and d.record(dr["id"]).plan == "pull"


def test_generated_tokens_are_answer_tokens_and_a_pure_function_of_context_and_seed() -> None:
    context = list(range(300))
    alphabet = (1000, 1001, 2500)
    out = generate_tokens(context, 64, 0, alphabet)
    assert out == generate_tokens(list(context), 64, 0, alphabet)
    assert set(out) == set(alphabet)
    assert generate_tokens(context, 64, 1, alphabet) != out
    assert generate_tokens([*context[:-1], 7], 64, 0, alphabet) != out
    assert generate_tokens(context, 8, 0, alphabet) == out[:8]


async def test_request_seed_changes_output_and_engines_agree() -> None:
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        a = await chat(p, PROMPT, max_tokens=12)
        b = await chat(d, PROMPT, max_tokens=12)
        c = await chat(d, PROMPT, max_tokens=12, seed=5)
        assert text_of(a) == text_of(b) != text_of(c)


async def test_two_decoders_reading_the_same_prefill_params() -> None:
    async with FakeCluster(1, 2, CONFIG, clock=ManualClock()) as cluster:
        p, d0, d1 = cluster.prefill[0], *cluster.decode
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        first = await chat(d0, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        second = await chat(d1, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        assert not d0.record(first["id"]).read_freed_blocks
        rec = d1.record(second["id"])
        assert rec.read_freed_blocks and rec.pulled_from_engine == p.engine_id
        assert [r.reader_engine_id for r in p.freed_reads] == [d1.engine_id]
