"""What the router remembers between turns of one conversation.

After D decodes turn N (bidirectional mode) it keeps the KV of prompt + generated tokens for
``decoder_kv_blocks_ttl`` seconds and answers with ``kv_transfer_params`` describing those
blocks, including (kvrelay's connector on D) the ``TokenFingerprint`` of the tokens held. A
``ConversationEntry`` records them with a deadline on the router's own monotonic clock, so
turn N+1 can decide whether P may pull them. Where an entry is stored (its scope, anchor and
continuation) is ``core.identity``'s business; the entry is only the value.

Entries are single-use: D frees the blocks after one read (or at its TTL), so once a pull
has been sent the entry must be dropped, whatever the outcome of that turn.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec
from msgspec.structs import replace

from kvrelay.core.fingerprint import TokenFingerprint
from kvrelay.core.identity import scope_of
from kvrelay.core.params import RemoteBlocks

DEFAULT_DECODER_KV_BLOCKS_TTL_S = 480.0
"""vLLM's default ``decoder_kv_blocks_ttl``."""

GapKind = Literal["tool", "user"]
"""What a conversation waits for after a turn: its client's tools (the answer ended in a
tool call: the client runs them and comes back within their run time) or its user (a reply:
the user thinks, or never comes back)."""

DEFAULT_EXPIRY_SAFETY_MARGIN_S = 10.0
"""Covers the gap between D starting its TTL and the router seeing the response."""

TAG_KEY_BYTES = 32
"""Size of the key conversation tags are made with (``conversation_tag``)."""


class ConversationKey(msgspec.Struct, frozen=True):
    """A client-given conversation id, scoped to a tenant so ids of different tenants never
    collide. ``conversation_id`` may be sensitive: log ``hashed()`` instead."""

    tenant: str
    conversation_id: str

    def __post_init__(self) -> None:
        if not self.conversation_id:
            raise ValueError("conversation_id must be non-empty")

    def hashed(self, tag_key: bytes) -> str:
        """The tag the router shows for this id (sent by the client, no end user or salt)
        in logs, ``/stats`` and the turn log: ``id_tag`` of its scope."""
        return id_tag(tag_key, scope_of(self.tenant, self.conversation_id))


def id_tag(tag_key: bytes, scope: bytes) -> str:
    """The tag of an explicit id's conversation, from its lookup scope."""
    return conversation_tag(tag_key, b"id", scope)


def conversation_tag(tag_key: bytes, *parts: bytes) -> str:
    """A 16-hex-digit tag naming a conversation in logs, ``/stats`` and the turn log.

    Keyed (a BLAKE2b MAC under ``tag_key``, ``TAG_KEY_BYTES``): the parts are often
    guessable (a session id, a first message), and an unkeyed hash would let anyone who
    reads a tag confirm a guess offline. The router's key is random per process unless the
    deployment sets one (``tag_key``) so that replicas and restarts agree."""
    if len(tag_key) != TAG_KEY_BYTES:
        raise ValueError(f"a tag key has {TAG_KEY_BYTES} bytes, got {len(tag_key)}")
    h = hashlib.blake2b(digest_size=8, key=tag_key, person=b"kvrelay-convkey")
    for raw in parts:
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.hexdigest()


