"""Entries and identities for index tests (real vLLM 0.32 params, fingerprinted)."""

from __future__ import annotations

import json
from pathlib import Path

from msgspec.structs import replace

from kvrelay.core.conversation import ConversationEntry, new_entry, with_fingerprint
from kvrelay.core.fingerprint import fingerprint_tokens
from kvrelay.core.identity import (
    ChatMessage,
    RequestIdentity,
    answer_digest,
    chat_identity,
    scope_of,
    text_entry,
    text_identity,
)
from kvrelay.core.params import parse_remote_blocks
from kvrelay.router.index import EntryRef

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"
BLOCKS = parse_remote_blocks(
    json.loads((DATA / "chat_turn1.json").read_text())["d1"]["kv_transfer_params"]
)
SCOPE = scope_of("t", None)


def entry(
    node: str = "d0", engine: str | None = None, now: float = 100.0, turn: int = 1
) -> ConversationEntry:
    blocks = BLOCKS if engine is None else replace(BLOCKS, engine_id=engine)
    blocks = with_fingerprint(blocks, fingerprint_tokens(list(range(2056))))
    return new_entry(decode_node_id=node, blocks=blocks, now_s=now, turn=turn,
                     conversation="c", num_bytes=8000)


def user(text: str) -> ChatMessage:
    return ChatMessage(json.dumps({"role": "user", "content": text}).encode())


def assistant(text: str) -> ChatMessage:
    raw = json.dumps({"role": "assistant", "content": text}).encode()
    return ChatMessage(raw, answer_digest(text))


def chat(*messages: ChatMessage, scope: bytes = SCOPE, explicit: bool = False
         ) -> RequestIdentity:
    return chat_identity(scope, b'{"model":"m"}', list(messages), explicit=explicit)


def stored_at(identity: RequestIdentity, answer: str) -> EntryRef:
    """Where the entry of a chat turn with this request and ``answer`` is stored."""
    return EntryRef(identity.scope, identity.anchor, answer_digest(answer).slot())


def text(prompt: str, scope: bytes = SCOPE) -> RequestIdentity:
    return text_identity(scope, b'{"model":"m"}', prompt.encode())


def text_stored_at(identity: RequestIdentity, answer: str) -> EntryRef:
    anchor, cont = text_entry(identity, answer.encode())
    return EntryRef(identity.scope, anchor, cont.slot())
