"""What follows from a turn's decision and from each way a node call can fail.

The router's handler only carries these out; the rules live here, next to ``decide_turn``:

* ``entry_fate``: which decisions prove the looked-up entry useless (drop it; after a D
  restart, every entry of the dead engine) and which consume it (claim before sending).
* ``prefill_retry`` / ``decode_retry``: what a failed P or D call allows. P failures are
  retried once, as a recompute, on another P; a client fault (4xx) never. A D failure is
  retried once on another D; P's params may be sent again only if D provably never
  started (connection refused, HTTP 503), else P must compute again first: vLLM does not
  refuse a second read of freed blocks, it would silently read reused memory.
* ``spent_read_grace_s``: how long a pull's read of D's blocks counts as under way after
  P's call ended without proof that P read nothing more (an error answer: briefly; a
  timeout, a reset, the client gone: until P has surely aborted it).
* ``learn_prefill``: which sample teaches which cost: a pull that P served from D's KV
  teaches the pull line (the time left after the predicted P call for the suffix, its
  fixed cost included); anything else teaches the prefill line.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec.structs import replace

from kvrelay.core.costs import CostEstimates
from kvrelay.core.policy import TurnDecision

FailureKind = Literal["connect", "timeout", "closed", "status", "protocol"]
"""How a call to a node failed: never reached it (``connect``), no answer in time
(``timeout``), connection broke (``closed``), an HTTP error status (``status``), or a 2xx
answer that is not what vLLM sends (``protocol``)."""

DecodeRetry = Literal["none", "same_params", "fresh_prefill"]

_INVALIDATING = frozenset({"expired", "near_expiry", "node_down", "engine_restarted",
                           "released"})
_BLOCKS_GONE = frozenset({"node_down", "engine_restarted", "released"})
"""Dropping such an entry orders no release: D lost the blocks, or freed them already."""


class EntryFate(msgspec.Struct, frozen=True):
    """What to do with the entry a decision was made on."""

    claim: bool
    drop: bool
    purge_engine: bool
    reason: str
    release: bool = False
    """Whether the drop orders D to release the blocks (it may still hold them)."""


def entry_fate(decision: TurnDecision) -> EntryFate:
    """``pull`` claims (single use); ``expired``/``near_expiry``/``node_down``/
    ``engine_restarted``/``released`` drop it (and a restart purges every entry of that
    engine), ordering D to release it unless D's blocks are gone already; other decisions
    leave it for a later turn (it is superseded, and released, when this turn commits)."""
    reason = decision.reason
    drop = reason in _INVALIDATING
    return EntryFate(
        claim=decision.action == "pull",
        drop=drop,
        purge_engine=reason == "engine_restarted",
        reason=reason,
        release=drop and reason not in _BLOCKS_GONE,
    )


def client_fault(kind: FailureKind, status: int | None) -> bool:
    """A node's 4xx: the request itself is bad; no other node will answer differently."""
    return kind == "status" and status is not None and 400 <= status < 500


def prefill_retry(kind: FailureKind, status: int | None, attempt: int) -> bool:
    """Whether a failed P call may be retried (once, on another P). A pull is retried as a
    pull only when P never received it (``params_spent`` is false): otherwise P may have
    read D's retained blocks, which frees them, and the retry recomputes."""
    return attempt == 0 and not client_fault(kind, status)


SPENT_READ_GRACE_S = 10.0
"""A pull whose P call ended without an answer (a timeout, a reset, the client gone) may
still be reading D's blocks: vLLM aborts a request whose connection closed at its next step,
and until that lands a prefill that used the blocks could still fill P's prefix cache. So D
is not told it may free them for this long after the call ended; then it may (a read kept
open for good made D's asks under pressure wait for D's TTL)."""

ANSWERED_READ_GRACE_S = 1.0
"""The same after P *answered* the pull with an error: its request is over, so nothing of
it uses D's blocks any more; a transfer it started and abandoned may still be landing in
its own freed blocks for a moment."""


def spent_read_grace_s(kind: FailureKind) -> float:
    """How long a spent pull (``params_spent``) still counts as reading D's blocks after the
    P call failed this way."""
    return ANSWERED_READ_GRACE_S if kind == "status" else SPENT_READ_GRACE_S


def params_spent(kind: FailureKind, status: int | None) -> bool:
    """Whether D may have read P's blocks (or tried and failed), so P's params must not be
    sent again: anything D received, except a 503 (an engine that is overloaded or not
    ready schedules nothing). vLLM answers 500 after a failed KV read."""
    return kind != "connect" and not (kind == "status" and status == 503)


def decode_retry(kind: FailureKind, status: int | None, attempt: int) -> DecodeRetry:
    """What a D failure before the client saw a byte allows (module docstring)."""
    if attempt > 0 or client_fault(kind, status):
        return "none"
    return "fresh_prefill" if params_spent(kind, status) else "same_params"


def learn_prefill(
    costs: CostEstimates,
    *,
    pulled: bool,
    prompt_tokens: int,
    cached_tokens: int,
    seconds: float,
) -> CostEstimates:
    """The estimates after P computed ``prompt_tokens`` with ``cached_tokens`` not computed
    (pulled from D when ``pulled``, else local prefix hits) in ``seconds``."""
    n = max(0, prompt_tokens)
    cached = min(max(cached_tokens, 0), n)
    if pulled and cached > 0:
        prefill_s = costs.prefill.call_seconds(n - cached, context_tokens=cached)
        transfer = costs.transfer.observe(num_tokens=cached, seconds=max(0.0, seconds - prefill_s))
        return replace(costs, transfer=transfer)
    prefill = costs.prefill.observe(num_tokens=n - cached, context_tokens=cached, seconds=seconds)
    return replace(costs, prefill=prefill)
