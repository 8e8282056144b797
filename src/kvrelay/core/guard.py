"""The exact prefix guard: which of D's retained blocks P may load for a prompt.

vLLM's P loads ``min(remote_num_tokens, prompt) - local hits`` tokens of D's KV blob for blob,
without comparing tokens: an edited earlier message, a different chat template or a wrong
candidate would silently corrupt the answer. The guard proves, with D's ``TokenFingerprint``
(computed by D from its own token ids), how many leading prompt tokens equal what D holds,
and cuts the pull to that many: ``check_pull``. It runs where the tokens are:

* in kvrelay's connector on P, on the engine's own ``prompt_token_ids``, just before the
  scheduler asks how many tokens to load (``guard_params`` rewrites the request's params);
* in the router, only in its fallback mode for P nodes that run stock vLLM (prompt ids from
  P's ``/tokenize``).

Both call the same function, so the rule has one home. Contracts of ``PullCheck``: ``blocks``
is set only when ``reason == "pull"``; it then claims ``usable_tokens`` tokens, never more
than the verified prefix nor the prompt minus its last token (P computes that one to sample),
and holds exactly the blocks those tokens need (``RemoteBlocks.capped``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec
from msgspec.structs import replace

from kvrelay.core.fingerprint import (
    TokenFingerprint,
    verifiable_tokens,
    verified_prefix_tokens,
)
from kvrelay.core.params import (
    FINGERPRINT_KEY,
    VERIFIED_TOKENS_KEY,
    KVParamsError,
    RemoteBlocks,
    parse_remote_blocks,
)

GuardReason = Literal[
    "pull",
    "prefix_mismatch",
    "below_threshold",
    "partial_reuse_unsafe",
    "no_fingerprint",
    "invalid_params",
]


class PullCheck(msgspec.Struct, frozen=True):
    """What P may load of D's blocks for one prompt, and why (module docstring)."""

    reason: GuardReason
    verified_tokens: int = 0
    usable_tokens: int = 0
    blocks: RemoteBlocks | None = None


def check_pull(
    blocks: RemoteBlocks,
    prompt_token_ids: Sequence[int],
    *,
    threshold: int,
    block_size: int | None = None,
) -> PullCheck:
    """The verified, capped pull of ``blocks`` for ``prompt_token_ids``.

    ``block_size`` is the reader's knowledge of D's block size; ``blocks.block_size`` (as D
    declared it) wins when set. Below ``threshold`` (or zero) usable tokens nothing is
    loaded: ``prefix_mismatch`` when a comparison failed, ``below_threshold`` when all
    compared tokens matched but too few could be compared.
    """
    fingerprint = blocks.fingerprint
    if fingerprint is None:
        return PullCheck("no_fingerprint")
    verified = min(verified_prefix_tokens(fingerprint, prompt_token_ids), blocks.num_tokens)
    usable = min(verified, len(prompt_token_ids) - 1)
    if usable <= 0 or usable < threshold:
        diverged = verified < verifiable_tokens(fingerprint, len(prompt_token_ids))
        return PullCheck("prefix_mismatch" if diverged else "below_threshold", verified)
    size = blocks.block_size or block_size
    if usable < blocks.num_tokens and size is None:
        return PullCheck("partial_reuse_unsafe", verified)
    try:
        capped = blocks.capped(usable, size)
    except ValueError:
        return PullCheck("partial_reuse_unsafe", verified)
    return PullCheck("pull", verified, usable, capped)


def loaded_outcome(
    fingerprint: TokenFingerprint, num_prompt_tokens: int, verified_tokens: int, threshold: int
) -> GuardReason:
    """What P's connector did with a pull, from the verified count it reported: ``pull``, or
    why it loaded nothing (the reasons ``check_pull`` would have given)."""
    usable = min(verified_tokens, num_prompt_tokens - 1)
    if usable > 0 and usable >= threshold:
        return "pull"
    diverged = verified_tokens < verifiable_tokens(fingerprint, num_prompt_tokens)
    return "prefix_mismatch" if diverged else "below_threshold"


def guard_params(
    params: Mapping[str, object],
    prompt_token_ids: Sequence[int],
    *,
    threshold: int,
    block_size: int | None,
) -> tuple[dict[str, object], PullCheck]:
    """P's request params after the guard, for kvrelay's connector (and the fake engine).

    Only a request carrying D's retained params and a fingerprint is changed. A verified pull
    becomes D's params capped to the verified prefix; anything else keeps D's block list but
    claims zero tokens, so vLLM loads nothing and still notifies D, which frees the blocks.
    ``kvrelay_verified_tokens`` is added either way (P reports it in its answer). Params
    without a fingerprint are returned unchanged with reason ``no_fingerprint``: P then
    behaves as stock vLLM, which is what a router in ``/tokenize`` mode expects.
    """
    if not params.get("do_remote_decode") or not params.get("remote_block_ids"):
        return dict(params), PullCheck("no_fingerprint")
    if params.get(FINGERPRINT_KEY) is None:
        return dict(params), PullCheck("no_fingerprint")
    try:
        blocks = parse_remote_blocks(params)
    except KVParamsError:
        out = dict(params)
        out["remote_num_tokens"] = 0
        out.pop(FINGERPRINT_KEY, None)
        return out, PullCheck("invalid_params")
    check = check_pull(blocks, prompt_token_ids, threshold=threshold, block_size=block_size)
    sent = check.blocks if check.blocks is not None else _nothing(blocks)
    out = sent.to_vllm_json()
    out[VERIFIED_TOKENS_KEY] = check.verified_tokens
    return out, check


def _nothing(blocks: RemoteBlocks) -> RemoteBlocks:
    return replace(blocks, num_tokens=0)
