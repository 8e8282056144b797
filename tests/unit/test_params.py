"""kv_transfer_params parsed from real vLLM 0.32 responses captured on this machine."""

import json
from pathlib import Path

import pytest
from msgspec.structs import replace

from kvrelay.client.sse import line_chunks
from kvrelay.core.fingerprint import fingerprint_tokens
from kvrelay.core.params import (
    KVParamsError,
    kvrelay_keys,
    parse_optional_remote_blocks,
    parse_remote_blocks,
)

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_prefill_response_params():
    p1 = load("chat_turn1.json")["p1"]
    blocks = parse_remote_blocks(p1["kv_transfer_params"])
    assert blocks.direction == "prefill_to_decode"
    assert blocks.num_tokens == p1["usage"]["prompt_tokens"]
    assert blocks.num_blocks == -(-blocks.num_tokens // 128)
    assert blocks.to_json() == p1["kv_transfer_params"]


def test_decode_response_params_hold_prompt_plus_generated_minus_one():
    d1 = load("chat_turn1.json")["d1"]
    blocks = parse_remote_blocks(d1["kv_transfer_params"])
    assert blocks.direction == "decode_to_prefill"
    usage = d1["usage"]
    assert blocks.num_tokens == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert blocks.remote_expiry_perf_counter_s is not None
    sent = blocks.to_json()
    assert sent["do_remote_decode"] is True and sent["do_remote_prefill"] is False
    assert sent == d1["kv_transfer_params"]


def test_pull_response_reports_cached_tokens():
    p2 = load("chat_turn2_pull.json")["p2"]
    blocks = parse_remote_blocks(p2["kv_transfer_params"])
    assert blocks.prefill_cached_tokens == 2056


def test_completions_decode_params():
    d = load("completions.json")["d"]
    blocks = parse_remote_blocks(d["kv_transfer_params"])
    assert blocks.num_tokens == len(d["choices"][0]["prompt_token_ids"]) + len(
        d["choices"][0]["token_ids"]) - 1


def test_streamed_chunks_carry_no_params_on_vllm_032():
    chunks = list(line_chunks(load("chat_stream.json")["d_stream"]))
    assert chunks and not any("kv_transfer_params" in c for c in chunks)


def test_cap_and_host_rewrite():
    blocks = parse_remote_blocks(load("chat_turn1.json")["d1"]["kv_transfer_params"])
    capped = blocks.capped(1000, 128)
    assert capped.num_tokens == 1000
    assert capped.block_ids == (blocks.block_ids[0][:8],)
    assert blocks.capped(1024, 128).block_ids == (blocks.block_ids[0][:8],)
    assert blocks.capped(1025, 128).block_ids == (blocks.block_ids[0][:9],)
    assert blocks.capped(10**9, 128) == blocks
    assert blocks.capped(-5, 128).num_tokens == 0
    assert blocks.capped(blocks.num_tokens, None) == blocks
    with pytest.raises(ValueError, match="block size"):
        blocks.capped(1000, None)
    with pytest.raises(ValueError, match="fewer are held"):
        blocks.capped(blocks.num_tokens, 64)
    moved = blocks.with_host("10.0.0.7", 7000)
    assert (moved.host, moved.port) == ("10.0.0.7", 7000)


def test_release_params_name_the_turn_with_one_token_of_its_first_block():
    blocks = parse_remote_blocks(load("chat_turn1.json")["d1"]["kv_transfer_params"])
    fingerprinted = replace(blocks, fingerprint=fingerprint_tokens(list(range(64))))
    release = fingerprinted.for_release()
    assert release.block_ids == (blocks.block_ids[0][:1],) and release.num_tokens == 1
    assert release.fingerprint is None  # small however long the turn; P guards nothing
    assert (release.engine_id, release.request_id, release.host, release.port) == \
        (blocks.engine_id, blocks.request_id, blocks.host, blocks.port)  # D frees it all


@pytest.mark.parametrize("raw", [
    None, [], {"do_remote_decode": True},
    {"do_remote_decode": True, "do_remote_prefill": True},
    {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_engine_id": "e",
     "remote_request_id": "r", "remote_host": "h", "remote_port": "5600",
     "remote_num_tokens": 3},
    {"do_remote_decode": True, "remote_block_ids": [["x"]], "remote_engine_id": "e",
     "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "remote_num_tokens": 3},
])
def test_invalid_params_are_rejected(raw):
    with pytest.raises(KVParamsError):
        parse_remote_blocks(raw)


def test_optional_params():
    assert parse_optional_remote_blocks(None) is None
    assert parse_optional_remote_blocks({"do_remote_decode": True}) is None


def test_kvrelay_keys_added_to_vllm_params_parse_back_as_remote_blocks():
    """What kvrelay's connector adds to vLLM's params is what the router parses (and what
    ``RemoteBlocks.to_json`` writes)."""
    raw = load("chat_turn1.json")["d1"]["kv_transfer_params"]
    fingerprint = fingerprint_tokens(list(range(raw["remote_num_tokens"])))
    marked = {**raw, **kvrelay_keys(guard_version=1, fingerprint=fingerprint, block_size=128)}
    blocks = parse_remote_blocks(marked)
    assert (blocks.guard_version, blocks.fingerprint, blocks.block_size) == (1, fingerprint, 128)
    assert blocks.verified_tokens is None
    assert blocks.to_json() == {**blocks.to_vllm_json(), **kvrelay_keys(
        guard_version=1, fingerprint=fingerprint, block_size=128)}
    assert kvrelay_keys() == {}
    assert kvrelay_keys(guard_version=1, verified_tokens=0) == {
        "kvrelay_guard": 1, "kvrelay_verified_tokens": 0}


def test_d_says_how_it_keeps_a_turn_and_an_unknown_mode_reads_as_absent():
    raw = load("chat_turn1.json")["d1"]["kv_transfer_params"]
    for mode in ("managed", "stock"):
        blocks = parse_remote_blocks({**raw, **kvrelay_keys(guard_version=1, retention=mode)})
        assert blocks.retention == mode
        assert blocks.to_json()["kvrelay_retention"] == mode  # travels back to P unchanged
        assert "kvrelay_retention" not in blocks.to_vllm_json()
    assert parse_remote_blocks(raw).retention is None  # stock vLLM says nothing
    assert parse_remote_blocks({**raw, "kvrelay_retention": "later"}).retention is None
