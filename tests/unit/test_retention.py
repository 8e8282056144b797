"""core.retention: which retained turns D releases (pressure, headroom, deadline), and the
release handshake fields of core.retention_sync that D's side relies on."""

import pytest

from kvrelay.core.retention import (
    NOTHING,
    RetainedTurn,
    release_expired,
    release_for,
    release_idle,
    release_order,
    release_over_headroom,
    release_under_pressure,
    retention_cap_blocks,
)
from kvrelay.core.retention_sync import (
    MAX_ORDERS,
    MAX_RELEASED_PER_SYNC,
    RELEASE_CAUSES,
    PullWindow,
    Released,
    RetentionOrders,
    RetentionSync,
    RetentionSyncError,
    clamp_pull_window_s,
    decode_orders,
    decode_sync,
    encode,
    shortened_until_s,
)


def turn(request_id: str, blocks: int, at_s: float, *, value: float = 0.0,
         deadline_s: float = 1e9, reading: bool = False,
         pull_until_s: float | None = None) -> RetainedTurn:
    return RetainedTurn(request_id=request_id, num_blocks=blocks, num_tokens=blocks * 16,
                        retained_at_s=at_s, deadline_s=deadline_s, value=value, reading=reading,
                        pull_until_s=pull_until_s)


def test_turns_past_their_pull_window_go_first_oldest_first_then_the_others():
    turns = [turn("young-idle", 2, 40.0, pull_until_s=45.0, value=9.0),
             turn("old-idle", 2, 30.0, pull_until_s=50.0),
             turn("oldest-in-window", 2, 0.0, pull_until_s=100.0),
             turn("no-window", 2, 5.0),
             turn("idle-read", 2, 1.0, pull_until_s=2.0, reading=True)]
    order = [t.request_id for t in release_idle(turns, now_s=60.0)]
    assert order == ["old-idle", "young-idle", "oldest-in-window", "no-window"]
    # Before any window ends the order is release_order's: value, then oldest.
    before = [t.request_id for t in release_idle(turns, now_s=10.0)]
    assert before == [t.request_id for t in release_order(turns)]
    assert turns[1].idle(50.0) and not turns[1].idle(49.9) and not turns[3].idle(1e12)


def test_pressure_and_headroom_release_idle_turns_before_older_ones_in_their_window():
    turns = [turn("old", 4, 0.0, pull_until_s=500.0), turn("idle", 4, 50.0, pull_until_s=60.0)]
    assert release_under_pressure(turns, num_blocks_free=0, num_blocks_needed=4,
                                  now_s=70.0).request_ids == ("idle",)
    assert release_over_headroom(turns, num_blocks_total=8, headroom=0.5,
                                 now_s=70.0).request_ids == ("idle",)
    # Without a time the windows are not known: oldest first.
    assert release_under_pressure(turns, num_blocks_free=0,
                                  num_blocks_needed=4).request_ids == ("old",)


def test_d_clamps_the_pull_window_to_the_turn_s_retention():
    assert clamp_pull_window_s(30.0, 120.0) == 30.0
    assert clamp_pull_window_s(300, 120.0) == 120.0
    for bad in (None, "30", True, 0, -1.0, float("nan")):
        assert clamp_pull_window_s(bad, 120.0) == 120.0


def test_least_valuable_go_first_then_oldest_and_a_read_turn_never():
    turns = [turn("new-cheap", 2, 30.0), turn("old-dear", 2, 10.0, value=5.0),
             turn("old-cheap", 2, 20.0), turn("oldest-read", 9, 0.0, reading=True)]
    assert [t.request_id for t in release_order(turns)] == ["old-cheap", "new-cheap", "old-dear"]


def test_pressure_releases_the_fewest_turns_that_cover_the_shortfall():
    turns = [turn("a", 4, 1.0), turn("b", 4, 2.0), turn("c", 4, 3.0)]
    release = release_under_pressure(turns, num_blocks_free=3, num_blocks_needed=10)
    assert release.request_ids == ("a", "b") and release.num_blocks == 8
    assert release.reason == "pressure" and release.short_blocks == 0
    assert release_under_pressure(turns, num_blocks_free=10, num_blocks_needed=10) is NOTHING


def test_pressure_beyond_what_retention_holds_says_what_is_still_missing():
    release = release_under_pressure([turn("a", 4, 1.0), turn("r", 8, 0.0, reading=True)],
                                     num_blocks_free=0, num_blocks_needed=10)
    assert release.request_ids == ("a",) and release.short_blocks == 6
    nothing = release_for([turn("r", 8, 0.0, reading=True)], 3, "pressure")
    assert nothing.request_ids == () and nothing.short_blocks == 3 and nothing.reason == "none"


def test_headroom_caps_what_retention_may_hold():
    assert retention_cap_blocks(24, 0.25) == 18
    turns = [turn("a", 8, 1.0), turn("b", 8, 2.0), turn("c", 8, 3.0)]
    release = release_over_headroom(turns, num_blocks_total=24, headroom=0.25)
    assert release.request_ids == ("a",) and release.reason == "headroom"
    assert release_over_headroom(turns, num_blocks_total=32, headroom=0.25) is NOTHING
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


def test_pull_windows_round_trip_are_checked_and_only_ever_shorten() -> None:
    """The router's ``windows`` (a tool call's turn: likely pulled within the tools' run
    time) arrive as ``[request id, seconds]`` pairs; a window past the turn's own (or its
    deadline, without one) changes nothing."""
    orders = RetentionOrders(windows=(PullWindow("r1", 2.5),))
    assert decode_orders(encode(orders)) == orders
    assert decode_orders(encode(orders)).pull_windows == (PullWindow("r1", 2.5),)
    assert encode(RetentionOrders()) == b'{"release":[],"dropped":[]}'  # as before windows
    assert decode_orders(b'{"release":[],"later":1}').pull_windows == ()  # D reads on
    assert decode_orders(b'{"windows":[["r2",1.0]]}').windows == (PullWindow("r2", 1.0),)
    for bad in (b'{"windows":[["r2",0]]}', b'{"windows":[["r2",-1.0]]}',
                b'{"windows":[["r2",1e999]]}', b'{"windows":[["r2"]]}'):
        with pytest.raises(RetentionSyncError):
            decode_orders(bad)
    window = PullWindow("r1", 3.0)
    assert shortened_until_s(None, 10.0, 40.0, window) == 13.0
    assert shortened_until_s(20.0, 10.0, 40.0, window) == 13.0
    assert shortened_until_s(12.0, 10.0, 40.0, window) == 12.0
    assert shortened_until_s(None, 10.0, 11.0, window) == 11.0


def test_releasing_and_dropped_are_bounded():
    too_many = tuple(f"r{i}" for i in range(max(MAX_RELEASED_PER_SYNC, MAX_ORDERS) + 1))
    with pytest.raises(RetentionSyncError):
        decode_sync(encode(sync(releasing=too_many)))
    with pytest.raises(RetentionSyncError):
        decode_orders(encode(RetentionOrders(dropped=too_many)))
    with pytest.raises(RetentionSyncError):
        decode_orders(encode(RetentionOrders(windows=tuple(PullWindow(r, 1.0)
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
