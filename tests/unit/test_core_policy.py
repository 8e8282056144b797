"""The turn policy: exact mode (the router holds the prompt's ids: ``/tokenize`` fallback)
and estimate mode (kvrelay's connector on P proves the tokens)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from kvrelay.core.conversation import ConversationEntry, new_entry, with_fingerprint
from kvrelay.core.costs import CostEstimates, CostLine, CostLines
from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.params import RemoteBlocks, parse_remote_blocks
from kvrelay.core.policy import PolicyConfig, Prompt, TurnDecision, decide_turn
from kvrelay.core.selection import NodeState

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"
CONFIG = PolicyConfig()
COSTS = CostEstimates()
CREATED_S = 1000.0
EXPIRES_S = CREATED_S + 480.0 - 10.0

rng = random.Random(7)
PROMPT = [rng.randrange(0, 32_000) for _ in range(2025)]
GENERATED = [rng.randrange(0, 32_000) for _ in range(32)]
NEW_USER = [rng.randrange(0, 32_000) for _ in range(300)]
HELD = (PROMPT + GENERATED)[:2056]


def decode_blocks() -> RemoteBlocks:
    raw = json.loads((DATA / "chat_turn1.json").read_text())["d1"]["kv_transfer_params"]
    return parse_remote_blocks(raw)


BLOCKS = decode_blocks()
ENGINE = BLOCKS.engine_id


BLOCK_SIZE = 128  # vLLM's CPU block size: the captured params hold cdiv(2056, 128) blocks


def make_entry(
    prompt: list[int] = PROMPT,
    generated: list[int] = GENERATED,
    blocks: RemoteBlocks = BLOCKS,
    block_size: int | None = BLOCK_SIZE,
) -> ConversationEntry:
    fingerprint = held_fingerprint(prompt, generated, blocks.num_tokens)
    return new_entry(
        decode_node_id="d0",
        blocks=with_fingerprint(blocks, fingerprint),
        now_s=CREATED_S,
        turn=1,
        conversation="c0",
        num_bytes=4 * blocks.num_tokens,
        block_size=block_size,
    )


ENTRY = make_entry()


def d0(up: bool = True, engine_id: str | None = ENGINE,
       max_model_len: int | None = None) -> NodeState:
    return NodeState("d0", "decode", "http://d0", up=up, engine_id=engine_id,
                     max_model_len=max_model_len)


def decide(
    prompt: list[int],
    *,
    entry: ConversationEntry | None = ENTRY,
    now_s: float = CREATED_S + 5.0,
    node: NodeState | None = None,
    config: PolicyConfig = CONFIG,
    costs: CostEstimates = COSTS,
    max_output_tokens: int | None = None,
) -> TurnDecision:
    """Exact mode: the router knows the prompt's ids."""
    return decide_turn(
        entry=entry,
        prompt=Prompt(len(prompt), token_ids=prompt),
        now_s=now_s,
        decode_node=d0() if node is None else node,
        config=config,
        costs=costs,
        max_output_tokens=max_output_tokens,
    )


def next_turn_prompt() -> list[int]:
    return PROMPT + GENERATED + NEW_USER


def assert_recompute(decision: TurnDecision, reason: str) -> None:
    assert decision.action == "recompute"
    assert decision.reason == reason
    assert decision.reused_tokens == 0
    assert decision.blocks_to_send is None
    assert not decision.consumes_entry


