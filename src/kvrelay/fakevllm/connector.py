"""NixlConnector's scheduler decisions (pull mode), as pure functions of a request's params.

Mirrors vLLM 0.32 ``NixlPullConnectorScheduler``:

* ``get_num_new_matched_tokens``: a D-side request (``do_remote_prefill``) loads every prompt
  token it has not cached locally; a P-side request carrying D's blocks
  (``do_remote_decode`` + ``remote_block_ids`` + engine/request/host/port) loads
  ``min(remote_num_tokens, prompt) - local prefix hit`` tokens, unless that is below
  ``kv_recompute_threshold`` (then it recomputes).
* ``update_state_after_alloc``: a P-side read of D's blocks needs ``bidirectional_kv_xfer``
  on P; when nothing is loaded but remote blocks were given (full local hit, below
  threshold), the remote side is still notified, which frees its blocks.
* ``request_finished``: P-side requests (``do_remote_decode``) hold their blocks under
  ``kv_lease_duration``; any other request with non-empty params is a D-side request and, in
  bidirectional mode only, retains its blocks for ``decoder_kv_blocks_ttl``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvrelay.core.params import KVParamsError, RemoteBlocks, parse_remote_blocks

KVRole = Literal["prefill", "decode", "none"]
PlanReason = Literal[
    "none",
    "pull",
    "local_hit",
    "below_threshold",
    "invalid_params",
    "bidirectional_off",
]
_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True)
class KVPlan:
    """What a request does with remote KV before computing.

    ``role``: ``prefill`` for a P-side request (it will hold its blocks under a lease),
    ``decode`` for a D-side one (retains for the TTL in bidirectional mode), ``none`` without
    params. ``source``: the remote blocks to read from or, with ``external_tokens == 0``, only
    to notify (which frees them). ``external_tokens``: tokens to load.
    """

    role: KVRole
    reason: PlanReason
    source: RemoteBlocks | None = None
    external_tokens: int = 0


def kv_role(params: Mapping[str, object] | None) -> KVRole:
    """The side ``request_finished`` puts a request on."""
    if not params:
        return "none"
    return "prefill" if params.get("do_remote_decode") else "decode"


def plan_kv(
    params: Mapping[str, object] | None,
    num_prompt_tokens: int,
    local_hit_tokens: int,
    *,
    bidirectional: bool,
    recompute_threshold: int,
) -> KVPlan:
    """Decide the KV load of one request, exactly as vLLM's pull scheduler does."""
    role = kv_role(params)
    if params is None or role == "none":
        return KVPlan(role, "none")
    if params.get("do_remote_prefill"):
        source = _source(params, "prefill_to_decode")
        if source is None:
            return KVPlan(role, "invalid_params")
        count = num_prompt_tokens - local_hit_tokens
        if count > 0:
            return KVPlan(role, "pull", source, count)
        return KVPlan(role, "local_hit", source, 0)
    if not (
        params.get("do_remote_decode")
        and params.get("remote_block_ids")
        and all(key in params for key in _REQUIRED)
    ):
        return KVPlan(role, "none")
    source = _source(params, "decode_to_prefill")
    if source is None:
        return KVPlan(role, "invalid_params")
    if not bidirectional:
        return KVPlan(role, "bidirectional_off")
    count = min(source.num_tokens, num_prompt_tokens) - local_hit_tokens
    if count <= 0:
        return KVPlan(role, "local_hit", source, 0)
    if recompute_threshold > 0 and count < recompute_threshold:
        return KVPlan(role, "below_threshold", source, 0)
    return KVPlan(role, "pull", source, count)


def _source(params: Mapping[str, object], direction: str) -> RemoteBlocks | None:
    if not params.get("remote_block_ids") or not all(key in params for key in _REQUIRED):
        return None
    fixed = dict(params)
    fixed["do_remote_prefill"] = direction == "prefill_to_decode"
    fixed["do_remote_decode"] = direction == "decode_to_prefill"
    if fixed.get("remote_num_tokens") is None:
        fixed["remote_num_tokens"] = 0
    try:
        return parse_remote_blocks(fixed)
    except KVParamsError:
        return None
