"""Replay recorded conversations: load a conversations file, turn it into a ``Workload``.

Accepted files (JSON; a ``.jsonl`` file holds one conversation object per line):

* vLLM ``benchmarks/multi_turn`` / OpenAI style:
  ``[{"id": ..., "messages": [{"role": "user"|"assistant"|"system"|"tool", "content": ...}]}]``
  (``content`` a string or a list of ``{"type": "text", "text": ...}`` parts);
* ShareGPT: ``[{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}]``
  (also ``user``/``assistant``/``chatgpt``/``tool``).

Each conversation may use either shape. Tool results are replayed as user messages (the
recorded assistant tool calls are not), which keeps every request valid without tool schemas.
Anything else raises ``ReplayFormatError`` naming the file, the conversation index and the
problem.

Turns: the messages up to each recorded assistant answer form one turn; the answer's length
in tokens becomes the turn's ``max_tokens`` (clamped to ``[1, max_answer_tokens]``) and the
answer itself is dropped: at replay time the history carries what the server generated, which
is what D holds. Trailing messages without an answer form a last turn of
``default_answer_tokens``. A turn's ``target_tokens`` is the recorded prompt's length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvrelay.bench.tokens import ChatMessage, CountTokens
from kvrelay.bench.workloads import ConversationSpec, Pacing, ThinkTime, TurnSpec, Workload

_ROLE_ALIASES: Mapping[str, str] = MappingProxyType({
    "user": "user", "human": "user", "tool": "tool", "function": "tool", "observation": "tool",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
})


class ReplayFormatError(ValueError):
    """The conversations file cannot be read or is not in a supported format."""


@dataclass(frozen=True)
class RecordedConversation:
    """One conversation of a file, roles normalized to system/user/assistant/tool."""

    id: str
    messages: tuple[ChatMessage, ...]


def load_conversations(path: str | Path) -> list[RecordedConversation]:
    """Parse ``path`` (see the module docstring for the formats)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayFormatError(f"{path}: cannot read: {exc}") from exc
    try:
        if path.suffix == ".jsonl":
            raw: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayFormatError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, list):
        raise ReplayFormatError(
            f"{path}: expected a JSON list of conversations, got {type(raw).__name__}"
        )
    if not raw:
        raise ReplayFormatError(f"{path}: the file holds no conversations")
    return [_conversation(path, i, item) for i, item in enumerate(raw)]


def _conversation(path: Path, index: int, item: object) -> RecordedConversation:
    where = f"{path}: conversation {index}"
    if not isinstance(item, dict):
        raise ReplayFormatError(f"{where}: expected an object, got {type(item).__name__}")
    conv_id = str(item.get("id", index))
    if isinstance(item.get("messages"), list):
        entries, role_key, content_key = item["messages"], "role", "content"
    elif isinstance(item.get("conversations"), list):
        entries, role_key, content_key = item["conversations"], "from", "value"
    else:
        raise ReplayFormatError(
            f"{where} (id {conv_id}): needs a 'messages' list (OpenAI/vLLM multi_turn) or a "
            "'conversations' list (ShareGPT)"
        )
    messages: list[ChatMessage] = []
    for j, entry in enumerate(entries):
        at = f"{where} (id {conv_id}), message {j}"
        if not isinstance(entry, dict):
            raise ReplayFormatError(f"{at}: expected an object")
        role = _ROLE_ALIASES.get(str(entry.get(role_key, "")).lower())
        if role is None:
            raise ReplayFormatError(
                f"{at}: unknown {role_key!r} {entry.get(role_key)!r}; expected one of "
                f"{sorted(_ROLE_ALIASES)}"
            )
        messages.append({"role": role, "content": _text(at, entry.get(content_key), content_key)})
    if not messages:
        raise ReplayFormatError(f"{where} (id {conv_id}): no messages")
    return RecordedConversation(conv_id, tuple(messages))


def _text(at: str, content: object, key: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
    raise ReplayFormatError(f"{at}: {key!r} must be a string or a list of text parts")


def replay_workload(
    conversations: Sequence[RecordedConversation],
    count: CountTokens,
    *,
    max_conversations: int | None = None,
    max_turns: int | None = None,
    default_answer_tokens: int = 128,
    max_answer_tokens: int = 1024,
    pacing: Pacing | None = None,
    seed: int = 0,
    salt: str = "",
) -> Workload:
    """Scripted turns for ``conversations`` (see the module docstring).

    ``salt`` (when non-empty) opens each conversation's first message with a session tag, so
    runs with different salts share no prefix cache. Conversations without a user turn are
    skipped; ``ReplayFormatError`` if none is left.
    """
    if default_answer_tokens < 1 or max_answer_tokens < 1:
        raise ReplayFormatError("answer token limits must be >= 1")
    pacing = pacing or Pacing()
    think = pacing.think
    starts = pacing.starts("replay", seed)
    chosen = list(conversations)[: max_conversations or None]
    specs: list[ConversationSpec] = []
    skipped = 0
    for index, conv in enumerate(chosen):
        rng = random.Random(f"replay/{seed}/{index}")
        messages = list(conv.messages)
        if salt:
            first = messages[0]
            messages[0] = {"role": first["role"], "content": f"[{salt}] {first['content']}"}
        turns = _turns(messages, count, default_answer_tokens, max_answer_tokens, think, rng)
        if max_turns is not None:
            turns = turns[:max_turns]
        if not turns:
            skipped += 1
            continue
        specs.append(ConversationSpec(f"replay-{index}-{conv.id}", tuple(turns),
                                      start_s=next(starts)))
    if not specs:
        raise ReplayFormatError("no conversation has a user turn to replay")
    return Workload("replay", tuple(specs), concurrency=pacing.concurrency or len(specs),
                    params={
        "conversations": len(specs), "skipped": skipped, "max_turns": max_turns,
        "default_answer_tokens": default_answer_tokens, "max_answer_tokens": max_answer_tokens,
        **pacing.params(), "seed": seed, "salt": salt,
    })


def _turns(
    messages: Sequence[ChatMessage],
    count: CountTokens,
    default_answer_tokens: int,
    max_answer_tokens: int,
    think: ThinkTime,
    rng: random.Random,
) -> list[TurnSpec]:
    turns: list[TurnSpec] = []
    recorded: list[ChatMessage] = []  # the history as recorded, for target_tokens
    pending: list[ChatMessage] = []  # messages the next turn appends
    empty = count([{"role": "assistant", "content": ""}])

    def has_user() -> bool:
        return any(m["role"] in ("user", "tool") for m in pending)

    def close(max_tokens: int) -> None:
        sent = tuple(_sendable(m) for m in pending)
        think_s = think.sample(rng) if turns else 0.0
        turns.append(TurnSpec(sent, max_tokens, think_s=think_s,
                              target_tokens=count([*recorded, *sent])))
        recorded.extend(sent)
        pending.clear()

    for message in messages:
        if message["role"] == "assistant" and has_user():
            answer = count([{"role": "assistant", "content": message["content"]}]) - empty
            close(min(max(answer, 1), max_answer_tokens))
            recorded.append(message)
        else:  # context: system prompts, tool results, answers not preceded by a user turn
            pending.append(message)
    if has_user():
        close(default_answer_tokens)
    return turns


def _sendable(message: ChatMessage) -> ChatMessage:
    if message["role"] == "tool":
        return {"role": "user", "content": "Tool result:\n" + message["content"]}
    return message
