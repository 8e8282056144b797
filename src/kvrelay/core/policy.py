"""The turn policy: pull the previous turn's KV from D, recompute it on P, or go direct to D.

``decide_turn`` is a pure function of what the router knows when a turn arrives. Checks run
in this order; the first that fails decides, so ``reason`` names the most basic obstacle:

1. ``no_entry`` – the request continues no retained entry (first turn, nothing retained,
   lost a concurrent claim): recompute.
2. ``expired`` – ``now_s >= entry.expires_at_s``, or D's retention sync said the turn's own
   retention time ran out (cause ``expired``): D has freed (or is about to free) the blocks.
   Time first: a turn that came back after its retention time is told so, whoever noticed.
3. ``released`` – D said it freed the blocks early, before any P read them (its retention
   sync: memory pressure, headroom, the router's order): recompute.
4. ``near_expiry`` – fewer than ``near_expiry_s`` seconds left: P would pull after queueing
   and could race D's TTL.
5. ``node_down`` – the D that holds the blocks is down or unknown to the router.
6. ``engine_restarted`` – D's current engine id is of another group than the one that
   retained the blocks (an unknown current id, ``None``, is not treated as a restart; another
   rank of a data-parallel D is the same group: ``core.engine_group``).
7. ``too_long`` – the request is one vLLM refuses for its length: the client's output
   budget (``max_output_tokens``) alone is over D's ``max_model_len``, or the prompt (when
   its exact ids are known) leaves it no token to generate. Not on an estimated length:
   estimates run high as well as low, and one too high recomputed follow-ups vLLM accepts
   (probe 13, H2: from 68% of the limit). (A budget that only
   does not fit *with* the prompt is not refused: vLLM 0.32 and 0.33 clamp it.) A pull
   would spend the entry on it: P, asked for one token, accepts the budget and reads D's
   blocks, which frees them, before D refuses; and the claim is spent even when P refuses
   the prompt. So the client's corrected retry would find nothing. Recompute (the client
   gets vLLM's own 400), and keep the entry for that retry.
8. The prefix guard. With the prompt's exact token ids (``Prompt.token_ids``: the fallback
   for P nodes without kvrelay's connector, ids from P's ``/tokenize``) the router runs the
   guard itself (``core.guard.check_pull``): ``prefix_mismatch`` / ``below_threshold`` when
   too little is proven. Without them the router decides from estimates (the entry's held
   tokens, the request's new bytes): ``below_threshold`` when even a full match would be too
   small; P's connector proves every token before loading and cuts the pull itself.
9. ``direct`` – if enabled and the new suffix is at most ``direct_max_new_tokens``, the
   whole turn goes to the holding D, which reuses its local prefix cache.
10. ``cost_model`` – recompute when ``pull_s(reused) * pull_cost_factor`` exceeds
   ``prefill_s(reused)``.
11. ``partial_reuse_unsafe`` – (exact mode) the verified part is shorter than what D holds
    and D's block size is unknown, so the block list cannot be cut. Else ``pull``.

``state_unavailable`` and ``unverifiable`` are never returned here: the router uses them for
a turn whose entry could not be looked up (shared store down or slow), and for one whose pull
nothing could prove (a P without kvrelay's connector, an API ``/tokenize`` cannot render);
it recomputes both.

Contracts: ``blocks_to_send`` is set only for ``pull``; in exact mode it never claims more
tokens than the verified prefix (nor the whole prompt) and holds exactly their blocks; in
estimate mode it is D's whole retained params with the fingerprint (and D's block size when
known), for P's connector to verify and cut. ``reused_tokens`` is what the decision expects
to reuse (zero for ``recompute``); the exact count comes back from P. A ``pull`` consumes
the entry (single-use); the caller must claim it before sending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.costs import CostEstimates
from kvrelay.core.engine_group import same_group
from kvrelay.core.guard import check_pull
from kvrelay.core.params import RemoteBlocks
from kvrelay.core.selection import NodeState

TurnAction = Literal["pull", "recompute", "direct"]

TurnReason = Literal[
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
    "released",
    "too_long",
    "unverifiable",
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


class Prompt(msgspec.Struct, frozen=True):
    """What the router knows of a turn's prompt when it decides.

    ``token_ids``: the exact engine ids (fallback mode: P's ``/tokenize``, or a completions
    prompt given as ids), else ``None``. ``est_tokens``: its length (exact when ids are
    known); ``est_new_tokens``: tokens after what the found entry covers (estimated from
    request bytes, see ``ConversationEntry.tokens_per_byte``).
    """

    est_tokens: int
    est_new_tokens: int = 0
    token_ids: Sequence[int] | None = None


class TurnDecision(msgspec.Struct, frozen=True):
    """What to do with one turn, and why (see the module docstring for the contracts).

    ``exact`` says whether the guard ran in the router (``verified_tokens`` is then the
    proven prefix); otherwise P's connector runs it and reports the count.
    """

    action: TurnAction
    reason: TurnReason
    verified_tokens: int = 0
    reused_tokens: int = 0
    blocks_to_send: RemoteBlocks | None = None
    predicted_transfer_s: float = 0.0
    predicted_prefill_s: float = 0.0
    exact: bool = False

    @property
    def consumes_entry(self) -> bool:
        """Whether the conversation's entry is spent once this decision is carried out."""
        return self.action == "pull"


