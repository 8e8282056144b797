from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvrelay.core.conversation import (
    DEFAULT_DECODER_KV_BLOCKS_TTL_S,
    ConversationEntry,
    ConversationKey,
    entry_from_decode,
)
from kvrelay.core.fingerprint import fingerprint_tokens, verified_prefix_tokens
from kvrelay.core.params import RemoteBlocks, parse_remote_blocks

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"


def decode_blocks() -> RemoteBlocks:
    """D's retained blocks after turn 1: prompt 2025 + 32 generated, 2056 tokens with KV."""
    raw = json.loads((DATA / "chat_turn1.json").read_text())["d1"]["kv_transfer_params"]
    return parse_remote_blocks(raw)


def prefill_blocks() -> RemoteBlocks:
    raw = json.loads((DATA / "chat_turn1.json").read_text())["p1"]["kv_transfer_params"]
    return parse_remote_blocks(raw)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 32_000) for _ in range(n)]


def test_key_requires_a_conversation_id() -> None:
    with pytest.raises(ValueError):
        ConversationKey("tenant", "")


def test_key_hash_is_stable_short_and_scoped() -> None:
    key = ConversationKey("acme", "conv-1")
    assert key.hashed() == ConversationKey("acme", "conv-1").hashed()
    assert len(key.hashed()) == 16
    assert "conv-1" not in key.hashed()
    assert key.hashed() != ConversationKey("other", "conv-1").hashed()
    assert ConversationKey("ab", "c").hashed() != ConversationKey("a", "bc").hashed()


def test_entry_from_real_decode_response() -> None:
    blocks = decode_blocks()
    prompt, generated = ids(2025, 1), ids(32, 2)
    entry = entry_from_decode(
        decode_node_id="d0",
        blocks=blocks,
        prompt_token_ids=prompt,
        generated_token_ids=generated,
        now_s=100.0,
    )
    assert blocks.num_tokens == 2056 == len(prompt) + len(generated) - 1
    assert entry.num_tokens == 2056
    assert entry.decode_engine_id == "41372c68-38b0-4eb0-962c-ca9183ba49b5"
    assert entry.decode_node_id == "d0"
    assert entry.turn == 1
    assert entry.created_at_s == 100.0
    assert entry.expires_at_s == 100.0 + DEFAULT_DECODER_KV_BLOCKS_TTL_S - 10.0
    assert entry.fingerprint == fingerprint_tokens((prompt + generated)[:2056])
    next_prompt = prompt + generated + ids(50, 3)
    assert verified_prefix_tokens(entry.fingerprint, next_prompt) == 2056


def test_entry_caps_num_tokens_to_known_ids() -> None:
    blocks = decode_blocks()
    prompt, generated = ids(2025, 1), ids(10, 2)
    entry = entry_from_decode(
        decode_node_id="d0",
        blocks=blocks,
        prompt_token_ids=prompt,
        generated_token_ids=generated,
        now_s=0.0,
    )
    assert entry.num_tokens == 2035
    assert entry.blocks == blocks


def test_entry_ttl_and_margin() -> None:
    entry = entry_from_decode(
        decode_node_id="d0",
        blocks=decode_blocks(),
        prompt_token_ids=ids(2025, 1),
        generated_token_ids=ids(32, 2),
        now_s=50.0,
        turn=3,
        ttl_s=60.0,
        safety_margin_s=5.0,
    )
    assert entry.expires_at_s == 105.0
    assert entry.turn == 3
    assert entry.seconds_left(100.0) == 5.0
    assert not entry.is_expired(104.999)
    assert entry.is_expired(105.0)


@pytest.mark.parametrize(("ttl_s", "margin_s"), [(0.0, 0.0), (10.0, 10.0), (10.0, -1.0)])
def test_entry_rejects_bad_ttl(ttl_s: float, margin_s: float) -> None:
    with pytest.raises(ValueError):
        entry_from_decode(
            decode_node_id="d0",
            blocks=decode_blocks(),
            prompt_token_ids=[1],
            generated_token_ids=[2],
            now_s=0.0,
            ttl_s=ttl_s,
            safety_margin_s=margin_s,
        )


def test_entry_needs_blocks_held_on_decode() -> None:
    with pytest.raises(ValueError):
        entry_from_decode(
            decode_node_id="p0",
            blocks=prefill_blocks(),
            prompt_token_ids=ids(2025, 1),
            generated_token_ids=[],
            now_s=0.0,
        )


def test_entry_invariants() -> None:
    blocks = decode_blocks()
    fp = fingerprint_tokens(ids(100, 1))
    ConversationEntry("d0", blocks, fp, expires_at_s=1.0, created_at_s=0.0, turn=1)
    with pytest.raises(ValueError):
        ConversationEntry("d0", blocks, fp, expires_at_s=1.0, created_at_s=0.0, turn=0)
    with pytest.raises(ValueError):
        ConversationEntry(
            "d0", replace(blocks, num_tokens=50), fp, expires_at_s=1.0, created_at_s=0.0, turn=1
        )