def assert_pull(decision: TurnDecision, verified: int) -> RemoteBlocks:
    assert decision.action == "pull"
    assert decision.reason == "pull"
    assert decision.verified_tokens == verified
    assert decision.reused_tokens == verified
    assert decision.consumes_entry
    sent = decision.blocks_to_send
    assert sent is not None
    assert sent.num_tokens == verified
    assert sent.to_json()["remote_num_tokens"] == verified
    keep = -(-verified // BLOCK_SIZE)
    assert sent.block_ids == tuple(group[:keep] for group in BLOCKS.block_ids)
    assert replace(sent, num_tokens=BLOCKS.num_tokens, block_ids=BLOCKS.block_ids,
                   fingerprint=None) == BLOCKS
    assert decision.exact
    return sent


def test_next_turn_pulls_everything_d_holds() -> None:
    decision = decide(next_turn_prompt())
    sent = assert_pull(decision, 2056)
    assert sent.to_json()["do_remote_decode"] is True
    assert 0 < decision.predicted_transfer_s < decision.predicted_prefill_s


def test_tool_messages_appended_still_pull_all() -> None:
    tool_rng = random.Random(11)
    tool_result = [tool_rng.randrange(0, 32_000) for _ in range(900)]
    assert_pull(decide(PROMPT + GENERATED + tool_result), 2056)


def test_changed_last_assistant_message_caps_pull_at_verified_prefix() -> None:
    rewritten = [t + 1 for t in GENERATED]
    decision = decide(PROMPT + rewritten + NEW_USER)
    assert_pull(decision, 2025 // 16 * 16)


def test_unknown_block_size_allows_only_whole_reuse() -> None:
    entry = make_entry(block_size=None)
    assert_pull(decide(next_turn_prompt(), entry=entry), 2056)
    rewritten = [t + 1 for t in GENERATED]
    decision = decide(PROMPT + rewritten + NEW_USER, entry=entry)
    assert_recompute(decision, "partial_reuse_unsafe")


def test_block_size_inconsistent_with_held_blocks_is_ignored() -> None:
    assert make_entry(block_size=16).block_size is None
    assert make_entry(block_size=BLOCK_SIZE).block_size == BLOCK_SIZE


def test_regenerated_turn_keeps_the_last_prompt_token_for_p() -> None:
    """The same prompt again (a retry): everything matches, but P must compute at least
    the last prompt token, so at most len(prompt) - 1 tokens are pulled."""
    decision = decide(PROMPT)
    assert_pull(decision, 2016)
    assert decision.blocks_to_send is not None
    assert decision.blocks_to_send.num_tokens <= len(PROMPT) - 1


def test_edit_late_in_history_pulls_only_the_prefix_before_it() -> None:
    prompt = next_turn_prompt()
    prompt[1000] += 1
    assert_pull(decide(prompt), 992)


@pytest.mark.parametrize("edited_at", [0, 15, 40, 63])
def test_edited_early_message_is_prefix_mismatch(edited_at: int) -> None:
    prompt = next_turn_prompt()
    prompt[edited_at] += 1
    decision = decide(prompt)
    assert_recompute(decision, "prefix_mismatch")
    assert decision.verified_tokens == edited_at // 16 * 16


def test_short_held_context_is_below_threshold() -> None:
    entry = make_entry(PROMPT[:30], GENERATED[:11], replace(BLOCKS, num_tokens=40),
                       block_size=None)
    decision = decide(PROMPT[:30] + GENERATED[:11] + NEW_USER, entry=entry)
    assert_recompute(decision, "below_threshold")
    assert decision.verified_tokens == 40


def test_short_prompt_that_matches_is_below_threshold() -> None:
    assert_recompute(decide(PROMPT[:50]), "below_threshold")
    assert_recompute(decide([]), "below_threshold")


def test_threshold_zero_never_pulls_zero_tokens() -> None:
    prompt = next_turn_prompt()
    prompt[0] += 1
    config = PolicyConfig(kv_recompute_threshold=0)
    assert_recompute(decide(prompt, config=config), "prefix_mismatch")


def test_threshold_boundary() -> None:
    prompt = next_turn_prompt()
    prompt[64] += 1
    assert_pull(decide(prompt), 64)
    assert_recompute(
        decide(prompt, config=PolicyConfig(kv_recompute_threshold=65)), "prefix_mismatch"
    )


def test_no_entry() -> None:
    assert_recompute(decide(next_turn_prompt(), entry=None), "no_entry")


def test_a_released_entry_is_never_pulled() -> None:
    """D freed the blocks (its sync said so): recompute, whatever else holds; a turn whose
    own retention time ran out on D reads ``expired``, as when the router's clock says so."""
    for cause in ("pressure", "headroom", "router"):
        released = replace(ENTRY, released=cause)
        assert_recompute(decide(next_turn_prompt(), entry=released), "released")
    assert_recompute(decide(next_turn_prompt(), entry=replace(ENTRY, released="expired")),
                     "expired")
    assert_recompute(decide(next_turn_prompt(), entry=replace(ENTRY, released="pressure"),
                            now_s=EXPIRES_S), "expired")
    assert_pull(decide(next_turn_prompt(), entry=ENTRY), 2056)


def test_expiry_boundary() -> None:
    assert_recompute(decide(next_turn_prompt(), now_s=EXPIRES_S), "expired")
    assert_recompute(decide(next_turn_prompt(), now_s=EXPIRES_S + 100), "expired")
    assert_recompute(decide(next_turn_prompt(), now_s=EXPIRES_S - 0.5), "near_expiry")


def test_near_expiry_boundary() -> None:
    assert_recompute(decide(next_turn_prompt(), now_s=EXPIRES_S - 14.5), "near_expiry")
    assert_pull(decide(next_turn_prompt(), now_s=EXPIRES_S - 15.0), 2056)
    no_margin = PolicyConfig(near_expiry_s=0.0)
    assert_pull(decide(next_turn_prompt(), now_s=EXPIRES_S - 0.001, config=no_margin), 2056)


def test_node_down() -> None:
    assert_recompute(decide(next_turn_prompt(), node=d0(up=False)), "node_down")


def test_unknown_node_counts_as_down() -> None:
    decision = decide_turn(
        entry=ENTRY,
        prompt=Prompt(len(next_turn_prompt()), token_ids=next_turn_prompt()),
        now_s=CREATED_S,
        decode_node=None,
        config=CONFIG,
        costs=COSTS,
    )
    assert_recompute(decision, "node_down")


def test_engine_restarted() -> None:
    assert_recompute(decide(next_turn_prompt(), node=d0(engine_id="new-uuid")), "engine_restarted")


def test_another_rank_of_a_data_parallel_d_is_not_a_restart() -> None:
    """D answered last from another rank (``<group>_dp<k>``): the entry's rank still holds
    the blocks, and P pulls from the rank the entry names. Another group is a restart."""
    ranked = make_entry(blocks=replace(BLOCKS, engine_id="g-1_dp0"))
    decision = decide(next_turn_prompt(), entry=ranked, node=d0(engine_id="g-1_dp3"))
    assert (decision.action, decision.reason, decision.reused_tokens) == ("pull", "pull", 2056)
    assert decision.blocks_to_send is not None
    assert decision.blocks_to_send.engine_id == "g-1_dp0"  # the rank that holds them
    assert_recompute(decide(next_turn_prompt(), entry=ranked, node=d0(engine_id="g-2_dp0")),
                     "engine_restarted")


def test_unknown_current_engine_is_not_a_restart() -> None:
    assert_pull(decide(next_turn_prompt(), node=d0(engine_id=None)), 2056)


def test_wrong_decode_node_is_a_caller_bug() -> None:
    other = NodeState("d1", "decode", "http://d1", engine_id=ENGINE)
    with pytest.raises(ValueError):
        decide(next_turn_prompt(), node=other)


def test_checks_run_in_documented_order() -> None:
    diverged = next_turn_prompt()
    diverged[0] += 1
    down = d0(up=False, engine_id="other")
    assert decide(diverged, entry=None).reason == "no_entry"
    assert decide(diverged, now_s=EXPIRES_S, node=down).reason == "expired"
    assert decide(diverged, now_s=EXPIRES_S - 1, node=down).reason == "near_expiry"
    assert decide(diverged, node=down).reason == "node_down"
    assert decide(diverged, node=d0(engine_id="other")).reason == "engine_restarted"
    short = d0(max_model_len=len(diverged))
    assert decide(diverged, node=short).reason == "too_long"
    assert decide(diverged).reason == "prefix_mismatch"


def huge_transfer_costs() -> CostEstimates:
    return CostEstimates.from_lines(CostLines(pull=CostLine(5.0, 2e-5)))


CHEAP_RECOMPUTE = CostLines(prefill=CostLine(0.1, 1e-6), pull=CostLine(0.05, 1e-4))
"""Injected costs where recomputing the prefix is cheaper than pulling it..."""
CHEAP_PULL = CostLines(prefill=CostLine(0.0, 1e-3), pull=CostLine(0.05, 1e-6))
"""...and the opposite: the same turn must go each way, by the costs alone."""


@pytest.mark.parametrize(("lines", "action", "reason"), [
    (CHEAP_RECOMPUTE, "recompute", "cost_model"),
    (CHEAP_PULL, "pull", "pull"),
])
def test_the_cost_model_follows_the_costs_both_ways(
    lines: CostLines, action: str, reason: str
) -> None:
    decision = decide(next_turn_prompt(), costs=CostEstimates.from_lines(lines))
    assert (decision.action, decision.reason) == (action, reason)
    costs = CostEstimates.from_lines(lines)
    usable = min(decision.verified_tokens, len(next_turn_prompt()) - 1)
    assert decision.predicted_transfer_s == pytest.approx(costs.pull_s(usable))
    assert decision.predicted_prefill_s == pytest.approx(costs.prefill_s(usable))
    assert (decision.predicted_transfer_s > decision.predicted_prefill_s) == (
        action == "recompute")
    est = decide_turn(entry=ENTRY, prompt=Prompt(len(next_turn_prompt()), est_new_tokens=40),
                      now_s=CREATED_S + 5.0, decode_node=d0(), config=CONFIG, costs=costs)
    assert (est.action, est.reason) == (action, reason)  # estimate mode alike


def test_cost_model_recomputes_tiny_reuse_with_huge_transfer_cost() -> None:
    prompt = next_turn_prompt()
    prompt[100] += 1
    decision = decide(prompt, costs=huge_transfer_costs())
    assert_recompute(decision, "cost_model")
    assert decision.verified_tokens == 96
    assert decision.predicted_transfer_s > decision.predicted_prefill_s


def test_cost_factor_biases_towards_recompute() -> None:
    decision = decide(next_turn_prompt(), config=PolicyConfig(pull_cost_factor=1000.0))
    assert_recompute(decision, "cost_model")


def test_direct_when_enabled_and_suffix_small() -> None:
    config = PolicyConfig(direct_enabled=True, direct_max_new_tokens=64)
    suffix = NEW_USER[:40]
    decision = decide(PROMPT + GENERATED + suffix, config=config)
    assert decision.action == "direct"
    assert decision.reason == "direct"
    assert decision.verified_tokens == 2056
    assert decision.reused_tokens == 2056
    assert decision.blocks_to_send is None
    assert not decision.consumes_entry


def test_direct_suffix_boundary_and_disabled() -> None:
    config = PolicyConfig(direct_enabled=True, direct_max_new_tokens=64)
    at_limit = HELD + NEW_USER[:64]
    assert decide(at_limit, config=config).action == "direct"
    assert_pull(decide(HELD + NEW_USER[:65], config=config), 2056)
    assert_pull(decide(HELD + NEW_USER[:10]), 2056)


def test_direct_needs_a_verified_prefix() -> None:
    config = PolicyConfig(direct_enabled=True, direct_max_new_tokens=10_000)
    prompt = next_turn_prompt()
    prompt[3] += 1
    assert_recompute(decide(prompt, config=config), "prefix_mismatch")


def test_early_exits_have_no_predictions() -> None:
    decision = decide(next_turn_prompt(), entry=None)
    assert decision.verified_tokens == 0
    assert decision.predicted_transfer_s == decision.predicted_prefill_s == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_recompute_threshold": -1},
        {"near_expiry_s": -1.0},
        {"direct_max_new_tokens": -1},
        {"pull_cost_factor": 0.0},
    ],
)
def test_policy_config_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    keep=st.integers(0, 2100),
    suffix=st.lists(st.integers(0, 40_000), max_size=200),
    threshold=st.integers(0, 300),
)
def test_never_sends_more_than_the_true_common_prefix(
    keep: int, suffix: list[int], threshold: int
) -> None:
    prompt = HELD[:keep] + suffix
    common = 0
    for a, b in zip(HELD, prompt, strict=False):
        if a != b:
            break
        common += 1
    decision = decide(prompt, config=PolicyConfig(kv_recompute_threshold=threshold))
    assert decision.verified_tokens <= common
    if decision.action == "pull":
        assert decision.blocks_to_send is not None
        assert decision.blocks_to_send.num_tokens == decision.reused_tokens
        assert decision.reused_tokens <= min(decision.verified_tokens, len(prompt) - 1)
        assert decision.reused_tokens >= max(threshold, 1)
    else:
        assert decision.blocks_to_send is None


