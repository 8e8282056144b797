"""Tool calls in the bench's histories: the one place their ``ChatMessage`` convention lives.

The bench keeps a conversation's history as ``ChatMessage``s (``Mapping[str, str]``: what
the workload generators, the token counters and the chat client handle). A turn whose answer
was a tool call, and the tool's result the next turn sends, extend that convention:

* an assistant message that is a tool call: ``{"role": "assistant", "content": "",
  "tool_use_id": <id>, "tool_name": <name>, "tool_input": <the input object as JSON text>}``
  (``ToolUse.message``; ``ToolUse.of_message`` reads it back, ``None`` for any other
  message);
* a tool result: ``{"role": "tool", "content": <text>, "tool_use_id": <the call's id>}``.
  The workload generator writes it without ``tool_use_id`` (it cannot know the id the server
  will give); the runner (``execute``) ties it to the previous answer's call with
  ``answer_tool_results``, which turns it into a plain user message when that answer was not
  a tool call (e.g. one cut off by ``max_tokens``).

Only the Messages client (``messages_client``) sends these as tool blocks; the chat client
refuses turns that force a tool call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from kvrelay.bench.tokens import ChatMessage

TOOL_USE_ID = "tool_use_id"
TOOL_NAME = "tool_name"
TOOL_INPUT = "tool_input"


@dataclass(frozen=True)
class ToolUse:
    """A tool call an answer made: the server's block ``id``, the tool's ``name`` and its
    ``input`` object as JSON text (``input_json``; ``input`` parses it)."""

    id: str
    name: str
    input_json: str

    @property
    def input(self) -> dict[str, object]:
        """The input object (``ValueError`` if ``input_json`` is not a JSON object)."""
        value = json.loads(self.input_json)
        if not isinstance(value, dict):
            raise ValueError(f"a tool call's input must be a JSON object: {self.input_json!r}")
        return value

    def message(self) -> ChatMessage:
        """The assistant message of this call in a bench history (module docstring)."""
        return {"role": "assistant", "content": "", TOOL_USE_ID: self.id,
                TOOL_NAME: self.name, TOOL_INPUT: self.input_json}

    @classmethod
    def of_message(cls, message: ChatMessage) -> ToolUse | None:
        """The call an assistant message of a bench history holds, ``None`` for any other."""
        if message.get("role") != "assistant" or TOOL_USE_ID not in message:
            return None
        return cls(message[TOOL_USE_ID], message.get(TOOL_NAME, ""),
                   message.get(TOOL_INPUT, "{}"))


def answer_tool_results(
    messages: Iterable[ChatMessage], call: ToolUse | None
) -> list[ChatMessage]:
    """``messages`` as sent after an answer that made ``call``: each ``tool`` message gets
    the call's id; with no call, each becomes a user message with the same text."""
    out: list[ChatMessage] = []
    for m in messages:
        if m.get("role") != "tool":
            out.append(m)
        elif call is None:
            out.append({"role": "user", "content": m["content"]})
        else:
            out.append({"role": "tool", "content": m["content"], TOOL_USE_ID: call.id})
    return out
