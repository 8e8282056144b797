"""The engines of one node: vLLM data parallel behind one URL runs one engine per rank.

A D started with ``--data-parallel-size N`` serves N engine cores behind one API server, and
vLLM's own load balancer spreads requests over them. Each rank has its own KV cache and its
own NIXL agent, so each has its own engine id: vLLM appends ``_dp<rank>`` to the configured
one (``v1/engine/core.py``, ``v1/engine/utils.py _apply_dp_identity_suffix``; checked by
``make check-vllm``'s contract) and gives each rank its own side channel port. A turn's KV is
on the rank that decoded it, and its retained params name that rank's engine and side
channel, so P pulls from the right rank by itself.

What the router must not do is read two ranks' ids as one engine that restarted: before, each
answer from another rank "restarted" the node and dropped every entry of the rank before it
(a D of two ranks pulled on about half the follow-ups it could). So engine ids are compared
by *group*: the id without its rank suffix, which every rank shares and a restart changes
(vLLM draws the configured id anew, a uuid, each time the server starts). An id without a
suffix is its own group of one rank.

A follow-up's decode request names the rank that holds the conversation's turn
(``decode_rank``, vLLM's ``X-data-parallel-rank`` header), so D's prefix cache there serves
the history instead of D loading it all again from P.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import msgspec

_RANK = re.compile(r"^(.+)_dp(\d{1,6})$")


def engine_group(engine_id: str) -> str:
    """The id the ranks of one data-parallel D share: ``engine_id`` without ``_dp<rank>``."""
    match = _RANK.match(engine_id)
    return match.group(1) if match else engine_id


def dp_rank(engine_id: str) -> int | None:
    """The data-parallel rank ``engine_id`` names (``None``: not a rank's id)."""
    match = _RANK.match(engine_id)
    return int(match.group(2)) if match else None


def same_group(a: str, b: str) -> bool:
    """Whether two engine ids are ranks of the same engine group (one D, one start)."""
    return engine_group(a) == engine_group(b)


class RankChoice(msgspec.Struct, frozen=True):
    """Which rank of a data-parallel D the decode request names (``rank``; ``None``: none,
    vLLM's balancer picks), and why (``reason``)."""

    rank: int | None
    reason: str


def addressable(engines: Collection[str]) -> bool:
    """Whether a node's engines (one group, ``engines`` it answered from) take a rank in
    vLLM's ``X-data-parallel-rank`` header as their id says. The header is an index into the
    engines *that server* runs (``v1/engine/input_processor.py``: out of range is a 400),
    the id's suffix the *global* rank: the same with one server for every rank (vLLM's own
    balancer), not behind a server of external or hybrid balancing, which runs rank 8 as its
    engine 0. So only a server seen answering as rank 0 is named ranks (one of external
    balancing's then runs rank 0 alone, and 0 is its index)."""
    return any(dp_rank(engine) == 0 for engine in engines)


def decode_rank(entry_engine_id: str | None, node_engines: Collection[str], *,
                rank_room_tokens: int | None, needed_tokens: int,
                takes_ranks: bool = True, held: bool = True,
                rank_waiting: int | None = None) -> RankChoice:
    """The rank a turn's decode request names on the D that holds the conversation.

    The rank that retained the conversation's last turn has its blocks: a pull frees them
    into that rank's prefix cache, and a turn that recomputes still finds them there. So D
    loads from P only the new tokens on that rank, and the whole prompt on any other (vLLM
    trims the blocks it pulls to what its prefix cache lacks). Measured on the fake D of two
    ranks: three interleaved conversations had D pull 3,549 prompt tokens from P without the
    rank, 2,013 on one engine. Named (``affinity``) unless ``entry_engine_id`` (the entry's
    engine, ``None``: no entry on this D) is not a rank's (``not_data_parallel``), D's
    current engines (``node_engines``) are another group (``restarted``: the blocks are
    gone; none: not known yet) or do not take ranks by their ids (``not_addressable``:
    ``addressable``, or ``takes_ranks`` false: D refused a rank named to it), or the rank's
    own last numbers show less room than the turn needs beyond its retained turn
    (``rank_full``: ``rank_room_tokens`` < ``needed_tokens``; ``None``: unknown, named) or a
    queue (``rank_busy``: ``rank_waiting`` requests waiting for capacity there, by D's
    gauges), or the rank no longer holds the turn (``released``: ``held`` false, D released
    it or its time ran out: a pinned turn would queue on one rank while another idles,
    probe 17)."""
    if entry_engine_id is None:
        return RankChoice(None, "no_entry")
    rank = dp_rank(entry_engine_id)
    if rank is None:
        return RankChoice(None, "not_data_parallel")
    if not any(same_group(engine, entry_engine_id) for engine in node_engines):
        return RankChoice(None, "restarted")
    if not takes_ranks or not addressable(node_engines):
        return RankChoice(None, "not_addressable")
    if not held:
        return RankChoice(None, "released")
    if rank_room_tokens is not None and rank_room_tokens < needed_tokens:
        return RankChoice(None, "rank_full")
    if rank_waiting:
        return RankChoice(None, "rank_busy")
    return RankChoice(rank, "affinity")
