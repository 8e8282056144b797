from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.core.fingerprint import (
    DEFAULT_CHUNK_TOKENS,
    FingerprintError,
    TokenFingerprint,
    fingerprint_tokens,
    verifiable_tokens,
    verified_prefix_tokens,
)

CHUNK = DEFAULT_CHUNK_TOKENS


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_verified(held: list[int], new: list[int]) -> int:
    common = common_prefix(held, new)
    return len(held) if common >= len(held) else common // CHUNK * CHUNK


def test_identical_tokens_verify_fully() -> None:
    held = tokens(1000)
    fp = fingerprint_tokens(held)
    assert fp.num_tokens == 1000
    assert verified_prefix_tokens(fp, held) == 1000
    assert verified_prefix_tokens(fp, [*held, 1, 2, 3]) == 1000


def test_exact_chunk_multiple_has_no_tail() -> None:
    held = tokens(64)
    fp = fingerprint_tokens(held)
    assert fp.tail_digest == b""
    assert verified_prefix_tokens(fp, [*held, 7]) == 64


def test_mismatch_in_a_chunk_stops_at_its_start() -> None:
    held = tokens(100)
    new = list(held)
    new[37] += 1
    assert verified_prefix_tokens(fingerprint_tokens(held), new) == 32


def test_first_token_changed_verifies_nothing() -> None:
    held = tokens(100)
    new = [held[0] + 1, *held[1:]]
    assert verified_prefix_tokens(fingerprint_tokens(held), new) == 0


def test_tail_counts_only_when_exact() -> None:
    held = tokens(40)
    fp = fingerprint_tokens(held)
    changed_tail = [*held[:39], held[39] + 1, 5]
    assert verified_prefix_tokens(fp, changed_tail) == 32
    assert verified_prefix_tokens(fp, held[:39]) == 32


def test_shorter_prompt_verifies_whole_chunks_only() -> None:
    held = tokens(100)
    fp = fingerprint_tokens(held)
    assert verified_prefix_tokens(fp, held[:50]) == 48
    assert verified_prefix_tokens(fp, []) == 0


def test_empty_fingerprint() -> None:
    fp = fingerprint_tokens([])
    assert fp.num_tokens == 0
    assert verified_prefix_tokens(fp, tokens(10)) == 0
    assert TokenFingerprint.from_bytes(fp.to_bytes()) == fp


def test_chunk_order_matters() -> None:
    a, b = tokens(16, seed=1), tokens(16, seed=2)
    fp = fingerprint_tokens(a + b)
    assert verified_prefix_tokens(fp, b + a) == 0


def test_out_of_range_token_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="int32"):
        fingerprint_tokens([1, 2**31])


def test_verifiable_tokens() -> None:
    fp = fingerprint_tokens(tokens(100))
    assert verifiable_tokens(fp, 1000) == 100
    assert verifiable_tokens(fp, 100) == 100
    assert verifiable_tokens(fp, 99) == 96
    assert verifiable_tokens(fp, 15) == 0
    assert verifiable_tokens(fp, -1) == 0


def test_round_trips_through_bytes_and_json_text() -> None:
    fp = fingerprint_tokens(tokens(1234))
    assert TokenFingerprint.from_bytes(fp.to_bytes()) == fp
    text = fp.to_str()
    assert json.loads(json.dumps(text)) == text
    assert '"' not in text and "\\" not in text
    assert TokenFingerprint.from_str(text) == fp


def test_custom_chunk_size_round_trips() -> None:
    held = tokens(100)
    fp = fingerprint_tokens(held, chunk_tokens=32)
    back = TokenFingerprint.from_bytes(fp.to_bytes())
    assert back.chunk_tokens == 32
    assert verified_prefix_tokens(back, [*held[:70], -1]) == 64


@pytest.mark.parametrize(
    "data",
    [b"", b"XX", b"KF\x01", b"KF\x02" + bytes(6), fingerprint_tokens(tokens(40)).to_bytes()[:-1]],
)
def test_malformed_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(FingerprintError):
        TokenFingerprint.from_bytes(data)


def test_zero_chunk_size_bytes_are_rejected() -> None:
    with pytest.raises(FingerprintError):
        TokenFingerprint.from_bytes(b"KF\x01" + bytes(6))


@pytest.mark.parametrize("text", ['not base64 "', "é", "abc"])
def test_malformed_text_is_rejected(text: str) -> None:
    with pytest.raises(FingerprintError):
        TokenFingerprint.from_str(text)


def test_inconsistent_fields_are_rejected() -> None:
    with pytest.raises(ValueError):
        TokenFingerprint(num_tokens=32, chunk_tokens=16, chunk_digests=b"", tail_digest=b"")
    with pytest.raises(ValueError):
        TokenFingerprint(num_tokens=0, chunk_tokens=0, chunk_digests=b"", tail_digest=b"")


def test_size_budget_for_a_24k_token_context() -> None:
    held = tokens(24 * 1024)
    fp = fingerprint_tokens(held)
    assert len(fp.to_bytes()) <= 16 * 1024
    # base64 (C codec: it runs on every report and pull) is 4/3 of the bytes
    assert len(fp.to_str().encode("ascii")) <= 17 * 1024


def test_repr_does_not_dump_digests() -> None:
    assert len(repr(fingerprint_tokens(tokens(5000)))) < 200


def test_does_not_store_token_ids() -> None:
    held = [123_456_789] * 64
    blob = fingerprint_tokens(held).to_bytes()
    assert (123_456_789).to_bytes(4, "little") not in blob


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(st.integers(0, 3), max_size=120),
    new=st.lists(st.integers(0, 3), max_size=120),
    shared=st.integers(0, 120),
)
def test_verified_prefix_matches_true_common_prefix(
    held: list[int], new: list[int], shared: int
) -> None:
    new = held[:shared] + new
    verified = verified_prefix_tokens(fingerprint_tokens(held), new)
    assert verified <= common_prefix(held, new)
    assert verified <= len(held)
    assert verified == expected_verified(held, new)


@settings(max_examples=100, deadline=None)
@given(held=st.lists(st.integers(0, 2**31 - 1), max_size=80))
def test_serialization_round_trip_property(held: list[int]) -> None:
    fp = fingerprint_tokens(held)
    assert TokenFingerprint.from_str(fp.to_str()) == fp
    assert verified_prefix_tokens(TokenFingerprint.from_bytes(fp.to_bytes()), held) == len(held)
