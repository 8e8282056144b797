from __future__ import annotations

import pytest

from kvrelay.core.selection import (
    AffinityConfig,
    NodeChoice,
    NodeState,
    choose_decode,
    choose_prefill,
)


def p(node_id: str, tokens: int = 0, requests: int = 0, up: bool = True) -> NodeState:
    return NodeState(
        node_id,
        "prefill",
        f"http://{node_id}",
        up=up,
        outstanding_requests=requests,
        outstanding_prefill_tokens=tokens,
    )


def d(node_id: str, requests: int = 0, up: bool = True, tokens: int = 0,
      room: int | None = None) -> NodeState:
    return NodeState(
        node_id,
        "decode",
        f"http://{node_id}",
        up=up,
        outstanding_requests=requests,
        outstanding_prefill_tokens=tokens,
        room_tokens=room,
    )


def test_prefill_least_outstanding_tokens() -> None:
    nodes = [p("p0", tokens=5000, requests=1), p("p1", tokens=100, requests=9)]
    assert choose_prefill(nodes) == NodeChoice("p1", "least_prefill_work")


def test_prefill_ties_by_requests_then_order() -> None:
    assert choose_prefill([p("p0", 10, 3), p("p1", 10, 2)]) == NodeChoice(
        "p1", "least_prefill_work"
    )
    assert choose_prefill([p("p0", 10, 2), p("p1", 10, 2)]) == NodeChoice(
        "p0", "least_prefill_work"
    )
    assert choose_prefill([p("p1", 10, 2), p("p0", 10, 2)]) == NodeChoice(
        "p1", "least_prefill_work"
    )


def test_prefill_skips_down_nodes_and_decode_nodes() -> None:
    nodes = [p("p0", up=False), d("d0"), p("p1", tokens=999)]
    assert choose_prefill(nodes) == NodeChoice("p1", "least_prefill_work")


def test_prefill_none_when_nothing_up() -> None:
    assert choose_prefill([]) is None
    assert choose_prefill([p("p0", up=False), d("d0")]) is None


def test_decode_least_loaded_without_affinity() -> None:
    nodes = [d("d0", 3), d("d1", 1), d("d2", 1)]
    assert choose_decode(nodes) == NodeChoice("d1", "least_loaded")


def test_decode_ties_by_prefill_tokens() -> None:
    nodes = [d("d0", 1, tokens=500), d("d1", 1, tokens=0)]
    assert choose_decode(nodes) == NodeChoice("d1", "least_loaded")


def test_decode_keeps_affinity_within_factor_and_slack() -> None:
    nodes = [d("d0", 4), d("d1", 1)]
    assert choose_decode(nodes, "d0") == NodeChoice("d0", "affinity")
    assert choose_decode([d("d0", 2), d("d1", 0)], "d0") == NodeChoice("d0", "affinity")


def test_decode_affinity_overridden_when_overloaded() -> None:
    nodes = [d("d0", 5), d("d1", 1)]
    assert choose_decode(nodes, "d0") == NodeChoice("d1", "affinity_overloaded")
    assert choose_decode([d("d0", 3), d("d1", 0)], "d0") == NodeChoice("d1", "affinity_overloaded")


def test_decode_affinity_config() -> None:
    nodes = [d("d0", 5), d("d1", 1)]
    loose = AffinityConfig(overload_factor=3.0, overload_slack_requests=2)
    assert choose_decode(nodes, "d0", loose) == NodeChoice("d0", "affinity")
    strict = AffinityConfig(overload_factor=1.0, overload_slack_requests=0)
    assert choose_decode([d("d0", 2), d("d1", 1)], "d0", strict) == NodeChoice(
        "d1", "affinity_overloaded"
    )


def test_decode_affinity_unavailable() -> None:
    nodes = [d("d0", 0, up=False), d("d1", 4)]
    assert choose_decode(nodes, "d0") == NodeChoice("d1", "affinity_unavailable")
    assert choose_decode(nodes, "gone") == NodeChoice("d1", "affinity_unavailable")
    assert choose_decode([p("p0"), d("d1")], "p0") == NodeChoice("d1", "affinity_unavailable")


def test_decode_goes_where_there_is_room_for_the_prompt() -> None:
    """A D whose KV cache cannot take the prompt (its own numbers) would make the request
    wait while another D has room: only Ds with room are chosen from, the affinity D too,
    whatever the request counts say (two long decodes fill a D; another replica's load is
    not counted: probe 9, finding 1). Unknown room counts as room; the affinity D's room
    counts what it holds for the request (a pull frees it there). When no D has room, a
    request without an affinity D goes where the most room is, then load (the first D took
    every such request: probe 14, K1); one with an affinity D keeps it (moving it cost
    pulls: probe 15, L1). When the need is unknown, load decides."""
    full, roomy = d("d0", 0, room=256), d("d1", 3, room=4096)
    assert choose_decode([full, roomy], needed_tokens=1000) == NodeChoice("d1", "least_loaded")
    assert choose_decode([full, roomy], "d0", needed_tokens=1000) == NodeChoice(
        "d1", "affinity_full")
    assert choose_decode([full, roomy], "d0", needed_tokens=200) == NodeChoice("d0", "affinity")
    assert choose_decode([full, d("d1", 3)], needed_tokens=1000) == NodeChoice(
        "d1", "least_loaded")  # d1's room is unknown
    short = d("d1", 3, room=512)
    assert choose_decode([full, short], needed_tokens=1000) == NodeChoice(
        "d1", "least_loaded")  # none has room: the most room
    assert choose_decode([full, short], "d0", needed_tokens=1000) == NodeChoice(
        "d0", "affinity")  # none has room: the affinity D keeps its conversation
    assert choose_decode([full, short], "d1", needed_tokens=1000) == NodeChoice(
        "d0", "affinity_overloaded")  # load still moves it (3 > 2 x 0 + 2)
    assert choose_decode([full, d("d1", 2, room=512)], "d1", needed_tokens=1000) == \
        NodeChoice("d1", "affinity")
    assert choose_decode([d("d0", 2, room=512), short, full], needed_tokens=1000) == \
        NodeChoice("d0", "least_loaded")  # as much room: load decides
    # what the affinity D holds for the request counts: 256 free + 800 held >= 1000
    assert choose_decode([full, roomy], "d0", needed_tokens=1000,
                         affinity_held_tokens=800) == NodeChoice("d0", "affinity")
    assert choose_decode([full, roomy], "d0", needed_tokens=1000,
                         affinity_held_tokens=700) == NodeChoice("d1", "affinity_full")
    assert choose_decode([full, roomy], None, needed_tokens=1000,
                         affinity_held_tokens=800) == NodeChoice("d1", "least_loaded")
    assert choose_decode([full, roomy]) == NodeChoice("d0", "least_loaded")
    assert choose_decode([full, roomy, d("d2", 1, room=9000)], "d1",
                         needed_tokens=1000) == NodeChoice("d1", "affinity")


def test_decode_none_when_nothing_up() -> None:
    assert choose_decode([d("d0", up=False), p("p0")], "d0") is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"node_id": ""},
        {"node_id": "x", "outstanding_requests": -1},
        {"node_id": "x", "outstanding_prefill_tokens": -1},
    ],
)
def test_node_state_validates(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        NodeState(role="decode", url="http://x", **kwargs)  # type: ignore[arg-type]


def test_affinity_config_validates() -> None:
    with pytest.raises(ValueError):
        AffinityConfig(overload_factor=0.5)
    with pytest.raises(ValueError):
        AffinityConfig(overload_slack_requests=-1)
