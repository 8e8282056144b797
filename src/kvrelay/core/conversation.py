"""What the router remembers between turns of one conversation.

After D decodes turn N (bidirectional mode) it keeps the KV of prompt + generated tokens for
``decoder_kv_blocks_ttl`` seconds and answers with ``kv_transfer_params`` describing those
blocks. A ``ConversationEntry`` records them with a fingerprint of the tokens they hold and a
deadline on the router's own monotonic clock, so turn N+1 can decide whether P may pull them.

Entries are single-use: D frees the blocks after one read (or at its TTL), so once a pull
has been sent the entry must be dropped, whatever the outcome of that turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.core.fingerprint import DEFAULT_CHUNK_TOKENS, TokenFingerprint, fingerprint_tokens
from kvrelay.core.params import RemoteBlocks

DEFAULT_DECODER_KV_BLOCKS_TTL_S = 480.0
"""vLLM's default ``decoder_kv_blocks_ttl``."""

DEFAULT_EXPIRY_SAFETY_MARGIN_S = 10.0
"""Covers the gap between D starting its TTL and the router seeing the response."""


@dataclass(frozen=True)
class ConversationKey:
    """A conversation, scoped to a tenant so ids from different tenants never collide.

    ``conversation_id`` comes from the client and may be sensitive: log ``hashed()`` instead.
    """

    tenant: str
    conversation_id: str

    def __post_init__(self) -> None:
        if not self.conversation_id:
            raise ValueError("conversation_id must be non-empty")

    def hashed(self) -> str:
        """A short stable hex id for logs and metrics labels (not a secret: ids that are
        guessable stay guessable)."""
        h = hashlib.blake2b(digest_size=8, person=b"kvrelay-convkey")
        for part in (self.tenant, self.conversation_id):
            raw = part.encode("utf-8")
            h.update(len(raw).to_bytes(4, "little"))
            h.update(raw)
        return h.hexdigest()


@dataclass(frozen=True)
class ConversationEntry:
    """D's retained KV for the latest turn of one conversation.

    ``blocks`` are D's ``kv_transfer_params`` exactly as returned (``decode_to_prefill``).
    ``fingerprint`` covers the first ``num_tokens`` of prompt + generated tokens, which is
    never more than ``blocks.num_tokens`` (see ``entry_from_decode``). ``expires_at_s`` and
    ``created_at_s`` are on the router's monotonic clock; ``turn`` counts from 1.
    ``block_size`` is D's KV block size when known and consistent with ``blocks``; ``None``
    means the entry may only be reused whole.
    """

    decode_node_id: str
    blocks: RemoteBlocks
    fingerprint: TokenFingerprint
    expires_at_s: float
    created_at_s: float
    turn: int
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.blocks.direction != "decode_to_prefill":
            raise ValueError("a conversation entry needs decode_to_prefill blocks (held on D)")
        if self.fingerprint.num_tokens > self.blocks.num_tokens:
            raise ValueError("fingerprint covers more tokens than D holds")
        if self.turn < 1:
            raise ValueError(f"turn counts from 1, got {self.turn}")

    @property
    def decode_engine_id(self) -> str:
        """D's vLLM engine id when it retained the blocks; a different id now means D
        restarted and the blocks are gone."""
        return self.blocks.engine_id

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV D holds and which the fingerprint covers."""
        return self.fingerprint.num_tokens

    def seconds_left(self, now_s: float) -> float:
        return self.expires_at_s - now_s

    def is_expired(self, now_s: float) -> bool:
        return now_s >= self.expires_at_s


def entry_from_decode(
    *,
    decode_node_id: str,
    blocks: RemoteBlocks,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    now_s: float,
    turn: int = 1,
    ttl_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL_S,
    safety_margin_s: float = DEFAULT_EXPIRY_SAFETY_MARGIN_S,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    block_size: int | None = None,
) -> ConversationEntry:
    """Build the entry for a turn D just finished, at router time ``now_s``.

    D's ``remote_num_tokens`` is prompt + generated - 1 (the last sampled token has no KV), so
    exactly the first ``blocks.num_tokens`` ids of prompt + generated are fingerprinted. If
    fewer ids are known (e.g. a stream whose token ids were partly lost), only the known ones
    are fingerprinted and ``num_tokens`` shrinks to match: the router can then never ask P to
    pull KV for tokens it cannot verify. ``blocks`` is kept unchanged for diagnostics; the
    policy caps it before sending.

    ``ttl_s`` must be D's ``decoder_kv_blocks_ttl``; ``safety_margin_s`` is subtracted because
    D's clock started before the router saw the response. ``block_size`` is D's KV block size
    in tokens; without it (``None``) the entry can only be reused whole (see
    ``RemoteBlocks.capped``). A block size that does not match the number of blocks D
    reported for its tokens is dropped to ``None``, for the same reason.
    """
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    if not 0 <= safety_margin_s < ttl_s:
        raise ValueError(f"safety_margin_s must be in [0, ttl_s), got {safety_margin_s}")
    if blocks.direction != "decode_to_prefill":
        raise ValueError("entry_from_decode needs D's decode_to_prefill blocks")
    held = max(0, blocks.num_tokens)
    from_prompt = list(prompt_token_ids[:held])
    from_generated = list(generated_token_ids[: held - len(from_prompt)])
    fingerprint = fingerprint_tokens(from_prompt + from_generated, chunk_tokens=chunk_tokens)
    return ConversationEntry(
        decode_node_id=decode_node_id,
        blocks=blocks,
        fingerprint=fingerprint,
        expires_at_s=now_s + ttl_s - safety_margin_s,
        created_at_s=now_s,
        turn=turn,
        block_size=block_size if blocks_match(blocks, block_size) else None,
    )


def blocks_match(blocks: RemoteBlocks, block_size: int | None) -> bool:
    """Whether every group of ``blocks`` holds exactly ``cdiv(num_tokens, block_size)`` ids."""
    if block_size is None or block_size <= 0:
        return False
    need = -(-blocks.num_tokens // block_size)
    return all(len(group) == need for group in blocks.block_ids)
