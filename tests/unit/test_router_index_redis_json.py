"""The Redis index's JSON form of an entry: exact round trip, times moved through the wall
clock, no conversation content, malformed input refused."""

from __future__ import annotations

import json

import pytest
from msgspec.structs import replace

from kvrelay.core.conversation import ConversationEntry, new_entry, with_fingerprint
from kvrelay.core.fingerprint import fingerprint_tokens
from kvrelay.core.params import RemoteBlocks
from kvrelay.router.index_redis import (
    EntryFormatError,
    entry_from_json,
    entry_identity,
    entry_to_json,
)
from tests.unit.index_entries import BLOCKS


def entry(blocks: RemoteBlocks = BLOCKS, block_size: int | None = None) -> ConversationEntry:
    held = with_fingerprint(blocks, fingerprint_tokens(list(range(1000, 1000 +
                                                                  blocks.num_tokens))))
    return new_entry(decode_node_id="decode-0", blocks=held, now_s=100.0, turn=3,
                     conversation="0123456789abcdef", num_bytes=9000, block_size=block_size)


@pytest.mark.parametrize("e", [
    entry(),
    entry(block_size=128),
    entry(replace(BLOCKS, prefill_cached_tokens=64, remote_expiry_perf_counter_s=None)),
    entry(replace(BLOCKS, block_ids=((1, 2, 3), (4, 5, 6)), num_tokens=40, tp_size=2), 16),
    entry(replace(BLOCKS, block_size=128, guard_version=1,
                  vllm_extra=(("remote_registration_generation", "1"),))),
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
    assert entry_identity(e) != entry_identity(
        replace(e, blocks=replace(e.blocks, request_id="x")))


IDENTITY_BEFORE_RELEASE_AT_EXPIRY = "ea86a2a4eb356f5a73aae62006190559"
"""``entry_identity(entry())`` as computed before ``release_at_expiry`` existed."""


@pytest.mark.parametrize("flag", [False, True])
def test_release_at_expiry_round_trips(flag: bool) -> None:
    e = replace(entry(), release_at_expiry=flag)
    text = entry_to_json(e, wall_offset_s=1.7e9)
    back = entry_from_json(text, wall_offset_s=1.7e9)
    assert back == e and back.release_at_expiry is flag
    assert ("release_at_expiry" in json.loads(text)) is flag  # written only when set


@pytest.mark.parametrize("kind", ["user", "tool"])
def test_how_the_answer_ended_round_trips(kind: str) -> None:
    """``waits_for`` (how D's answer ended: a tool call, a reply) comes back as stored;
    written only when not the default, and not part of the identity."""
    e = replace(entry(), waits_for=kind)
    text = entry_to_json(e, wall_offset_s=1.7e9)
    back = entry_from_json(text, wall_offset_s=1.7e9)
    assert back == e and back.waits_for == kind
    assert ("waits_for" in json.loads(text)) is (kind == "tool")
    assert entry_identity(e) == IDENTITY_BEFORE_RELEASE_AT_EXPIRY


def test_an_unflagged_entry_keeps_its_json_and_identity() -> None:
    """Entries stored before the field existed read back unflagged, and an unflagged
    entry's JSON and identity are what they were; the flag is not part of the identity
    (the same D request stored again, flagged, replaces it)."""
    e = entry()
    doc = json.loads(entry_to_json(e, wall_offset_s=0.0))
    assert sorted(doc) == ["block_size", "conversation", "created_wall_s", "expires_wall_s",
                           "node", "num_bytes", "params", "turn", "v"]
    assert entry_identity(e) == IDENTITY_BEFORE_RELEASE_AT_EXPIRY
    assert entry_identity(replace(e, release_at_expiry=True)) == entry_identity(e)
    flagged = new_entry(decode_node_id="decode-0", blocks=e.blocks, now_s=100.0, turn=3,
                        conversation="0123456789abcdef", num_bytes=9000,
                        release_at_expiry=True)
    assert flagged == replace(e, release_at_expiry=True)


def test_no_token_ids_only_digests() -> None:
    text = entry_to_json(entry(), wall_offset_s=0.0)
    assert "1000,1001,1002" not in text.replace(" ", "")
    assert "kvrelay_fingerprint" in json.loads(text)["params"]


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("params"),
    lambda d: d.update(v=99),
    lambda d: d.update(turn="3"),
    lambda d: d.update(turn=True),
    lambda d: d["params"].update(do_remote_decode=False, do_remote_prefill=True),
    lambda d: d["params"].update(remote_block_ids=[["1"]]),
    lambda d: d["params"].update(kvrelay_fingerprint="!!not base64!!"),
    lambda d: d["params"].pop("kvrelay_fingerprint"),
    lambda d: d.update(expires_wall_s=None),
    lambda d: d.update(release_at_expiry=1),
    lambda d: d.update(release_at_expiry="true"),
    lambda d: d.update(waits_for="banana"),
    lambda d: d.update(waits_for=1),
])
def test_malformed_entries_are_refused(mutate: object) -> None:
    doc = json.loads(entry_to_json(entry(), wall_offset_s=0.0))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(EntryFormatError):
        entry_from_json(json.dumps(doc), wall_offset_s=0.0)
    with pytest.raises(EntryFormatError):
        entry_from_json("not json", wall_offset_s=0.0)


def test_the_turns_context_round_trips_and_tells_entries_apart() -> None:
    """``context`` (the turn's model, adapter, tools, template) comes back as stored; written
    only when known, so an entry without it keeps its JSON and identity; two entries of
    other contexts are different entries."""
    e = replace(entry(), context=bytes(range(16)))
    text = entry_to_json(e, wall_offset_s=1.7e9)
    assert json.loads(text)["context"] == bytes(range(16)).hex()
    assert entry_from_json(text, wall_offset_s=1.7e9) == e
    assert entry_identity(entry()) == IDENTITY_BEFORE_RELEASE_AT_EXPIRY
    assert entry_identity(e) != entry_identity(replace(e, context=bytes(16)))
    doc = json.loads(text)
    doc["context"] = "not hex"
    with pytest.raises(EntryFormatError):
        entry_from_json(json.dumps(doc), wall_offset_s=1.7e9)
