"""Which retained entry a request continues, found from digests of what it sends.

Agent clients re-send the whole history every turn, mostly without a conversation id. The
router finds the entry a request continues without tokenizing anything:

* **Chat.** A chain of digests over the request: ``h_0`` commits to the *context* (what else
  changes the rendered prompt: endpoint, model, tools, chat template and its kwargs), ``h_i``
  to ``h_{i-1}`` and message ``i`` (its JSON bytes as the client sent them). A turn's entry is
  stored under the **anchor** ``h_n`` of its whole request and the **continuation** digest of
  the answer D produced (``answer_digest``: content text and tool calls, normalised). A new
  request probes every position ``i`` where it carries an assistant message, longest first:
  anchor ``h_i`` and the digest of that assistant message. A match therefore means the new
  request contains the entry's *entire* request followed by *its* answer.
* **Responses and Messages** digest like chat, over their adapters' canonical items
  (``History``): an assistant turn (a Responses output group, a Messages assistant message)
  is one item with its answer digest; what does not change the prompt (Anthropic
  ``cache_control`` markers) is left out of the items' bytes.
* **Completions.** The prompt text is cut into ``TEXT_BLOCK_BYTES`` blocks of UTF-8; the
  block anchors are a chain: ``g_0`` commits to the context, ``g_j`` to ``g_{j-1}`` and block
  ``j``. An entry is filed at the *end* of its prompt plus answer (``E`` bytes): under the
  anchor of the block holding ``E`` and a continuation naming ``E``'s place in that block
  (``text_entry``): the fine digest ``f`` of the block's text up to the ``TEXT_FINE_BYTES``
  boundary at or below ``E``, the digest of the few bytes from there to ``E`` (both chained
  from the anchor, so they commit to all ``E`` bytes) and ``E``'s offset in the block. A new
  request computes, for a block the index has entries in, its ``TEXT_FINE_BYTES`` fine
  digests (``text_fines``, one pass over at most ``TEXT_BLOCK_BYTES``) and, for an end offset
  the index holds under one of them, the exact continuation (``text_end``): a dict probe,
  never a scan of what the anchor holds. A match means the request's first ``E`` bytes are
  the entry's prompt and answer, and it has more after them.

Two hazards follow from vLLM freeing D's blocks after one read. *Stealing*: a request that
shares only a prefix with another conversation's entry (a common system prompt) never
produces that entry's anchor and continuation, so it cannot consume it. *Ambiguity*: many
entries under one anchor (an agent's conversations sharing a system prompt and first
message) are told apart by their answers. A wrong match can only cost efficiency, never
correctness: P's connector proves every token with D's fingerprint before loading
(``core.guard``). Only digests are kept, never content.

The **scope** narrows the lookup (``scope_of``): the tenant, the conversation id when the
client sent one (body ``conversation_id`` or a session header), the end user (``user``,
``safety_identifier``) and vLLM's ``cache_salt``: the same history under another user or
salt is another scope, so no entry, and no guard-proven length, ever crosses them. Within an
id's scope every entry belongs to that one conversation; when the id is also *bound* to one
caller (only that caller can send it: a gateway sets it, or the tenant is one caller) and no
probe matches (an edited history: a changed answer or earlier message), the request may
continue the scope's latest entry (``RequestIdentity.explicit``) if that entry's turn had the
same context (``RequestIdentity.context``: the model, a LoRA adapter's name included, tools,
template; a turn under another model or adapter has other KV for the same token ids): the
guard then proves how much of it is still equal, and that length is only ever about the
caller's own turns. Never
for an id anyone can send (it would tell a guesser how much of another's conversation
matches, and take the entry) and never without an id: the tenant's scope holds every
conversation, and that would be stealing.
Never either for a history that holds media (an image, audio, a file: the adapters'
``carries_media``): the engine renders a media part as placeholder token ids that are equal
for equal-sized media, so the guard's token proof would pass another image's KV. A media
history continues only an entry whose digests it matches (the media's bytes or URL are
in them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvrelay.core.tool_arguments import canonical_arguments

DIGEST_BYTES = 16
TEXT_BLOCK_BYTES = 1024
"""Completions anchors sit every this many prompt bytes."""
TEXT_FINE_BYTES = 64
"""Inside a block, a completions entry's end is found from the fine digest at the last
boundary of this many bytes at or below it: at most this many ends share one fine digest."""

_PERSON = b"kvrelay-id-v1"
_TEXT_PERSON = b"kvrelay-text-v2"


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)


def digest(*parts: bytes) -> bytes:
    """A 128-bit digest of ``parts``, each length-prefixed (no ambiguity at the seams)."""
    h = _hasher()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def scope_of(
    tenant: str,
    conversation_id: str | None = None,
    *,
    bound: bool = False,
    user: str | None = None,
    safety_identifier: str | None = None,
    cache_salt: str | None = None,
) -> bytes:
    """The lookup scope: who may reach an entry. Every part narrows it: the tenant, the
    conversation id (``bound``: one that only its caller can send, see ``RequestIdentity``),
    the end user (OpenAI's ``user`` and ``safety_identifier``) and vLLM's ``cache_salt``, so
    the same history under another user or salt never finds this one's entries."""

    def part(value: str | None) -> bytes:
        return b"" if value is None else b"\x01" + value.encode("utf-8", "surrogatepass")

    return digest(b"scope", tenant.encode("utf-8"), part(conversation_id),
                  b"bound" if bound else b"", part(user), part(safety_identifier),
                  part(cache_salt))


class Continuation(msgspec.Struct, frozen=True):
    """What must follow an anchor for a request to continue an entry: the answer's digest
    (chat, ``num_bytes`` 0) or the digest of the next ``num_bytes`` prompt bytes
    (completions)."""

    digest: bytes
    num_bytes: int

    def slot(self) -> bytes:
        """Identifies the entry under its anchor."""
        return self.digest + self.num_bytes.to_bytes(8, "little")


class Probe(msgspec.Struct, frozen=True):
    """One place a request may continue an entry.

    ``continuation`` is the required continuation (chat), or ``None`` for a completions
    block starting at ``offset`` (its entries' ends found with ``text_fines`` and
    ``text_end``). ``covered_bytes`` is
    how much of the request a match at this probe accounts for (for estimates).
    """

    anchor: bytes
    continuation: Continuation | None
    offset: int
    covered_bytes: int


class RequestIdentity(msgspec.Struct, frozen=True):
    """The digests of one request (see the module docstring).

    ``anchor`` is where this request's own entry will be stored; ``probes`` are tried longest
    first; ``prompt_bytes`` is the size of everything hashed (messages or prompt text);
    ``text`` is the completions prompt's bytes (kept until the turn commits), else ``None``.
    ``explicit``: the scope is one conversation id bound to one caller, so the request may
    continue the scope's latest entry (see the module docstring) of the same ``context``:
    the digest of the API and of the request fields that shape its KV beside the history
    (the model, a LoRA adapter's name included, tools, template): KV computed under another
    context is not this request's even where the token ids agree (an adapter shares its
    base model's tokenizer), and the guard proves token ids only.
    """

    scope: bytes
    anchor: bytes
    probes: tuple[Probe, ...]
    prompt_bytes: int
    text: bytes | None = None
    tail_offset: int = 0
    explicit: bool = False
    context: bytes = b""


class ChatMessage(msgspec.Struct, frozen=True):
    """One request message as the identity needs it: its JSON bytes and, for an assistant
    message, its ``answer_digest``."""

    raw: bytes
    answer: Continuation | None = None


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str


def message_tool_calls(message: Mapping[str, Any]) -> list[ToolCall]:
    """The tool calls of an OpenAI chat message (request history or D's answer), read the
    same way on both sides so that a re-sent answer digests as D's did: a call without a
    function object is skipped, a missing name or arguments reads as empty."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    out: list[ToolCall] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            name, args = function.get("name"), function.get("arguments")
            out.append(ToolCall(name if isinstance(name, str) else "",
                                args if isinstance(args, str) else ""))
    return out


def answer_digest(content: str, tool_calls: Sequence[ToolCall] = ()) -> Continuation:
    """The continuation of an assistant answer, however the client re-sends it: content with
    surrounding whitespace stripped, tool calls as (name, arguments) with JSON arguments in
    canonical form; reasoning text is not part of it (clients usually drop it)."""
    parts = [b"answer", content.strip().encode("utf-8")]
    for call in tool_calls:
        parts.append(call.name.encode("utf-8"))
        parts.append(canonical_arguments(call.arguments).encode("utf-8"))
    return Continuation(digest(*parts), 0)


class History(msgspec.Struct, frozen=True):
    """One request's canonical history, as an API adapter hands it to core in one piece.

    ``api`` names the history's kind and is digested into ``h_0`` (a chat history and a
    Messages history with equal bytes never meet). ``context`` is everything else that
    changes the rendered prompt. Either ``items`` (message-like APIs: one item per message,
    an assistant item with its ``answer_digest``) or ``text`` (completions: the prompt's
    bytes) is the history.
    """

    api: str
    context: bytes
    items: tuple[ChatMessage, ...] = ()
    text: bytes | None = None


def identify(scope: bytes, history: History, *, explicit: bool = False) -> RequestIdentity:
    """The digests of one request: ``text_identity`` for a text history, else
    ``chat_identity`` over its items."""
    if history.text is not None:
        return text_identity(scope, history.context, history.text, explicit=explicit)
    return chat_identity(scope, history.context, history.items, explicit=explicit,
                         kind=history.api.encode("ascii"))


def chat_identity(
    scope: bytes, context: bytes, messages: Sequence[ChatMessage], *, explicit: bool = False,
    kind: bytes = b"chat",
) -> RequestIdentity:
    """Anchors after every message; probes at assistant messages, longest first. ``kind``
    separates the APIs' digest spaces (``History.api``)."""
    h = _hasher()
    h.update(kind)
    h.update(len(context).to_bytes(8, "little"))
    h.update(context)
    anchors: list[bytes] = []
    covered: list[int] = []
    total = 0
    for message in messages:
        anchors.append(h.copy().digest())
        covered.append(total)
        h.update(len(message.raw).to_bytes(8, "little"))
        h.update(message.raw)
        total += len(message.raw)
    probes = tuple(
        Probe(anchors[i], answer, i, covered[i] + len(messages[i].raw))
        for i in range(len(messages) - 1, 0, -1)
        if (answer := messages[i].answer) is not None
    )
    return RequestIdentity(scope, h.digest(), probes, total, explicit=explicit,
                           context=digest(kind, context))


