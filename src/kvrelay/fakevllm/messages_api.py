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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


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
    if not tools:
        return None
    if not isinstance(tools, list):
        raise MessagesInputError("tools: Input should be a valid list")
    return [{"type": "function", "function": {
        "name": t.get("name", ""), "description": t.get("description"),
        "parameters": t.get("input_schema") or {}}} for t in tools if isinstance(t, Mapping)]


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
    kv_transfer_params: Mapping[str, object] | None,
) -> dict[str, Any]:
    """The non-streamed response (the fake always stops at its budget: ``max_tokens``)."""
    out: dict[str, Any] = {
        "id": message_id, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": text}], "model": model,
        "stop_reason": "max_tokens", "usage": usage(num_prompt_tokens, num_output_tokens),
    }
    if kv_transfer_params:
        out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def event(kind: str, payload: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps(payload)}\n\n"


def start_events(message_id: str, model: str, num_prompt_tokens: int) -> str:
    start = {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "content": [],
        "model": model, "stop_reason": None, "stop_sequence": None,
        "usage": usage(num_prompt_tokens, 0)}}
    block = {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
             "index": 0}
    return event("message_start", start) + event("content_block_start", block)


def delta_event(text: str) -> str:
    return event("content_block_delta",
                 {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text},
                  "index": 0})


def stop_events(num_prompt_tokens: int, num_output_tokens: int) -> str:
    return (
        event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
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
