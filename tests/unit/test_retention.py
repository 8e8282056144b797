"""core.retention: which retained turns D releases (pressure, headroom, deadline), and the
release handshake fields of core.retention_sync that D's side relies on."""

import pytest

from kvrelay.core.retention import (
    NOTHING,
    RetainedTurn,
    blocks_freed,
    holders_after,
    release_expired,
    release_for,
    release_order,
    release_over_headroom,
    release_under_pressure,
    retention_cap_blocks,
)
from kvrelay.core.retention_sync import (
    MAX_ORDERS,
    MAX_RELEASED_PER_SYNC,
    RELEASE_CAUSES,
    Lane,
    Released,
    RetentionOrders,
    RetentionSync,
    RetentionSyncError,
    TurnCurve,
    ask_via,
    decode_orders,
    decode_sync,
    encode,
)
from kvrelay.core.return_curve import ReturnCurve

TOOL = ReturnCurve(return_p=0.9, log_mean=0.0, log_sigma=1.0)
"""Tool calls' turns: most come back, within about a second (median 1 s)."""
REPLY = ReturnCurve(return_p=0.5, log_mean=4.0, log_sigma=1.0)
"""Replies' turns: half come back, after about a minute (median 55 s)."""


def turn(request_id: str, blocks: int, at_s: float, *, value: float = 0.0,
         deadline_s: float = 1e9, reading: bool = False,
         curve: ReturnCurve | None = None) -> RetainedTurn:
    return RetainedTurn(request_id=request_id, num_blocks=blocks, num_tokens=blocks * 16,
                        retained_at_s=at_s, deadline_s=deadline_s, value=value, reading=reading,
                        curve=curve)


def test_turns_least_likely_still_to_be_pulled_go_first_then_by_value_and_age():
    turns = [turn("tool-old", 2, 40.0, curve=TOOL, value=9.0),  # 20 s: its tools are done
             turn("reply-older", 2, 30.0, curve=REPLY),  # 30 s: the user may still come
             turn("tool-young", 2, 59.5, curve=TOOL),  # 0.5 s: likely pulled any moment
             turn("no-curve", 2, 5.0),  # unknown: as stock, kept over any curve
             turn("tool-read", 2, 1.0, curve=TOOL, reading=True)]
    order = [t.request_id for t in release_order(turns, now_s=60.0)]
    assert order == ["tool-old", "reply-older", "tool-young", "no-curve"]
    chances = [t.pull_chance(60.0) for t in turns]
    assert chances[0] < 0.05 < chances[1] < chances[2] < chances[3] == 1.0
    # Turns without curves keep stock's order: lowest value, then oldest.
    plain = [turn("b", 2, 2.0), turn("a", 2, 1.0), turn("dear", 2, 0.0, value=1.0)]
    assert [t.request_id for t in release_order(plain, now_s=9.0)] == ["a", "b", "dear"]


def test_pressure_and_headroom_release_the_least_likely_pull_before_an_older_turn():
    turns = [turn("old-reply", 4, 0.0, curve=REPLY), turn("done-tool", 4, 50.0, curve=TOOL)]
    assert release_under_pressure(turns, num_blocks_free=0, num_blocks_needed=4,
                                  now_s=70.0).request_ids == ("done-tool",)
    assert release_over_headroom(turns, num_blocks_total=8, headroom=0.5,
                                 now_s=70.0).request_ids == ("done-tool",)
    # Just after its turn the tool's follow-up is the likelier: the old reply goes.
    assert release_under_pressure(turns, num_blocks_free=0, num_blocks_needed=4,
                                  now_s=50.2).request_ids == ("old-reply",)


def test_the_pull_chance_falls_with_age_and_ends_at_the_deadline():
    assert TOOL.pull_chance(0.0, 1e9) == pytest.approx(0.9)
    assert REPLY.pull_chance(0.0, 1e9) == pytest.approx(0.5)
    ages = [0.5, 2.0, 10.0, 60.0]
    falling = [TOOL.pull_chance(a, 1e9) for a in ages]
    assert falling == sorted(falling, reverse=True) and falling[-1] < 1e-3
    # A deadline cuts what can still be pulled; past it nothing can.
    assert REPLY.pull_chance(10.0, 30.0) < REPLY.pull_chance(10.0, 1e9)
    assert REPLY.pull_chance(30.0, 30.0) == 0.0
    assert turn("t", 1, 0.0, deadline_s=30.0, curve=REPLY).pull_chance(31.0) == 0.0
    # Every turn comes back (p = 1): only the deadline can make a pull unlikely.
    always = ReturnCurve(1.0, 0.0, 1.0)
    assert always.pull_chance(100.0, 1e9) == pytest.approx(1.0)
    assert always.pull_chance(100.0, 101.0) < 0.5
    # A fit of identical gaps (sigma 0) is a step.
    step = ReturnCurve(1.0, 0.0, 0.0)
    assert step.survival(0.9) == 1.0 and step.survival(1.1) == 0.0