def decide_turn(
    *,
    entry: ConversationEntry | None,
    prompt: Prompt,
    now_s: float,
    decode_node: NodeState | None,
    config: PolicyConfig,
    costs: CostEstimates,
    max_output_tokens: int | None = None,
) -> TurnDecision:
    """Decide how to serve a turn (module docstring).

    ``decode_node`` is the router's current state of ``entry.decode_node_id`` (``None`` if the
    router no longer knows that node). ``costs`` are the estimates for the P that would do the
    work and the D -> P link; the caller picks them. ``max_output_tokens``: the client's
    output budget (``None``: not given).
    """
    if entry is None:
        return TurnDecision("recompute", "no_entry")
    if entry.is_expired(now_s) or entry.released == "expired":
        return TurnDecision("recompute", "expired")
    if entry.released is not None:
        return TurnDecision("recompute", "released")
    if entry.seconds_left(now_s) < config.near_expiry_s:
        return TurnDecision("recompute", "near_expiry")
    if decode_node is not None and decode_node.node_id != entry.decode_node_id:
        raise ValueError(
            f"decode_node {decode_node.node_id!r} is not the entry's {entry.decode_node_id!r}"
        )
    if decode_node is None or not decode_node.up:
        return TurnDecision("recompute", "node_down")
    if decode_node.engine_id is not None \
            and not same_group(decode_node.engine_id, entry.decode_engine_id):
        return TurnDecision("recompute", "engine_restarted")  # not another rank of D's
    limit = decode_node.max_model_len
    if limit is not None and ((max_output_tokens or 0) > limit or (
            prompt.token_ids is not None and len(prompt.token_ids) >= limit)):
        return TurnDecision("recompute", "too_long")

    exact = prompt.token_ids is not None
    threshold = config.kv_recompute_threshold
    if prompt.token_ids is not None:
        check = check_pull(
            entry.blocks, prompt.token_ids, threshold=threshold, block_size=entry.block_size
        )
        verified = check.verified_tokens
        usable = min(verified, len(prompt.token_ids) - 1)
        new_tokens = len(prompt.token_ids) - verified
    else:
        verified = 0
        usable = min(entry.num_tokens, prompt.est_tokens - 1)
        new_tokens = prompt.est_new_tokens
    transfer_s = costs.pull_s(max(0, usable))
    prefill_s = costs.prefill_s(max(0, usable))

    def recompute(reason: TurnReason) -> TurnDecision:
        return TurnDecision(
            "recompute",
            reason,
            verified_tokens=verified,
            predicted_transfer_s=transfer_s,
            predicted_prefill_s=prefill_s,
            exact=exact,
        )

    if prompt.token_ids is not None and check.reason in ("prefix_mismatch", "below_threshold"):
        return recompute(check.reason)
    if usable <= 0 or usable < threshold:
        return recompute("below_threshold")
    if config.direct_enabled and new_tokens <= config.direct_max_new_tokens:
        return TurnDecision(
            "direct",
            "direct",
            verified_tokens=verified,
            reused_tokens=usable,
            predicted_transfer_s=transfer_s,
            predicted_prefill_s=prefill_s,
            exact=exact,
        )
    if transfer_s * config.pull_cost_factor > prefill_s:
        return recompute("cost_model")
    if prompt.token_ids is not None:
        if check.blocks is None:
            return recompute("partial_reuse_unsafe")
        blocks = check.blocks
    else:
        blocks = entry.blocks
    return TurnDecision(
        "pull",
        "pull",
        verified_tokens=verified,
        reused_tokens=usable,
        blocks_to_send=blocks,
        predicted_transfer_s=transfer_s,
        predicted_prefill_s=prefill_s,
        exact=exact,
    )
