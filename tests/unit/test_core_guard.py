"""core.guard: the exact prefix check P's connector and the router's fallback share."""

from __future__ import annotations

import random

from msgspec.structs import replace

from kvrelay.core.fingerprint import fingerprint_tokens
from kvrelay.core.guard import check_pull, guard_params
from kvrelay.core.params import RemoteBlocks, parse_remote_blocks

rng = random.Random(3)
HELD = [rng.randrange(0, 32_000) for _ in range(1000)]
BLOCKS = RemoteBlocks(
    direction="decode_to_prefill", block_ids=(tuple(range(100, 108)),), engine_id="d-engine",
    request_id="r1", host="127.0.0.1", port=5601, num_tokens=1000,
    remote_expiry_perf_counter_s=99.0, fingerprint=fingerprint_tokens(HELD), block_size=128,
)


def test_a_continuing_prompt_pulls_everything_held() -> None:
    check = check_pull(BLOCKS, [*HELD, 1, 2, 3], threshold=64)
    assert check.reason == "pull" and check.verified_tokens == 1000
    assert check.usable_tokens == 1000 and check.blocks == BLOCKS


def test_a_divergence_cuts_the_pull_and_the_block_list() -> None:
    prompt = HELD[:500] + [0] * 600
    check = check_pull(BLOCKS, prompt, threshold=64)
    assert check.reason == "pull" and check.usable_tokens == 496
    assert check.blocks is not None and check.blocks.num_tokens == 496
    assert check.blocks.block_ids == (tuple(range(100, 104)),)


def test_too_little_is_never_pulled() -> None:
    assert check_pull(BLOCKS, [0, *HELD[1:]], threshold=64).reason == "prefix_mismatch"
    assert check_pull(BLOCKS, HELD[:50], threshold=64).reason == "below_threshold"
    assert check_pull(replace(BLOCKS, fingerprint=None), HELD, threshold=1).reason == \
        "no_fingerprint"


def test_partial_reuse_needs_a_block_size() -> None:
    unknown = replace(BLOCKS, block_size=None)
    assert check_pull(unknown, HELD[:500] + [0] * 10, threshold=1).reason == \
        "partial_reuse_unsafe"
    assert check_pull(unknown, HELD[:500] + [0] * 10, threshold=1, block_size=128).reason == \
        "pull"
    assert check_pull(unknown, [*HELD, 1], threshold=1).reason == "pull"


def test_the_prompt_keeps_its_last_token() -> None:
    check = check_pull(BLOCKS, HELD, threshold=64)
    assert check.usable_tokens == 999


def test_guard_params_rewrites_what_p_loads() -> None:
    raw = BLOCKS.to_json()
    out, check = guard_params(raw, HELD[:500] + [7] * 20, threshold=64, block_size=128)
    assert check.reason == "pull"
    loaded = parse_remote_blocks(out)
    assert loaded.num_tokens == 496 and loaded.block_ids == ((100, 101, 102, 103),)
    assert loaded.fingerprint is None and out["kvrelay_verified_tokens"] == 496
    again, second = guard_params(out, HELD[:500] + [7] * 20, threshold=64, block_size=128)
    assert second.reason == "no_fingerprint" and again == out  # idempotent


def test_guard_params_loads_nothing_but_keeps_the_blocks_to_free_them() -> None:
    out, check = guard_params(BLOCKS.to_json(), [0] * 1000, threshold=64, block_size=128)
    assert check.reason == "prefix_mismatch"
    assert out["remote_num_tokens"] == 0 and out["remote_block_ids"] == [list(range(100, 108))]
    assert out["kvrelay_verified_tokens"] == 0


def test_params_without_a_fingerprint_are_stock_vllm_behaviour() -> None:
    raw = replace(BLOCKS, fingerprint=None).to_json()
    out, check = guard_params(raw, [0] * 1000, threshold=64, block_size=128)
    assert check.reason == "no_fingerprint" and out == raw
    recompute, _ = guard_params({"do_remote_decode": True}, HELD, threshold=64, block_size=128)
    assert recompute == {"do_remote_decode": True}