def test_least_valuable_go_first_then_oldest_and_a_read_turn_never():
    turns = [turn("new-cheap", 2, 30.0), turn("old-dear", 2, 10.0, value=5.0),
             turn("old-cheap", 2, 20.0), turn("oldest-read", 9, 0.0, reading=True)]
    assert [t.request_id for t in release_order(turns, now_s=40.0)] == \
        ["old-cheap", "new-cheap", "old-dear"]


def test_pressure_releases_the_fewest_turns_that_cover_the_shortfall():
    turns = [turn("a", 4, 1.0), turn("b", 4, 2.0), turn("c", 4, 3.0)]
    release = release_under_pressure(turns, num_blocks_free=3, num_blocks_needed=10, now_s=5.0)
    assert release.request_ids == ("a", "b") and release.num_blocks == 8
    assert release.reason == "pressure" and release.short_blocks == 0
    assert release_under_pressure(turns, num_blocks_free=10, num_blocks_needed=10,
                                  now_s=5.0) is NOTHING


def test_pressure_keeps_a_turn_the_others_released_cover_without_it():
    """In order ``small`` (1 block) would go first, then ``large`` (20): the large one
    alone covers the 2 blocks needed, so the small one stays (a pull not lost for nothing);
    ``next`` is never reached."""
    turns = [turn("small", 1, 1.0), turn("large", 20, 2.0), turn("next", 3, 3.0)]
    release = release_under_pressure(turns, num_blocks_free=0, num_blocks_needed=2, now_s=5.0)
    assert release.request_ids == ("large",) and release.num_blocks == 20
    # Of a, b, c (3 + 3 + 4 blocks, in that order) for 7, a and c suffice: b, the more
    # valuable of the two the order took before c, stays.
    three = [turn("a", 3, 1.0), turn("b", 3, 2.0), turn("c", 4, 3.0)]
    assert release_for(three, 7, "pressure", now_s=5.0).request_ids == ("a", "c")
    assert release_for(three, 8, "pressure", now_s=5.0).request_ids == ("a", "b", "c")


def shared(request_id: str, block_ids: range | list[int], at_s: float) -> RetainedTurn:
    ids = tuple(block_ids)
    return RetainedTurn(request_id=request_id, num_blocks=len(ids), num_tokens=len(ids) * 16,
                        retained_at_s=at_s, deadline_s=1e9, block_ids=ids)


SYSTEM = range(0, 60)
"""An agent's system prompt and tools: 60 blocks every conversation starts with."""


def test_a_release_counts_only_the_blocks_no_other_request_holds():
    """Three conversations' turns share the system prompt's 60 blocks and hold 5 of their
    own; a live request holds the prompt too (4 holders in all). Releasing the oldest turn
    frees its 5 blocks, not 65: for 12 blocks D takes three turns (15), where counting
    every block it would have taken one and come back short."""
    a, b, c = (shared(name, [*SYSTEM, *range(100 + 10 * i, 105 + 10 * i)], float(i))
               for i, name in enumerate("abc"))
    own = {block_id: 1 for t in (a, b, c) for block_id in t.block_ids[60:]}
    holders = {**dict.fromkeys(SYSTEM, 4), **own}
    assert blocks_freed([a], holders) == 5 and blocks_freed([a]) == 65
    assert blocks_freed([a, b, c], holders) == 15, "the live request keeps the prompt"
    release = release_under_pressure([a, b, c], num_blocks_free=0, num_blocks_needed=12,
                                     now_s=5.0, holders=holders)
    assert release.request_ids == ("a", "b", "c") and release.num_blocks == 15
    assert release_under_pressure([a, b, c], num_blocks_free=0, num_blocks_needed=12,
                                  now_s=5.0).request_ids == ("a",), "unshared: 65 blocks"
    without_live = {**holders, **dict.fromkeys(SYSTEM, 3)}
    assert blocks_freed([a, b, c], without_live) == 75, "the last holders free the prompt"
    assert release_under_pressure([a, b, c], num_blocks_free=0, num_blocks_needed=12,
                                  now_s=5.0, holders=without_live).num_blocks == 75


