"""``POST /v1/chat/completions``: OpenAI chat, canonical history = the messages as sent.

Each message is one history item (its JSON bytes as the client sent them); an assistant
message carries the digest of its content and tool calls (``core.identity.answer_digest``),
which is how D's answer is found again when the client re-sends it. The context is every
field that changes what the chat template renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrelay.core.identity import ChatMessage, History, answer_digest, message_tool_calls
from kvrelay.router.apis.base import ApiRequest
from kvrelay.router.apis.chunks import OpenAIChunks
from kvrelay.router.apis.fields import (
    JsonObject,
    context_bytes,
    encode,
    message_text,
    optional,
    positive,
    single_text,
)
from kvrelay.router.errors import ClientError

#: Chat fields that change what the chat template renders (identity context, /tokenize).
CONTEXT_FIELDS = (
    "model",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "mm_processor_kwargs",
)


def openai_user(body: Mapping[str, Any]) -> str | None:
    """OpenAI's end user (``user``; ``safety_identifier`` and ``cache_salt`` are read by the
    router for every API); a non-string is a 400. ``prompt_cache_key`` is no conversation id
    (OpenAI tells clients to share one across requests with a common prefix,
    docs/security.md): it is forwarded and otherwise ignored."""
    user: str | None = optional(body, "user", str)
    return user


def sampling_fields(body: JsonObject) -> tuple[bool, Any]:
    """The checks chat and completions share: ``model``, ``stream``, ``stream_options``,
    ``return_token_ids``; returns the stream flag and the stream options."""
    optional(body, "model", str)
    stream = bool(optional(body, "stream", bool))
    options = optional(body, "stream_options", dict)
    optional(body, "return_token_ids", bool)
    return stream, options


def output_budget(body: JsonObject) -> int | None:
    """The output budget vLLM gives the request: ``max_completion_tokens`` when given, else
    ``max_tokens`` (vLLM 0.32 / 0.33 read them in that order, not the smaller one; both
    must be positive); ``n`` must be 1."""
    max_tokens = positive(body, "max_tokens")
    max_completion_tokens = positive(body, "max_completion_tokens")
    n = optional(body, "n", int)
    if n is not None and n != 1:
        raise ClientError("n > 1 is not supported by the P/D router", "n")
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


class ChatAdapter(OpenAIChunks):
    """The chat API (module docstring)."""

    __slots__ = ()
    endpoint = "chat"
    tokenizable = True
    path = "/v1/chat/completions"

    def conversation_hint(self, body: JsonObject, headers: Mapping[str, str]) -> str | None:
        return None

    def end_user(self, body: JsonObject) -> str | None:
        return openai_user(body)

    def parse(self, body: JsonObject) -> ApiRequest:
        stream, options = sampling_fields(body)
        max_tokens = output_budget(body)
        history = History("chat", context_bytes(body, CONTEXT_FIELDS), tuple(_messages(body)))
        return ApiRequest(
            history=history,
            stream=stream,
            include_usage=stream and bool(options and options.get("include_usage")),
            wants_token_ids=bool(body.get("return_token_ids")),
            max_output_tokens=max_tokens,
        )

    def tokenize_body(self, body: JsonObject, req: ApiRequest) -> JsonObject | None:
        out = {k: body[k] for k in CONTEXT_FIELDS if k in body}
        out["messages"] = body["messages"]
        return out


def _messages(body: Mapping[str, Any]) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages must be a non-empty list", "messages")
    out: list[ChatMessage] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ClientError("every message must be an object", "messages")
        answer = None
        if message.get("role") == "assistant":
            content = message_text(message.get("content"))
            answer = answer_digest(content, message_tool_calls(message))
        out.append(ChatMessage(encode(_canonical(message)), answer))
    return out


def _canonical(message: dict[str, Any]) -> dict[str, Any]:
    """A message as its identity sees it: content that is one text part as its string. vLLM
    renders both alike (a string-format template joins the parts, an OpenAI-format one gets a
    string as one text part), and clients re-send either way (probe 8b, finding 3: a turn
    that sent a part, re-sent as a string, recomputed). More parts, or a part with other
    keys, stay as sent."""
    text = single_text(message.get("content"))
    return message if text is None else {**message, "content": text}