def estimate(
    est_tokens: int,
    est_new: int,
    *,
    entry: ConversationEntry | None = ENTRY,
    config: PolicyConfig = CONFIG,
    costs: CostEstimates = COSTS,
    node: NodeState | None = None,
    max_output_tokens: int | None = None,
) -> TurnDecision:
    """Estimate mode: P's connector proves the tokens; the router knows sizes only."""
    return decide_turn(
        entry=entry,
        prompt=Prompt(est_tokens, est_new),
        now_s=CREATED_S + 5.0,
        decode_node=d0() if node is None else node,
        config=config,
        costs=costs,
        max_output_tokens=max_output_tokens,
    )


def test_estimate_mode_sends_the_whole_entry_with_its_fingerprint_for_p_to_verify() -> None:
    decision = estimate(2056 + 300, 300)
    assert decision.action == "pull" and decision.reason == "pull"
    assert not decision.exact
    assert decision.verified_tokens == 0
    assert decision.reused_tokens == 2056
    assert decision.blocks_to_send == ENTRY.blocks
    sent = decision.blocks_to_send.to_json()
    assert sent["kvrelay_fingerprint"] == ENTRY.fingerprint.to_str()
    assert sent["remote_num_tokens"] == 2056


def test_estimate_mode_caps_the_expected_reuse_at_the_prompt_minus_its_last_token() -> None:
    decision = estimate(1000, 0)
    assert decision.action == "pull"
    assert decision.reused_tokens == 999


