from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from msgspec.structs import replace

from kvrelay.core.conversation import (
    DEFAULT_DECODER_KV_BLOCKS_TTL_S,
    ConversationEntry,
    ConversationKey,
    conversation_tag,
    id_tag,
    new_entry,
    with_fingerprint,
)
from kvrelay.core.fingerprint import (
    fingerprint_tokens,
    held_fingerprint,
    verified_prefix_tokens,
)
from kvrelay.core.identity import scope_of
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


def entry(blocks: RemoteBlocks, **kw: object) -> ConversationEntry:
    args: dict[str, object] = {"decode_node_id": "d0", "now_s": 100.0, "turn": 1,
                               "conversation": "c0", "num_bytes": 8000}
    args.update(kw)
    return new_entry(blocks=blocks, **args)  # type: ignore[arg-type]


def test_key_requires_a_conversation_id() -> None:
    with pytest.raises(ValueError):
        ConversationKey("tenant", "")


TAG_KEY = bytes(range(32))


def test_key_hash_is_stable_short_scoped_and_keyed() -> None:
    key = ConversationKey("acme", "conv-1")
    tag = key.hashed(TAG_KEY)
    assert tag == ConversationKey("acme", "conv-1").hashed(TAG_KEY)
    assert len(tag) == 16
    assert "conv-1" not in tag
    assert tag != ConversationKey("other", "conv-1").hashed(TAG_KEY)
    assert ConversationKey("ab", "c").hashed(TAG_KEY) != ConversationKey("a", "bc").hashed(TAG_KEY)
    assert tag == id_tag(TAG_KEY, scope_of("acme", "conv-1"))
    assert tag != key.hashed(bytes(32))  # without the key, a guess cannot be confirmed
    with pytest.raises(ValueError):
        conversation_tag(b"short", b"conv-1")


def test_entry_from_real_decode_response_with_ds_fingerprint() -> None:
    prompt, generated = ids(2025, 1), ids(32, 2)
    blocks = decode_blocks()
    fingerprint = held_fingerprint(prompt, generated, blocks.num_tokens)
    made = entry(with_fingerprint(blocks, fingerprint))
    assert blocks.num_tokens == 2056 == len(prompt) + len(generated) - 1
    assert made.num_tokens == 2056
    assert made.decode_engine_id == "41372c68-38b0-4eb0-962c-ca9183ba49b5"
    assert made.decode_node_id == "d0"
    assert made.turn == 1
    assert made.created_at_s == 100.0
    assert made.expires_at_s == 100.0 + DEFAULT_DECODER_KV_BLOCKS_TTL_S - 10.0
    assert made.fingerprint == fingerprint_tokens((prompt + generated)[:2056])
    next_prompt = prompt + generated + ids(50, 3)
    assert verified_prefix_tokens(made.fingerprint, next_prompt) == 2056


def test_fingerprint_of_fewer_known_ids_covers_only_them() -> None:
    blocks = decode_blocks()
    fingerprint = held_fingerprint(ids(2025, 1), ids(10, 2), blocks.num_tokens)
    made = entry(with_fingerprint(blocks, fingerprint))
    assert made.num_tokens == 2035
    assert made.blocks.num_tokens == blocks.num_tokens


def test_tokens_per_byte_turns_request_bytes_into_estimates() -> None:
    blocks = with_fingerprint(decode_blocks(), fingerprint_tokens(ids(2056, 1)))
    assert entry(blocks, num_bytes=8224).tokens_per_byte() == 0.25
    assert entry(blocks, num_bytes=0).tokens_per_byte() == 0.25
    assert entry(blocks, num_bytes=4112).tokens_per_byte() == 0.5


def test_entry_ttl_and_margin() -> None:
    blocks = with_fingerprint(decode_blocks(), fingerprint_tokens(ids(2056, 1)))
    made = entry(blocks, now_s=50.0, turn=3, ttl_s=60.0, safety_margin_s=5.0)
    assert made.expires_at_s == 105.0
    assert made.turn == 3
    assert made.seconds_left(100.0) == 5.0
    assert not made.is_expired(104.999)
    assert made.is_expired(105.0)


@pytest.mark.parametrize(("ttl_s", "margin_s"), [(0.0, 0.0), (10.0, 10.0), (10.0, -1.0)])
def test_entry_rejects_bad_ttl(ttl_s: float, margin_s: float) -> None:
    blocks = with_fingerprint(decode_blocks(), fingerprint_tokens([1, 2]))
    with pytest.raises(ValueError):
        entry(blocks, ttl_s=ttl_s, safety_margin_s=margin_s)


def test_entry_needs_blocks_held_on_decode_with_a_fingerprint() -> None:
    with pytest.raises(ValueError):
        entry(with_fingerprint(prefill_blocks(), fingerprint_tokens(ids(100, 1))))
    with pytest.raises(ValueError):
        entry(decode_blocks())


def test_block_size_kept_only_when_consistent_with_the_blocks() -> None:
    blocks = with_fingerprint(decode_blocks(), fingerprint_tokens(ids(2056, 1)))
    assert entry(blocks, block_size=128).block_size == 128
    assert entry(blocks, block_size=16).block_size is None
    assert entry(blocks, block_size=None).block_size is None


def test_entry_invariants() -> None:
    fp = fingerprint_tokens(ids(100, 1))
    blocks = with_fingerprint(decode_blocks(), fp)
    ConversationEntry("d0", blocks, expires_at_s=1.0, created_at_s=0.0, turn=1,
                      conversation="c")
    with pytest.raises(ValueError):
        ConversationEntry("d0", blocks, expires_at_s=1.0, created_at_s=0.0, turn=0,
                          conversation="c")
    with pytest.raises(ValueError):
        with_fingerprint(replace(decode_blocks(), num_tokens=50), fp)
    with pytest.raises(ValueError):
        ConversationEntry("d0", replace(blocks, num_tokens=50), expires_at_s=1.0,
                          created_at_s=0.0, turn=1, conversation="c")
