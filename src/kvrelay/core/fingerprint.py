"""A compact, one-way fingerprint of the token ids whose KV a decode node holds.

Why: before sending a turn's ``kv_transfer_params`` to P, the router must prove that the KV it
asks P to pull was computed from exactly the tokens that start the new prompt. vLLM does not
check this: P pulls ``min(remote_num_tokens, prompt_len)`` tokens' KV blob-for-blob, so an
edited earlier message would silently corrupt the answer. Keeping the token ids themselves
would be large (and is conversation content); this fingerprint is about 0.5 bytes per token.

Layout: the held tokens are cut into chunks of ``chunk_tokens`` (16) ids. Each full chunk gets
a chained digest ``d_i = blake2b(d_{i-1} || int32le(chunk_i), 8 bytes)`` with ``d_{-1}`` all
zeros, so ``d_i`` commits to every token before the end of chunk ``i``. The trailing partial
chunk (if any) gets one more chained digest. ``num_tokens`` is the total held.

Contract of ``verified_prefix_tokens``: the result is the length of a prefix of the new prompt
that equals the held tokens (up to blake2b collisions, about 2**-64 per comparison); it is a
multiple of ``chunk_tokens`` or exactly ``num_tokens`` (when the whole held sequence, partial
tail included, matches), never more than ``num_tokens`` or the prompt's length.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Sequence

import msgspec

DEFAULT_CHUNK_TOKENS = 16
DIGEST_BYTES = 8

_PERSON = b"kvrelay-fp-v1"
_MAGIC = b"KF\x01"
_HEADER = struct.Struct("<HI")
_SEED = bytes(DIGEST_BYTES)


class FingerprintError(ValueError):
    """Serialized fingerprint bytes or text that cannot be decoded."""


class TokenFingerprint(msgspec.Struct, frozen=True):
    """Chained chunk digests of ``num_tokens`` token ids; the ids themselves are not kept.

    ``chunk_digests`` concatenates one ``DIGEST_BYTES`` digest per full chunk;
    ``tail_digest`` is the digest of the trailing partial chunk, empty when
    ``num_tokens`` is a multiple of ``chunk_tokens``.
    """

    num_tokens: int
    chunk_tokens: int
    chunk_digests: bytes
    tail_digest: bytes

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_tokens <= 0xFFFF:
            raise ValueError(f"chunk_tokens must be in [1, 65535], got {self.chunk_tokens}")
        if not 0 <= self.num_tokens <= 0xFFFFFFFF:
            raise ValueError(f"num_tokens out of range: {self.num_tokens}")
        full_chunks, tail_tokens = divmod(self.num_tokens, self.chunk_tokens)
        if len(self.chunk_digests) != full_chunks * DIGEST_BYTES:
            raise ValueError("chunk_digests length does not match num_tokens")
        if len(self.tail_digest) != (DIGEST_BYTES if tail_tokens else 0):
            raise ValueError("tail_digest length does not match num_tokens")

    def __repr__(self) -> str:
        return f"TokenFingerprint(num_tokens={self.num_tokens}, chunk_tokens={self.chunk_tokens})"

    def to_bytes(self) -> bytes:
        """Compact binary form (9-byte header + digests), e.g. for a Redis value."""
        header = _MAGIC + _HEADER.pack(self.chunk_tokens, self.num_tokens)
        return header + self.chunk_digests + self.tail_digest

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenFingerprint:
        """Inverse of ``to_bytes``; raises ``FingerprintError`` on malformed input."""
        head = len(_MAGIC) + _HEADER.size
        if len(data) < head or data[: len(_MAGIC)] != _MAGIC:
            raise FingerprintError("not a kvrelay token fingerprint (bad magic or too short)")
        chunk_tokens, num_tokens = _HEADER.unpack_from(data, len(_MAGIC))
        if chunk_tokens == 0:
            raise FingerprintError("chunk_tokens is zero")
        full_chunks, tail_tokens = divmod(num_tokens, chunk_tokens)
        body = data[head:]
        chunk_bytes = full_chunks * DIGEST_BYTES
        if len(body) != chunk_bytes + (DIGEST_BYTES if tail_tokens else 0):
            raise FingerprintError("fingerprint length does not match its num_tokens")
        return cls(
            num_tokens=num_tokens,
            chunk_tokens=chunk_tokens,
            chunk_digests=body[:chunk_bytes],
            tail_digest=body[chunk_bytes:],
        )

    def to_str(self) -> str:
        """JSON-safe text form: base64 of ``to_bytes`` (no quotes or backslashes; the codec
        is C code, this runs on every report and pull)."""
        return base64.b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_str(cls, text: str) -> TokenFingerprint:
        """Inverse of ``to_str``; raises ``FingerprintError`` on malformed input."""
        try:
            data = base64.b64decode(text.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError, binascii.Error) as exc:
            raise FingerprintError(f"not base64 text: {exc}") from exc
        return cls.from_bytes(data)


def fingerprint_tokens(
    token_ids: Sequence[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> TokenFingerprint:
    """Fingerprint all of ``token_ids`` (which must fit in int32, as vocab ids do)."""
    packed = _pack(token_ids)
    full_chunks, tail_tokens = divmod(len(token_ids), chunk_tokens)
    step = chunk_tokens * 4
    digests = bytearray()
    prev = _SEED
    for i in range(full_chunks):
        prev = _digest(prev, packed[i * step : (i + 1) * step])
        digests += prev
    tail = _digest(prev, packed[full_chunks * step :]) if tail_tokens else b""
    return TokenFingerprint(
        num_tokens=len(token_ids),
        chunk_tokens=chunk_tokens,
        chunk_digests=bytes(digests),
        tail_digest=tail,
    )


def verified_prefix_tokens(fingerprint: TokenFingerprint, new_token_ids: Sequence[int]) -> int:
    """How many leading tokens of ``new_token_ids`` are proven equal to the held tokens.

    Full chunks are compared in order until the first mismatch; the partial tail counts only
    if every full chunk matched and the tail matches exactly. See the module docstring for the
    bounds this guarantees.
    """
    chunk = fingerprint.chunk_tokens
    limit = min(len(new_token_ids), fingerprint.num_tokens)
    packed = _pack(new_token_ids[:limit])
    step = chunk * 4
    comparable_chunks = limit // chunk
    prev = _SEED
    for i in range(comparable_chunks):
        prev = _digest(prev, packed[i * step : (i + 1) * step])
        if prev != fingerprint.chunk_digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]:
            return i * chunk
    matched = comparable_chunks * chunk
    tail_comparable = bool(fingerprint.tail_digest) and limit == fingerprint.num_tokens
    if tail_comparable and _digest(prev, packed[matched * 4 :]) == fingerprint.tail_digest:
        return fingerprint.num_tokens
    return matched


def verifiable_tokens(fingerprint: TokenFingerprint, prompt_num_tokens: int) -> int:
    """The most ``verified_prefix_tokens`` can return for a prompt of that many tokens.

    A verified prefix shorter than this means the prompt diverged from the held tokens; equal
    means every comparison made agreed.
    """
    if prompt_num_tokens >= fingerprint.num_tokens:
        return fingerprint.num_tokens
    return max(0, prompt_num_tokens) // fingerprint.chunk_tokens * fingerprint.chunk_tokens


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32 integers: {exc}") from exc


def _digest(prev: bytes, chunk: bytes) -> bytes:
    return hashlib.blake2b(prev + chunk, digest_size=DIGEST_BYTES, person=_PERSON).digest()


def held_fingerprint(
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    num_tokens: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> TokenFingerprint:
    """The fingerprint of the tokens whose KV a node holds after a request: the first
    ``num_tokens`` of prompt + output (D holds prompt + output - 1; the last sampled token
    has no KV). Fewer known ids than ``num_tokens`` fingerprint only the known ones, so a
    pull can never claim tokens nobody proved. Used by kvrelay's connector on D, the fake
    engine and the router's ``/tokenize`` mode alike."""
    n = max(0, num_tokens)
    head = list(prompt_token_ids[:n])
    head.extend(output_token_ids[: n - len(head)])
    return fingerprint_tokens(head, chunk_tokens=chunk_tokens)