def test_estimate_mode_below_threshold_when_even_a_full_match_is_too_small() -> None:
    entry = make_entry(PROMPT[:30], GENERATED[:11], replace(BLOCKS, num_tokens=40),
                       block_size=None)
    assert_recompute(estimate(400, 360, entry=entry), "below_threshold")


def test_estimate_mode_direct_and_cost_model_use_the_estimates() -> None:
    config = PolicyConfig(direct_enabled=True, direct_max_new_tokens=64)
    assert estimate(2100, 44, config=config).action == "direct"
    assert estimate(2300, 244, config=config).action == "pull"
    assert_recompute(estimate(2300, 244, costs=huge_transfer_costs()), "cost_model")


# -- a follow-up D must refuse for its length --------------------------------------------


@pytest.mark.parametrize("exact", [True, False])
def test_a_turn_vllm_refuses_for_its_length_recomputes_and_keeps_the_entry(exact: bool) -> None:
    """An output budget over D's ``max_model_len``, or a prompt (its ids known) that leaves
    it no token: vLLM refuses the request (400), so the entry is not spent on it (a pull
    would free D's blocks first): the client's corrected retry still pulls. A budget that
    only does not fit with the prompt is clamped by vLLM, not refused: that turn pulls."""
    prompt = next_turn_prompt()
    n = len(prompt)

    def run(limit: int | None, max_output_tokens: int | None) -> TurnDecision:
        node = d0(max_model_len=limit)
        if exact:
            return decide(prompt, node=node, max_output_tokens=max_output_tokens)
        return estimate(n, len(NEW_USER), node=node, max_output_tokens=max_output_tokens)

    budget_over = run(n + 100, n + 101)
    assert_recompute(budget_over, "too_long")
    assert budget_over.verified_tokens == 0 and budget_over.predicted_transfer_s == 0.0
    assert run(n + 100, n + 100).action == "pull"
    assert run(n + 1, 600).action == "pull"  # clamped to one token by vLLM
    if exact:
        assert_recompute(run(n, None), "too_long")  # no token left
        assert_recompute(run(n - 1, 1), "too_long")
    else:  # an estimated length runs high as well as low: never judged on (probe 13, H2)
        assert run(n, None).action == "pull"
        assert run(n - 1, 1).action == "pull"
    assert run(None, 10**6).action == "pull"  # D's length unknown: no check
