"""The turn policy: pull the previous turn's KV from D, recompute it on P, or go direct to D.

``decide_turn`` is a pure function of what the router knows when a turn arrives. Checks run
in this order; the first that fails decides, so ``reason`` names the most basic obstacle:

1. ``no_conversation_id`` – the request carries no conversation key: recompute.
2. ``no_entry`` – no retained KV is known for the conversation: recompute.
3. ``expired`` – ``now_s >= entry.expires_at_s``: D has freed (or is about to free) the blocks.
4. ``near_expiry`` – fewer than ``near_expiry_s`` seconds left: P would pull after queueing
   and could race D's TTL, and a pull of freed blocks fails the turn.
5. ``node_down`` – the D that holds the blocks is down or unknown to the router.
6. ``engine_restarted`` – D's current engine id differs from the one that retained the
   blocks (an unknown current id, ``None``, is not treated as a restart).
7. Prefix guard (hard requirement): only the prefix of the new prompt proven equal to the
   held tokens by the fingerprint may be reused; ``remote_num_tokens`` is capped at it.
   If it is below ``kv_recompute_threshold`` (or zero) the turn recomputes with
   ``prefix_mismatch`` when a comparison failed (the prompt diverged, e.g. an edited earlier
   message) or ``below_threshold`` when everything compared matched but there is too little
   to reuse (short context, short prompt).
8. ``direct`` – if enabled and the prompt's new suffix is at most ``direct_max_new_tokens``,
   the whole turn goes to the holding D, which reuses its local prefix cache; nothing is sent
   over NIXL.
9. ``cost_model`` – recompute when ``pull_s(verified) * pull_cost_factor`` exceeds
   ``prefill_s(verified)``.
10. ``partial_reuse_unsafe`` – the reusable part (the verified prefix, at most the prompt
   minus its last token, which P must compute to sample) is shorter than what D holds, and
   D's block size is unknown: cutting the block list needs it (``RemoteBlocks.capped``),
   and vLLM would otherwise pair P's blocks with the wrong remote blocks. Else ``pull``.

``state_unavailable`` is never returned here: the router uses it for a turn whose entry could
not be looked up (shared store down or slow), which it recomputes.

Contracts: ``blocks_to_send`` is set only for ``pull``, never claims more tokens than the
verified prefix (nor the whole prompt), and holds exactly the blocks of the tokens it
claims; ``reused_tokens`` is zero for ``recompute``. The predictions compare the two ways to
obtain the reusable prefix's KV (the suffix costs the same either way) and are zero when
the policy stopped before verifying. A ``pull`` consumes the entry (single-use); the
caller must drop it once the request is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvrelay.core.conversation import ConversationEntry, ConversationKey
from kvrelay.core.costs import CostEstimates
from kvrelay.core.fingerprint import verifiable_tokens, verified_prefix_tokens
from kvrelay.core.params import RemoteBlocks
from kvrelay.core.selection import NodeState

TurnAction = Literal["pull", "recompute", "direct"]

TurnReason = Literal[
    "no_conversation_id",
    "no_entry",
    "expired",
    "near_expiry",
    "node_down",
    "engine_restarted",
    "prefix_mismatch",
    "below_threshold",
    "cost_model",
    "partial_reuse_unsafe",
    "pull",
    "direct",
    "state_unavailable",
]

DEFAULT_KV_RECOMPUTE_THRESHOLD = 64
"""vLLM's default ``kv_recompute_threshold``: smaller pulls are recomputed by P anyway."""


@dataclass(frozen=True)
class PolicyConfig:
    """Operator knobs of the turn policy.

    ``pull_cost_factor`` scales the predicted pull time before it is compared with the
    predicted recompute time: above 1 biases towards recomputing, below 1 towards pulling.
    """

    kv_recompute_threshold: int = DEFAULT_KV_RECOMPUTE_THRESHOLD
    near_expiry_s: float = 15.0
    direct_enabled: bool = False
    direct_max_new_tokens: int = 256
    pull_cost_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_recompute_threshold < 0:
            raise ValueError("kv_recompute_threshold cannot be negative")
        if self.near_expiry_s < 0:
            raise ValueError("near_expiry_s cannot be negative")
        if self.direct_max_new_tokens < 0:
            raise ValueError("direct_max_new_tokens cannot be negative")
        if self.pull_cost_factor <= 0:
            raise ValueError("pull_cost_factor must be positive")


