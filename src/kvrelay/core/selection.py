"""Which prefill (P) and decode (D) node gets the next request.

P is chosen by least outstanding prefill work: prefill time grows with prompt tokens, so
queued tokens predict P's queueing delay better than a request count. D is chosen by
outstanding requests (concurrent decodes), with soft affinity to the D that holds the
conversation's KV: it is preferred unless it is clearly busier than the least-loaded D, i.e.
``load > overload_factor * least_load + overload_slack_requests``. The slack keeps affinity
when every D is nearly idle (``0`` vs ``1`` request is not an imbalance).

Before load, room: a D whose KV cache has no free room for the request's prompt (as its
own recent numbers say: ``NodeState.room_tokens``, from its sync or its gauges) would make
the request wait, preempt, or release retained turns while another D has room, and a
request count does not show it (two long decodes fill a D; another replica's or the
router-less traffic is not counted at all). So when some up D has room for
``needed_tokens`` and some has not, only those with room are considered (a D whose room is
unknown counts as having it); the affinity D too: its KV is of little use on a D that must
evict to admit the request (``affinity_full``), and P pulls the conversation's KV from that
D whichever D decodes. The affinity D's room counts the tokens it holds for the request
(``affinity_held_tokens``: the conversation's retained turn, which the pull frees there and
its prefix cache then finds), so it needs that much less. When no D has room (every one's
room known and short), a request without an affinity D goes to those with the most room:
the least would have to be released or waited for there. Before, the first D given took
every such request, so one D released all retained turns under pressure while the others
kept theirs, stale ones included (probe 14, K1: 60 of 60 turns and 51 of 51 pressure
releases on one of three D's, follow-ups pulled 0.17 against 0.60). A request with one
keeps it then (moving it made another D admit the whole prompt: probe 15, L1, 40-60% of
follow-ups left their D and pulled 0.46-0.48 against 0.54-0.58).

Ties are broken by the order nodes are given in, so equal inputs give equal choices. Down
nodes are never chosen; when no node of the role is up the chooser returns ``None`` and the
caller answers "no capacity".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

NodeRole = Literal["prefill", "decode"]

SelectionReason = Literal[
    "least_prefill_work",
    "least_loaded",
    "affinity",
    "affinity_overloaded",
    "affinity_unavailable",
    "affinity_full",
]


class NodeState(msgspec.Struct, frozen=True):
    """The router's view of one vLLM node at decision time.

    ``engine_id`` is the vLLM engine id last seen from the node (``None`` until known);
    ``outstanding_*`` count requests the router has sent and not yet seen finish;
    ``room_tokens`` (D) the tokens its KV cache has free for live work now, from D's own
    recent numbers (``None``: unknown); ``max_model_len`` (D) the most tokens, prompt and
    output, D accepts for one request, as its ``/v1/models`` says (``None``: unknown).
    """

    node_id: str
    role: NodeRole
    url: str
    up: bool = True
    engine_id: str | None = None
    outstanding_requests: int = 0
    outstanding_prefill_tokens: int = 0
    room_tokens: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id must be non-empty")
        if self.outstanding_requests < 0 or self.outstanding_prefill_tokens < 0:
            raise ValueError("outstanding counts cannot be negative")


class NodeChoice(msgspec.Struct, frozen=True):
    node_id: str
    reason: SelectionReason


@dataclass(frozen=True)
class AffinityConfig:
    """When the D holding a conversation loses it to a less-loaded D."""

    overload_factor: float = 2.0
    overload_slack_requests: int = 2

    def __post_init__(self) -> None:
        if self.overload_factor < 1.0:
            raise ValueError(f"overload_factor must be >= 1, got {self.overload_factor}")
        if self.overload_slack_requests < 0:
            raise ValueError("overload_slack_requests cannot be negative")


def choose_prefill(nodes: Sequence[NodeState]) -> NodeChoice | None:
    """The up P with the least outstanding prefill tokens, then fewest requests, then first
    given; ``None`` when no P is up."""
    candidates = _up(nodes, "prefill")
    if not candidates:
        return None
    best = min(
        candidates,
        key=lambda item: (
            item[1].outstanding_prefill_tokens,
            item[1].outstanding_requests,
            item[0],
        ),
    )
    return NodeChoice(best[1].node_id, "least_prefill_work")


def choose_decode(
    nodes: Sequence[NodeState],
    affinity_node_id: str | None = None,
    config: AffinityConfig | None = None,
    needed_tokens: int | None = None,
    affinity_held_tokens: int = 0,
) -> NodeChoice | None:
    """The D for a request: among the up Ds with room for ``needed_tokens`` (the affinity
    D's room plus ``affinity_held_tokens``) when some have and some have not, or, without an
    affinity D, with the most room when none has (module docstring), the affinity D unless
    overloaded, else the least loaded.

    Load is outstanding requests, ties broken by outstanding prefill tokens (direct turns
    prefill on D), then by order. ``None`` when no D is up.
    """
    cfg = config or AffinityConfig()
    candidates = _up(nodes, "decode")
    if not candidates:
        return None
    full = False
    if needed_tokens is not None:
        def room(node: NodeState) -> int | None:
            held = affinity_held_tokens if node.node_id == affinity_node_id else 0
            return None if node.room_tokens is None else node.room_tokens + held

        roomy = [(i, node) for i, node in candidates
                 if (room(node) or 0) >= needed_tokens or node.room_tokens is None]
        if not roomy and affinity_node_id not in {node.node_id for _, node in candidates}:
            most = max(room(node) or 0 for _, node in candidates)  # every room known, short
            roomy = [(i, node) for i, node in candidates if room(node) == most]
        if roomy and len(roomy) < len(candidates):
            full = affinity_node_id in {node.node_id for _, node in candidates} - {
                node.node_id for _, node in roomy}
            candidates = roomy
    least = min(
        candidates,
        key=lambda item: (
            item[1].outstanding_requests,
            item[1].outstanding_prefill_tokens,
            item[0],
        ),
    )[1]
    if affinity_node_id is None:
        return NodeChoice(least.node_id, "least_loaded")
    held = next((node for _, node in candidates if node.node_id == affinity_node_id), None)
    if held is None:
        return NodeChoice(least.node_id, "affinity_full" if full else "affinity_unavailable")
    limit = cfg.overload_factor * least.outstanding_requests + cfg.overload_slack_requests
    if held.outstanding_requests > limit:
        return NodeChoice(least.node_id, "affinity_overloaded")
    return NodeChoice(held.node_id, "affinity")


def _up(nodes: Sequence[NodeState], role: NodeRole) -> list[tuple[int, NodeState]]:
    return [(i, node) for i, node in enumerate(nodes) if node.role == role and node.up]