class ConversationEntry(msgspec.Struct, frozen=True):
    """D's retained KV for the latest turn of one conversation.

    ``blocks`` are D's ``kv_transfer_params`` (``decode_to_prefill``) with the fingerprint
    of the tokens they hold (``blocks.fingerprint``, never covering more than
    ``blocks.num_tokens``). ``expires_at_s`` and ``created_at_s`` are on the router's
    monotonic clock; ``turn`` counts from 1. ``block_size`` is D's KV block size when known
    and consistent with ``blocks``; ``None`` means the entry may only be reused whole.
    ``num_bytes`` is the size of the request and answer the entry covers (the ratio to its
    tokens turns request bytes into token estimates); ``conversation`` is the tag the
    conversation's turns share (``conversation_tag``). ``released`` is set once D said it
    freed the blocks before any P read them (a ``core.retention_sync.ReleaseCause``): such an
    entry is never pulled (the policy answers ``released``).

    ``release_at_expiry``: D keeps the blocks past the entry's expiry (the router shortened
    the turn's retention after D answered, so ``expires_at_s`` is earlier than D's own
    deadline), so the index orders D to release them once the entry expires on the router's
    clock (``router.index.ConversationIndex``, release orders). False (the default): D frees
    them at its own deadline, which the entry's expiry tracks.

    ``waits_for``: how D's answer ended (``GapKind``): the gap until the conversation's next
    turn is learned per kind (``core.retention_time``).

    ``context``: the turn's ``RequestIdentity.context`` (its API, model or adapter, tools,
    template): a bound id's edited history continues its latest entry only under the same
    context (``b""``: unknown, an entry stored before the field, never continued so).
    """

    decode_node_id: str
    blocks: RemoteBlocks
    expires_at_s: float
    created_at_s: float
    turn: int
    conversation: str
    num_bytes: int = 0
    block_size: int | None = None
    released: str | None = None
    release_at_expiry: bool = False
    waits_for: GapKind = "user"
    context: bytes = b""

    def __post_init__(self) -> None:
        if self.blocks.direction != "decode_to_prefill":
            raise ValueError("a conversation entry needs decode_to_prefill blocks (held on D)")
        fingerprint = self.blocks.fingerprint
        if fingerprint is None:
            raise ValueError("a conversation entry needs the fingerprint of the held tokens")
        if fingerprint.num_tokens > self.blocks.num_tokens:
            raise ValueError("fingerprint covers more tokens than D holds")
        if self.turn < 1:
            raise ValueError(f"turn counts from 1, got {self.turn}")

    @property
    def fingerprint(self) -> TokenFingerprint:
        assert self.blocks.fingerprint is not None
        return self.blocks.fingerprint

    @property
    def decode_engine_id(self) -> str:
        """D's vLLM engine id when it retained the blocks; a different id now means D
        restarted and the blocks are gone."""
        return self.blocks.engine_id

    @property
    def request_id(self) -> str:
        """D's request id for the retained blocks (what D's retention sync and the
        router's release orders name)."""
        return self.blocks.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV D holds and which the fingerprint covers."""
        return self.fingerprint.num_tokens

    def tokens_per_byte(self) -> float:
        """Tokens per request byte in this conversation (1/4 until known)."""
        if self.num_bytes <= 0 or self.num_tokens <= 0:
            return 0.25
        return self.num_tokens / self.num_bytes

    def seconds_left(self, now_s: float) -> float:
        return self.expires_at_s - now_s

    def is_expired(self, now_s: float) -> bool:
        return now_s >= self.expires_at_s


def new_entry(
    *,
    decode_node_id: str,
    blocks: RemoteBlocks,
    now_s: float,
    turn: int,
    conversation: str,
    num_bytes: int,
    ttl_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL_S,
    safety_margin_s: float = DEFAULT_EXPIRY_SAFETY_MARGIN_S,
    block_size: int | None = None,
    release_at_expiry: bool = False,
    waits_for: GapKind = "user",
    context: bytes = b"",
) -> ConversationEntry:
    """The entry for a turn D just finished, at router time ``now_s``.

    ``blocks`` must carry the fingerprint (from D's connector, or ``with_fingerprint``).
    ``ttl_s`` must be D's ``decoder_kv_blocks_ttl``; ``safety_margin_s`` is subtracted
    because D's clock started before the router saw the response. A ``block_size`` that does
    not match the number of blocks D reported is dropped to ``None`` (whole reuse only).
    ``release_at_expiry``, ``waits_for`` and ``context`` are passed through
    (``ConversationEntry``).
    """
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    if not 0 <= safety_margin_s < ttl_s:
        raise ValueError(f"safety_margin_s must be in [0, {ttl_s}), got {safety_margin_s}")
    return ConversationEntry(
        decode_node_id=decode_node_id,
        blocks=blocks,
        expires_at_s=now_s + ttl_s - safety_margin_s,
        created_at_s=now_s,
        turn=turn,
        conversation=conversation,
        num_bytes=num_bytes,
        block_size=block_size if blocks_match(blocks, block_size) else None,
        release_at_expiry=release_at_expiry,
        waits_for=waits_for,
        context=context,
    )


def with_fingerprint(blocks: RemoteBlocks, fingerprint: TokenFingerprint) -> RemoteBlocks:
    """D's blocks with a fingerprint the router computed itself (``/tokenize`` mode, from the
    token ids D returned): it covers at most the tokens D holds."""
    if fingerprint.num_tokens > blocks.num_tokens:
        raise ValueError("fingerprint covers more tokens than D holds")
    return replace(blocks, fingerprint=fingerprint)


def blocks_match(blocks: RemoteBlocks, block_size: int | None) -> bool:
    """Whether every group of ``blocks`` holds exactly ``cdiv(num_tokens, block_size)`` ids."""
    if block_size is None or block_size <= 0:
        return False
    need = -(-blocks.num_tokens // block_size)
    return all(len(group) == need for group in blocks.block_ids)