@dataclass(frozen=True)
class TurnDecision:
    """What to do with one turn, and why (see the module docstring for the contracts)."""

    action: TurnAction
    reason: TurnReason
    verified_tokens: int = 0
    reused_tokens: int = 0
    blocks_to_send: RemoteBlocks | None = None
    predicted_transfer_s: float = 0.0
    predicted_prefill_s: float = 0.0

    @property
    def consumes_entry(self) -> bool:
        """Whether the conversation's entry is spent once this decision is carried out."""
        return self.action == "pull"


def decide_turn(
    *,
    key: ConversationKey | None,
    entry: ConversationEntry | None,
    prompt_token_ids: Sequence[int],
    now_s: float,
    decode_node: NodeState | None,
    config: PolicyConfig,
    costs: CostEstimates,
) -> TurnDecision:
    """Decide how to serve a turn whose full prompt is ``prompt_token_ids``.

    ``decode_node`` is the router's current state of ``entry.decode_node_id`` (``None`` if the
    router no longer knows that node). ``costs`` are the estimates for the P that would do the
    work and the D -> P link; the caller picks them.
    """
    if key is None:
        return TurnDecision("recompute", "no_conversation_id")
    if entry is None:
        return TurnDecision("recompute", "no_entry")
    if entry.is_expired(now_s):
        return TurnDecision("recompute", "expired")
    if entry.seconds_left(now_s) < config.near_expiry_s:
        return TurnDecision("recompute", "near_expiry")
    if decode_node is not None and decode_node.node_id != entry.decode_node_id:
        raise ValueError(
            f"decode_node {decode_node.node_id!r} is not the entry's {entry.decode_node_id!r}"
        )
    if decode_node is None or not decode_node.up:
        return TurnDecision("recompute", "node_down")
    if decode_node.engine_id is not None and decode_node.engine_id != entry.decode_engine_id:
        return TurnDecision("recompute", "engine_restarted")

    verified = verified_prefix_tokens(entry.fingerprint, prompt_token_ids)
    usable = min(verified, len(prompt_token_ids) - 1)
    transfer_s = costs.pull_s(max(0, usable))
    prefill_s = costs.prefill_s(max(0, usable))

    def recompute(reason: TurnReason) -> TurnDecision:
        return TurnDecision(
            "recompute",
            reason,
            verified_tokens=verified,
            predicted_transfer_s=transfer_s,
            predicted_prefill_s=prefill_s,
        )

    if usable <= 0 or usable < config.kv_recompute_threshold:
        diverged = verified < verifiable_tokens(entry.fingerprint, len(prompt_token_ids))
        return recompute("prefix_mismatch" if diverged else "below_threshold")
    new_tokens = len(prompt_token_ids) - verified
    if config.direct_enabled and new_tokens <= config.direct_max_new_tokens:
        return TurnDecision(
            "direct",
            "direct",
            verified_tokens=verified,
            reused_tokens=usable,
            predicted_transfer_s=transfer_s,
            predicted_prefill_s=prefill_s,
        )
    if transfer_s * config.pull_cost_factor > prefill_s:
        return recompute("cost_model")
    if usable < entry.blocks.num_tokens and entry.block_size is None:
        return recompute("partial_reuse_unsafe")
    return TurnDecision(
        "pull",
        "pull",
        verified_tokens=verified,
        reused_tokens=usable,
        blocks_to_send=entry.blocks.capped(usable, entry.block_size),
        predicted_transfer_s=transfer_s,
        predicted_prefill_s=prefill_s,
    )
