"""``bench.hindsight``: what a D that knew which turns come back would have had to hold."""

from __future__ import annotations

import pytest

from kvrelay.bench.hindsight import Hindsight, hindsight, hindsight_line
from kvrelay.bench.metrics import TurnRecord


def rec(conv: str, number: int, sent_at_s: float, *, prompt: int, answer: int = 0,
        ttft_s: float = 0.0, e2e_s: float = 1.0, error: str | None = None) -> TurnRecord:
    return TurnRecord(
        mode="none", workload="agent", conversation_id=conv, turn=number,
        context_tokens=None, target_tokens=prompt, measured=True, think_s=0.0,
        sent_at_s=sent_at_s, prompt_tokens=prompt, completion_tokens=answer, ttft_s=ttft_s,
        tpot_s=None, e2e_s=e2e_s, action="recompute", reason="no_entry", reused_tokens=0,
        decision_source="headers", error=error)


def test_a_turn_counts_while_it_runs_and_until_the_turn_that_continues_it() -> None:
    # a: 3 blocks live over [0, 1], retained 4 blocks (300 + 100 tokens) over [1, 5];
    # b starts at 2: 2 blocks live over [2, 3], never continued (not retained)
    records = [rec("a", 1, 0.0, prompt=300, answer=100), rec("a", 2, 5.0, prompt=450),
               rec("b", 1, 2.0, prompt=200)]
    assert hindsight(records, num_blocks=100, block_size=128) == Hindsight(
        num_blocks=100, peak_blocks=6, forced_misses=0, continued_turns=1)
    # a's turn 2 (4 blocks) starts as its turn 1's hold ends: at most 6 at once still
    assert hindsight(records, num_blocks=6, block_size=128).forced_misses == 0


def test_follow_ups_no_d_of_that_size_keeps_without_making_live_work_wait() -> None:
    # three conversations retain 4, 4 and 2 blocks over [1, 9]; a new one runs 5 blocks
    # over [4, 5]: with 12 blocks, 3 of the 10 retained must be gone: one turn (a 4)
    records = [rec("a", 1, 0.0, prompt=500), rec("a", 2, 9.0, prompt=600),
               rec("b", 1, 0.0, prompt=500), rec("b", 2, 9.0, prompt=600),
               rec("c", 1, 0.0, prompt=200), rec("c", 2, 9.0, prompt=300),
               rec("d", 1, 4.0, prompt=600)]
    result = hindsight(records, num_blocks=12, block_size=128)
    assert (result.peak_blocks, result.forced_misses, result.continued_turns) == (15, 1, 3)
    # with 8 blocks, 7 must be gone over [4, 5]: two turns, the largest first
    assert hindsight(records, num_blocks=8, block_size=128).forced_misses == 2
    # and with 5, live work alone fills D: every retained turn is lost
    assert hindsight(records, num_blocks=5, block_size=128).forced_misses == 3


def test_the_shared_prefix_is_held_once_and_failed_turns_are_left_out() -> None:
    # two conversations whose prompts start with the same 384 tokens (3 blocks): their
    # second turns (700 tokens, 6 blocks) run together over [4, 5]: 3 + 3 own + 3 shared;
    # c, which failed, would add its own block there
    records = [rec("a", 1, 0.0, prompt=512), rec("a", 2, 4.0, prompt=700),
               rec("b", 1, 0.0, prompt=512), rec("b", 2, 4.0, prompt=700),
               rec("c", 1, 4.0, prompt=512, error="timeout")]
    result = hindsight(records, num_blocks=80, block_size=128, shared_tokens=384)
    assert (result.peak_blocks, result.continued_turns) == (9, 2)
    assert hindsight(records, num_blocks=80, block_size=128).peak_blocks == 12
    # a turn all within the shared prefix is continued but holds nothing of its own
    inside = [rec("a", 1, 0.0, prompt=200), rec("a", 2, 4.0, prompt=300)]
    assert hindsight(inside, num_blocks=4, block_size=128, shared_tokens=384) == Hindsight(
        num_blocks=4, peak_blocks=3, forced_misses=0, continued_turns=1)
    with pytest.raises(ValueError):
        hindsight(records, num_blocks=0, block_size=128)


def test_the_report_line_says_whether_a_miss_was_forced() -> None:
    assert "could keep every one" in hindsight_line(Hindsight(80, 51, 0, 91))
    assert "loses at least 2 of those" in hindsight_line(Hindsight(80, 95, 2, 97))
