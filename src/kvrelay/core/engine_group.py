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
"""

from __future__ import annotations

import re

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
