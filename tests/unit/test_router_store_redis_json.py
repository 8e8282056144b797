"""The Redis store's explicit JSON form of a conversation entry: exact round trip, times moved
through the wall clock, no conversation content, malformed input refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvrelay.core.conversation import ConversationEntry, entry_from_decode
from kvrelay.core.params import RemoteBlocks, parse_remote_blocks
from kvrelay.router.store_redis import (
    EntryFormatError,
    entry_from_json,
    entry_identity,
    entry_to_json,
)

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"
BLOCKS = parse_remote_blocks(
    json.loads((DATA / "chat_turn1.json").read_text())["d1"]["kv_transfer_params"]
)


def entry(blocks: RemoteBlocks = BLOCKS, block_size: int | None = None) -> ConversationEntry:
    return entry_from_decode(decode_node_id="decode-0", blocks=blocks,
                             prompt_token_ids=list(range(1000, 1000 + blocks.num_tokens)),
                             generated_token_ids=[7] * 32, now_s=100.0, turn=3,
                             block_size=block_size)


@pytest.mark.parametrize("e", [
    entry(),
    entry(block_size=128),
    entry(replace(BLOCKS, prefill_cached_tokens=64, remote_expiry_perf_counter_s=None)),
    entry(replace(BLOCKS, block_ids=((1, 2, 3), (4, 5, 6)), num_tokens=40, tp_size=2), 16),
])
def test_round_trip_is_exact_with_a_constant_offset(e: ConversationEntry) -> None:
    text = entry_to_json(e, wall_offset_s=1.7e9)
    assert entry_from_json(text, wall_offset_s=1.7e9) == e
    assert entry_from_json(text.encode(), wall_offset_s=1.7e9) == e


def test_times_are_wall_clock_in_json_and_local_on_read() -> None:
    e = entry()
    doc = json.loads(entry_to_json(e, wall_offset_s=1000.0))
    assert doc["expires_wall_s"] == e.expires_at_s + 1000.0
    assert doc["created_wall_s"] == e.created_at_s + 1000.0
    # another process, whose router clock is 500 s behind this one's
    other = entry_from_json(json.dumps(doc), wall_offset_s=1500.0)
    assert other.expires_at_s == e.expires_at_s - 500.0
    assert other.seconds_left(100.0 - 500.0) == e.seconds_left(100.0)


def test_identity_ignores_times_only() -> None:
    e = entry()
    assert entry_identity(e) == entry_identity(replace(e, expires_at_s=1.0, created_at_s=0.5))
    assert entry_identity(e) != entry_identity(replace(e, turn=4))
    assert entry_identity(e) != entry_identity(replace(e, blocks=replace(BLOCKS, request_id="x")))


def test_no_token_ids_only_digests() -> None:
    text = entry_to_json(entry(), wall_offset_s=0.0)
    assert "1000,1001,1002" not in text.replace(" ", "")
    assert set(json.loads(text)["fingerprint"]) == {
        "num_tokens", "chunk_tokens", "chunk_digests", "tail_digest"}


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("blocks"),
    lambda d: d.update(v=99),
    lambda d: d.update(turn="3"),
    lambda d: d.update(turn=True),
    lambda d: d["blocks"].update(direction="prefill_to_decode"),
    lambda d: d["blocks"].update(block_ids=[["1"]]),
    lambda d: d["fingerprint"].update(chunk_digests="!!not base64!!"),
    lambda d: d["fingerprint"].update(num_tokens=5),
    lambda d: d.update(expires_wall_s=None),
])
def test_malformed_entries_are_refused(mutate: object) -> None:
    doc = json.loads(entry_to_json(entry(), wall_offset_s=0.0))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(EntryFormatError):
        entry_from_json(json.dumps(doc), wall_offset_s=0.0)
    with pytest.raises(EntryFormatError):
        entry_from_json("not json", wall_offset_s=0.0)
