"""core.consequences: what a decision does to its entry, retry rules, cost samples."""

from __future__ import annotations

import pytest

from kvrelay.core.consequences import (
    ANSWERED_READ_GRACE_S,
    SPENT_READ_GRACE_S,
    decode_retry,
    entry_fate,
    learn_prefill,
    params_spent,
    prefill_retry,
    spent_read_grace_s,
)
from kvrelay.core.costs import CostEstimates
from kvrelay.core.policy import TurnDecision


@pytest.mark.parametrize(("action", "reason", "claim", "drop", "purge", "release"), [
    ("pull", "pull", True, False, False, False),
    ("direct", "direct", False, False, False, False),
    ("recompute", "no_entry", False, False, False, False),
    ("recompute", "cost_model", False, False, False, False),
    ("recompute", "expired", False, True, False, True),
    ("recompute", "near_expiry", False, True, False, True),
    ("recompute", "node_down", False, True, False, False),
    ("recompute", "engine_restarted", False, True, True, False),
    ("recompute", "released", False, True, False, False),
])
def test_entry_fate(
    action: str, reason: str, claim: bool, drop: bool, purge: bool, release: bool
) -> None:
    """Drops order D to release what it may still hold; never blocks already gone."""
    fate = entry_fate(TurnDecision(action, reason))  # type: ignore[arg-type]
    assert (fate.claim, fate.drop, fate.purge_engine, fate.release) == (
        claim, drop, purge, release)


def test_retries() -> None:
    assert prefill_retry("timeout", None, 0) and not prefill_retry("timeout", None, 1)
    assert not prefill_retry("status", 400, 0)
    assert decode_retry("connect", None, 0) == "same_params"
    assert decode_retry("status", 503, 0) == "same_params"
    assert decode_retry("status", 500, 0) == "fresh_prefill"
    assert decode_retry("closed", None, 0) == "fresh_prefill"
    assert decode_retry("timeout", None, 1) == "none"
    assert decode_retry("status", 404, 0) == "none"
    assert not params_spent("connect", None) and params_spent("protocol", None)


def test_a_spent_read_is_held_briefly_after_an_answer_longer_after_none() -> None:
    """P answered (an error): its request is over, 1 s covers a transfer still landing.
    No answer (timeout, reset): until vLLM has surely aborted it, 10 s. Never for good."""
    assert spent_read_grace_s("status") == ANSWERED_READ_GRACE_S == 1.0
    for kind in ("timeout", "closed", "protocol"):
        assert spent_read_grace_s(kind) == SPENT_READ_GRACE_S == 10.0  # type: ignore[arg-type]


def test_a_pull_teaches_the_transfer_cost_a_recompute_the_prefill_rate() -> None:
    costs = CostEstimates()
    pulled = learn_prefill(costs, pulled=True, prompt_tokens=2000, cached_tokens=1900,
                           seconds=0.05)
    assert pulled.prefill == costs.prefill and pulled.transfer != costs.transfer
    recomputed = learn_prefill(costs, pulled=False, prompt_tokens=2000, cached_tokens=0,
                               seconds=0.5)
    assert recomputed.transfer == costs.transfer and recomputed.prefill != costs.prefill
    nothing = learn_prefill(costs, pulled=True, prompt_tokens=2000, cached_tokens=0,
                            seconds=0.5)
    assert nothing.transfer == costs.transfer