def test_shared_blocks_count_for_headroom_and_after_turns_already_on_their_way():
    """A conversation's turn and the one before it share the history (blocks 0-19): what
    retention holds is 24 blocks, not 42; with the older turn on its way, the newer one
    frees the history too."""
    older = shared("older", range(0, 22), 1.0)
    newer = shared("newer", [*range(0, 20), 30, 31], 2.0)
    holders = {**dict.fromkeys(range(0, 20), 2), 20: 1, 21: 1, 30: 1, 31: 1}
    assert blocks_freed([older, newer], holders) == 24
    release = release_over_headroom([older, newer], num_blocks_total=40, headroom=0.5,
                                    now_s=5.0, holders=holders)
    assert release.request_ids == ("older", "newer") and release.num_blocks == 24
    after = holders_after(holders, [older])
    assert (after.get(0, 1), after.get(20, 1), after.get(30, 1)) == (1, 0, 1)
    assert blocks_freed([newer], after) == 22


def test_pressure_beyond_what_retention_holds_says_what_is_still_missing():
    release = release_under_pressure([turn("a", 4, 1.0), turn("r", 8, 0.0, reading=True)],
                                     num_blocks_free=0, num_blocks_needed=10, now_s=5.0)
    assert release.request_ids == ("a",) and release.short_blocks == 6
    nothing = release_for([turn("r", 8, 0.0, reading=True)], 3, "pressure", now_s=5.0)
    assert nothing.request_ids == () and nothing.short_blocks == 3 and nothing.reason == "none"


def test_headroom_caps_what_retention_may_hold():
    assert retention_cap_blocks(24, 0.25) == 18
    turns = [turn("a", 8, 1.0), turn("b", 8, 2.0), turn("c", 8, 3.0)]
    release = release_over_headroom(turns, num_blocks_total=24, headroom=0.25, now_s=5.0)
    assert release.request_ids == ("a",) and release.reason == "headroom"
    assert release_over_headroom(turns, num_blocks_total=32, headroom=0.25,
                                 now_s=5.0) is NOTHING
    with pytest.raises(ValueError):
        retention_cap_blocks(24, 1.5)


def test_deadline_releases_turns_whose_time_ran_out_unless_being_read():
    turns = [turn("due", 2, 0.0, deadline_s=5.0), turn("later", 2, 0.0, deadline_s=50.0),
             turn("due-read", 2, 0.0, deadline_s=5.0, reading=True)]
    release = release_expired(turns, now_s=5.0)
    assert release.request_ids == ("due",) and release.reason == "expired"
    assert release_expired(turns, now_s=4.9) is NOTHING


def sync(**changes: object) -> RetentionSync:
    fields: dict[str, object] = dict(
        engine_id="d0", block_size=16, bytes_per_block=4096, num_blocks_total=24,
        num_blocks_free=4, retained_requests=1, retained_blocks=12, retained_tokens=180)
    fields.update(changes)
    return RetentionSync(**fields)  # type: ignore[arg-type]


def test_releasing_and_dropped_round_trip_and_default_to_empty():
    asked = sync(releasing=("r1", "r2"), released=(Released("r0", "headroom"),),
                 releases_total={"headroom": 1})
    assert decode_sync(encode(asked)) == asked
    assert decode_sync(b'{"engine_id":"d0","block_size":16,"bytes_per_block":1,'
                       b'"num_blocks_total":2,"num_blocks_free":1,"retained_requests":0,'
                       b'"retained_blocks":0,"retained_tokens":0}').releasing == ()
    assert decode_orders(b'{"release":["x"]}') == RetentionOrders(release=("x",))
    assert decode_orders(encode(RetentionOrders(dropped=("r1",)))).dropped == ("r1",)
    assert "headroom" in RELEASE_CAUSES


