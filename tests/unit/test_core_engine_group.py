"""Engine ids of a D run data parallel behind one URL: vLLM appends ``_dp<rank>`` to the
configured id (``core.engine_group``)."""

from __future__ import annotations

import pytest

from kvrelay.core.engine_group import addressable, decode_rank, dp_rank, engine_group, same_group


@pytest.mark.parametrize(("engine_id", "group", "rank"), [
    ("0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10_dp0", "0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10", 0),
    ("decode-engine_dp15", "decode-engine", 15),
    ("0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10", "0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10", None),
    ("x_dp", "x_dp", None),            # no rank number
    ("_dp3", "_dp3", None),            # no group before it
    ("a_dp1_dp2", "a_dp1", 2),         # only the last suffix is vLLM's
    ("a_dp1234567", "a_dp1234567", None),  # more digits than any rank
])
def test_group_and_rank(engine_id: str, group: str, rank: int | None) -> None:
    assert engine_group(engine_id) == group
    assert dp_rank(engine_id) == rank


def test_ranks_of_one_start_share_a_group_and_a_restart_does_not() -> None:
    assert same_group("g1_dp0", "g1_dp7")
    assert same_group("g1", "g1")
    assert not same_group("g1_dp0", "g2_dp0")
    assert not same_group("g1", "g2")


def test_a_follow_up_names_the_rank_that_holds_its_turn() -> None:
    choice = decode_rank("g1_dp3", ("g1_dp0",), rank_room_tokens=None, needed_tokens=500)
    assert (choice.rank, choice.reason) == (3, "affinity")
    roomy = decode_rank("g1_dp3", ("g1_dp3", "g1_dp0"), rank_room_tokens=500,
                        needed_tokens=500)
    assert (roomy.rank, roomy.reason) == (3, "affinity")


@pytest.mark.parametrize(("entry", "node", "room", "reason"), [
    (None, ("g1_dp0",), None, "no_entry"),
    ("g1", ("g1",), None, "not_data_parallel"),              # one engine: nothing to name
    ("g1_dp3", ("g2_dp0",), None, "restarted"),               # its blocks are gone
    ("g1_dp3", (), None, "restarted"),                        # D's engine not known yet
    ("g1_dp9", ("g1_dp8", "g1_dp9"), None, "not_addressable"),  # hybrid or external LB
    ("g1_dp3", ("g1_dp0", "g1_dp3"), 499, "rank_full"),      # vLLM's balancer picks
])
def test_no_rank_is_named(entry: str | None, node: tuple[str, ...], room: int | None,
                          reason: str) -> None:
    choice = decode_rank(entry, node, rank_room_tokens=room, needed_tokens=500)
    assert (choice.rank, choice.reason) == (None, reason)


def test_no_rank_is_named_where_the_turn_is_gone_or_the_rank_has_a_queue() -> None:
    """A pinned turn the rank no longer holds gains nothing there, and one pinned behind a
    queue waits while another rank may idle (probe 17: follow-up TTFT p50 1.4-2.4 s pinned
    against 0.7-0.9 s through vLLM's balancer, most of them recomputes of released turns)."""
    engines = ("g1_dp0", "g1_dp1")
    gone = decode_rank("g1_dp1", engines, rank_room_tokens=None, needed_tokens=500,
                       held=False)
    assert (gone.rank, gone.reason) == (None, "released")
    busy = decode_rank("g1_dp1", engines, rank_room_tokens=10_000, needed_tokens=500,
                       rank_waiting=2)
    assert (busy.rank, busy.reason) == (None, "rank_busy")
    idle = decode_rank("g1_dp1", engines, rank_room_tokens=10_000, needed_tokens=500,
                       rank_waiting=0)
    assert (idle.rank, idle.reason) == (1, "affinity")


def test_no_rank_is_named_to_a_d_that_refused_one() -> None:
    choice = decode_rank("g1_dp1", ("g1_dp0", "g1_dp1"), rank_room_tokens=None,
                         needed_tokens=500, takes_ranks=False)
    assert (choice.rank, choice.reason) == (None, "not_addressable")


def test_a_server_takes_ranks_by_id_once_seen_as_rank_0() -> None:
    """vLLM's header indexes the server's own engines: rank 8 of a hybrid-balanced D is
    engine 0 of its server, and naming 8 there is a 400."""
    assert addressable(["g_dp0"]) and addressable(["g_dp3", "g_dp0"])
    assert not addressable(["g_dp8", "g_dp9"]) and not addressable(["g"]) and not addressable([])