def _text_hasher(tag: bytes, seed: bytes) -> hashlib.blake2b:
    """The completions chain's hasher: ``tag`` (each starts with its own letter) then a
    16-byte digest, then text."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_TEXT_PERSON)
    h.update(tag)
    h.update(seed)
    return h


def _block_anchor(previous: bytes, block: bytes) -> bytes:
    h = _text_hasher(b"block", previous)
    h.update(block)
    return h.digest()


def text_identity(
    scope: bytes, context: bytes, text: bytes, *, explicit: bool = False
) -> RequestIdentity:
    """Anchors every ``TEXT_BLOCK_BYTES`` of a completions prompt (a chain from the context);
    the own anchor is the last boundary inside the prompt (always before its last byte)."""
    anchors = [digest(b"completions", context)]
    last = max(0, (len(text) - 1) // TEXT_BLOCK_BYTES)
    for j in range(1, last + 1):
        anchors.append(_block_anchor(
            anchors[-1], text[(j - 1) * TEXT_BLOCK_BYTES : j * TEXT_BLOCK_BYTES]))
    probes = tuple(
        Probe(anchors[j], None, j * TEXT_BLOCK_BYTES, j * TEXT_BLOCK_BYTES)
        for j in range(last, -1, -1)
    )
    return RequestIdentity(
        scope, anchors[last], probes, len(text), text=text, tail_offset=last * TEXT_BLOCK_BYTES,
        explicit=explicit, context=anchors[0],
    )


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """A token-id prompt (or answer) as the bytes its completions identity is cut from."""
    return b"".join(t.to_bytes(4, "little") for t in token_ids)


def _end_digest(fine: bytes, tail: bytes) -> bytes:
    h = _text_hasher(b"end", fine)
    h.update(tail)
    return h.digest()


def _end_continuation(fine: bytes, tail: bytes, end_offset: int) -> Continuation:
    return Continuation(fine + _end_digest(fine, tail), end_offset)


def text_fine_of(continuation: Continuation) -> bytes:
    """The fine digest a completions continuation is filed under (``text_entry``)."""
    return continuation.digest[:DIGEST_BYTES]


def text_entry(identity: RequestIdentity, answer: bytes) -> tuple[bytes, Continuation]:
    """Where a completions entry is filed: the anchor of the block holding the end of its
    prompt plus ``answer`` (UTF-8 text, or ``pack_token_ids`` of D's output ids after a
    token-id prompt), and the continuation that names that end (fine digest + end digest,
    ``num_bytes`` = the end's offset in the block). Hashes at most the prompt's last block
    and the answer."""
    assert identity.text is not None
    rest = identity.text[identity.tail_offset :] + answer
    anchor, start = identity.anchor, 0
    while len(rest) - start >= TEXT_BLOCK_BYTES:
        anchor = _block_anchor(anchor, rest[start : start + TEXT_BLOCK_BYTES])
        start += TEXT_BLOCK_BYTES
    within = rest[start:]
    fine_at = (len(within) // TEXT_FINE_BYTES) * TEXT_FINE_BYTES
    h = _text_hasher(b"fine", anchor)
    h.update(within[:fine_at])
    return anchor, _end_continuation(h.digest(), within[fine_at:], len(within))


def text_fines(identity: RequestIdentity, probe: Probe) -> tuple[bytes, ...]:
    """The fine digests of the request's block at ``probe``: one per ``TEXT_FINE_BYTES``
    boundary ``b`` of the block with request text after it (index ``b // TEXT_FINE_BYTES``),
    in one pass over at most ``TEXT_BLOCK_BYTES``."""
    text = identity.text
    if text is None:
        return ()
    h = _text_hasher(b"fine", probe.anchor)
    out: list[bytes] = []
    for at in range(probe.offset, min(len(text), probe.offset + TEXT_BLOCK_BYTES),
                    TEXT_FINE_BYTES):
        if at > probe.offset:
            h.update(text[at - TEXT_FINE_BYTES : at])
        out.append(h.digest())
    return tuple(out)


def text_end(
    identity: RequestIdentity, probe: Probe, fines: Sequence[bytes], end_offset: int
) -> Continuation | None:
    """The continuation an entry ending ``end_offset`` bytes into the probe's block would
    have if the request carries it (``fines`` from ``text_fines``), or ``None`` when the
    request has nothing after that end (nothing new to compute)."""
    text = identity.text
    end = probe.offset + end_offset
    if text is None or end >= len(text) or not 0 <= end_offset < TEXT_BLOCK_BYTES:
        return None
    fine_index = end_offset // TEXT_FINE_BYTES
    if fine_index >= len(fines):
        return None
    fine_at = probe.offset + fine_index * TEXT_FINE_BYTES
    return _end_continuation(fines[fine_index], text[fine_at:end], end_offset)


def text_carries(identity: RequestIdentity, anchor: bytes, continuation: Continuation) -> bool:
    """Whether the request continues the completions entry filed at ``anchor`` with
    ``continuation`` (``text_entry``): its text holds the entry's prompt and answer, then more."""
    for probe in identity.probes:
        if probe.anchor == anchor and probe.continuation is None:
            found = text_end(identity, probe, text_fines(identity, probe),
                             continuation.num_bytes)
            return found == continuation
    return False