def test_return_curves_round_trip_and_are_checked() -> None:
    """The router's ``curves`` (a tool call's turn: how tool calls come back) arrive as
    ``[request id, [return_p, log_mean, log_sigma]]``; absent, the JSON is what connectors
    before them read, and D reads on past fields it does not know."""
    orders = RetentionOrders(curves=(TurnCurve("r1", TOOL),))
    assert decode_orders(encode(orders)) == orders
    assert decode_orders(encode(orders)).turn_curves == (TurnCurve("r1", TOOL),)
    assert encode(RetentionOrders()) == b'{"release":[],"dropped":[]}'
    assert decode_orders(b'{"release":[],"later":1}').turn_curves == ()
    assert decode_orders(b'{"curves":[["r2",[0.5,1,2]]]}').turn_curves == \
        (TurnCurve("r2", ReturnCurve(0.5, 1.0, 2.0)),)
    for bad in (b'{"curves":[["r2",[1.5,1,2]]]}', b'{"curves":[["r2",[0.5,1,-2]]]}',
                b'{"curves":[["r2",[0.5,1e999,2]]]}', b'{"curves":[["r2",[0.5,1]]]}',
                b'{"curves":[["r2"]]}'):
        with pytest.raises(RetentionSyncError):
            decode_orders(bad)


def test_d_reads_a_curve_from_the_params_or_ranks_the_turn_without_one() -> None:
    from kvrelay.core.return_curve import decode_curve

    assert decode_curve([0.9, 0, 1.0]) == ReturnCurve(0.9, 0.0, 1.0)
    for bad in (None, [0.9, 0], "0.9,0,1", [2.0, 0, 1], [0.5, 0, -1], [0.5, float("nan"), 1],
                [True, 0, 1], {"return_p": 0.9}):
        assert decode_curve(bad) is None


def test_releasing_and_dropped_are_bounded():
    too_many = tuple(f"r{i}" for i in range(max(MAX_RELEASED_PER_SYNC, MAX_ORDERS) + 1))
    with pytest.raises(RetentionSyncError):
        decode_sync(encode(sync(releasing=too_many)))
    with pytest.raises(RetentionSyncError):
        decode_orders(encode(RetentionOrders(dropped=too_many)))
    with pytest.raises(RetentionSyncError):
        decode_orders(encode(RetentionOrders(curves=tuple(TurnCurve(r, TOOL)
                                                          for r in too_many))))


def test_the_router_counts_d_s_retained_blocks_as_available_to_live_work():
    from kvrelay.router.retention import DRetention

    # D's cache is full, but all of it retention: live work can have all of it on demand,
    # so the learned retention time is not shortened because of retention's own blocks.
    full_of_retention = DRetention("d", sync(num_blocks_free=0, retained_blocks=24), 0.0)
    assert full_of_retention.free_fraction == 1.0
    # Live work holding 16 of 24 blocks is what makes D short: 4 free + 4 retained.
    busy = DRetention("d", sync(num_blocks_free=4, retained_blocks=4), 0.0)
    assert busy.free_fraction == pytest.approx(8 / 24)


A = "http://10.0.0.1:8001/internal/kv-retention/aaa"
A_RESTARTED = "http://10.0.0.1:8001/internal/kv-retention/bbb"
B = "http://10.0.0.2:8001/internal/kv-retention/ccc"


def test_d_asks_a_turns_own_router_while_it_answers_else_one_that_answers_for_it() -> None:
    """``ask_via``: the turn's own router while it answers (or was never tried); else the
    same origin at another token (that router restarted), else a router naming the same
    shared state; else its own while D syncs with it, or nowhere."""
    fresh, up, down = Lane(A), Lane(A, True, "s"), Lane(A, False, "s")
    assert ask_via(A, [fresh, Lane(B, True, "s")]) == A
    assert ask_via(A, [up, Lane(B, True, "s")]) == A
    assert ask_via(A, [down, Lane(B, True, "s")]) == B  # a replica on the same Redis
    assert ask_via(A, [down, Lane(B, True, "t")]) == A  # another state: keep asking A
    assert ask_via(A, [down, Lane(B, False, "s")]) == A  # B does not answer either
    assert ask_via(A, [down, Lane(A_RESTARTED, True), Lane(B, True, "s")]) == A_RESTARTED
    assert ask_via(A, [Lane(B, True, "s")], "s") == B  # A beyond the lanes D keeps
    assert ask_via(A, [Lane(B, True, "s")]) is None  # A's state unknown: nobody
    assert ask_via(A, [Lane(B, True)], None) is None
    assert decode_orders(encode(RetentionOrders(shared="s"))).shared_state == "s"
    assert RetentionOrders().shared_state is None
    assert b"shared" not in encode(RetentionOrders())  # older connectors read it as before
