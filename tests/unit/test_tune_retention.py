"""From turns to retention rows: gaps from the end of a turn, reusable tokens by block hashes,
D assignment, and the order a conversation's turns must come in."""

from __future__ import annotations

import math

import pytest

from kvrelay.tune.retention import RetentionBuilder
from kvrelay.tune.trace import TraceOrderError, TraceTurn


def turn(conv, at, inp, out, hash_ids=None, **kw):
    return TraceTurn(conv, at, inp, out, hash_ids, **kw)


def rows(r):
    return list(zip(r.start_s, r.tokens, r.decode, r.gap_s, r.usable_tokens, strict=True))


def test_one_row_per_turn_with_gap_from_the_end_of_the_turn():
    b = RetentionBuilder(decode_s_per_token=0.01)
    r = b.add_all([turn("a", 10.0, 100, 50), turn("a", 20.0, 200, 10)]).finish()
    (s1, t1, _, g1, u1), (s2, t2, _, g2, u2) = sorted(rows(r))
    assert (s1, t1, g1, u1) == (10.5, 150, 9.5, 150)  # ends 50 x 0.01 s after arriving
    assert (s2, t2, u2) == (20.1, 210, 0) and math.isinf(g2)
    assert (r.first_at_s, r.last_at_s, r.num_conversations, r.num_turns) == (10.0, 20.0, 1, 2)


def test_gap_never_negative_and_usable_capped_by_the_prompt():
    r = RetentionBuilder(decode_s_per_token=1.0).add_all(
        [turn("a", 0.0, 100, 50), turn("a", 10.0, 120, 5)]).finish()
    row = next(x for x in rows(r) if math.isfinite(x[3]))
    assert row[3] == 0.0  # arrived before the modelled end
    assert row[4] == 119  # min(150 retained, 120 - 1)


def test_hash_ids_decide_the_reusable_prefix():
    full = [1, 2, 3, 4]
    b = RetentionBuilder(block_tokens=16)
    r = b.add_all([
        turn("a", 0.0, 64, 20, full),
        turn("a", 5.0, 100, 1, [1, 2, 3, 4, 5, 6, 7]),     # whole prompt matches
        turn("b", 0.0, 64, 20, full),
        turn("b", 5.0, 100, 1, [1, 2, 9, 9, 9, 9, 9]),     # diverges after 2 blocks
        turn("c", 0.0, 70, 20, [1, 2, 3, 4, 99]),          # partial last block
        turn("c", 5.0, 100, 1, [1, 2, 3, 4, 5, 6, 7]),     # full blocks match
    ]).finish()
    usable = sorted(u for _, _, _, g, u in rows(r) if math.isfinite(g))
    assert usable == [32, 84, 90]


def test_conversations_round_robin_over_d_in_order_of_first_turn():
    b = RetentionBuilder(num_decode=2)
    r = b.add_all([turn("x", 0, 10, 1), turn("y", 1, 10, 1), turn("z", 2, 10, 1),
                   turn("x", 3, 20, 1)]).finish()
    by_start = {s: d for s, _, d, _, _ in rows(r)}
    assert by_start == {0: 0, 1: 1, 2: 0, 3: 0}
    assert r.decode_names == ("decode-0", "decode-1")


def test_turn_log_fields_win():
    b = RetentionBuilder()
    r = b.add_all([
        turn("k", 100.0, 500, 50, duration_s=2.0, decode_node="d-b", retained_tokens=549),
        turn("k", 140.0, 600, 10, gap_s=30.0, decode_node="d-b", retained_tokens=609,
             reused_tokens=300),
        turn("j", 141.0, 400, 10, decode_node="d-a", retained_tokens=0),
        turn("j", 150.0, 420, 10, decode_node="d-a", retained_tokens=429,
             prefix_mismatch=True),
    ]).finish()
    assert r.decode_names == ("d-b", "d-a")
    got = {s: (t, d, g, u) for s, t, d, g, u in rows(r)}
    assert got[102.0] == (549, 0, 30.0, 300)
    assert got[141.0] == (0, 1, 9.0, 0)  # nothing retained: nothing to reuse
    assert got[150.0][3] == 0 and math.isinf(got[150.0][2])


def test_a_conversation_going_back_in_time_is_an_order_error():
    b = RetentionBuilder()
    b.add(turn("a", 10.0, 5, 1))
    with pytest.raises(TraceOrderError):
        b.add(turn("a", 9.0, 5, 1))


def test_empty_input():
    r = RetentionBuilder(num_decode=3).finish()
    assert r.num_turns == 0 and r.decode_names == ("decode-0", "decode-1", "decode-2")
