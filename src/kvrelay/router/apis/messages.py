"""``POST /v1/messages`` (also ``?beta=true``): the Anthropic Messages API (Claude Code).

**Canonical history.** One item per message, its JSON bytes with every ``cache_control``
marker taken out (Claude Code moves them every turn; they do not change the prompt). An
assistant message's answer digest is its text blocks and ``tool_use`` blocks (name, input
as canonical JSON); ``thinking`` blocks are not part of it. D's answer digests the same way
from its ``content``. The context: model, system (without markers), tools (without
markers), whether thinking is disabled and ``output_config.effort`` (both render into the
prompt), template kwargs; ``metadata``, ``context_management`` and the thinking budget do
not change the prompt and are left out.

**Conversation hints.** Claude Code's ``X-Claude-Code-Session-Id`` header is a default
session header; without it, the session inside ``metadata.user_id`` (a JSON object's
``session_id``, or the ``..._session_<uuid>`` suffix of the older form).

**Stream.** vLLM's Messages stream carries no params (D's connector reports them), ends
with ``message_stop``; the router rewrites only the events with a usage
(``message_start``, ``message_delta``): ``cache_read_input_tokens`` = the prompt tokens P
did not compute, ``input_tokens`` = prompt − cache read − cache creation. Errors the router
answers are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from kvrelay.core.identity import ChatMessage, History, ToolCall, answer_digest
from kvrelay.router.apis.base import ApiRequest, DecodeRead, StreamScanner
from kvrelay.router.apis.fields import JsonObject, encode, optional, positive, single_text
from kvrelay.router.errors import (
    MESSAGES_PATH,
    ClientError,
    RouterError,
    anthropic_error_json,
    dumps,
)
from kvrelay.router.sse import BATCH_BYTES, Rewrite, split_events

_SESSION_SUFFIX = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")
_MARK_USAGE = b'"usage":{'
_MARK_PARAMS = b'"kv_transfer_params"'
_STOP = b"event: message_stop\n"
_ROLES = ("user", "assistant", "system")
BILLING_HEADER = "x-anthropic-billing-header"
_ERROR = b"event: error\n"
_DECODER = msgspec.json.Decoder()


class _Usage(msgspec.Struct):
    input_tokens: int = 0
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None
    usage: _Usage | None = None


_ANSWER = msgspec.json.Decoder(_PrefillAnswer)


class MessagesAdapter:
    """The Messages API (module docstring)."""

    __slots__ = ()
    endpoint = "messages"
    path = MESSAGES_PATH
    tokenizable = False
    stream_family = "messages"

    def conversation_hint(self, body: JsonObject, headers: Mapping[str, str]) -> str | None:
        metadata = body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        return session_of(user) if isinstance(user, str) else None

    def end_user(self, body: JsonObject) -> str | None:
        """Anthropic's end user: ``metadata.user_id`` (a non-string is a 400)."""
        metadata = optional(body, "metadata", dict)
        if metadata is None or metadata.get("user_id") is None:
            return None
        user = metadata["user_id"]
        if not isinstance(user, str):
            raise ClientError("metadata.user_id must be a string", "metadata.user_id")
        return user

    def parse(self, body: JsonObject) -> ApiRequest:
        optional(body, "model", str)
        stream = bool(optional(body, "stream", bool))
        max_tokens = positive(body, "max_tokens")
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise ClientError("system must be a string or a list of text blocks", "system")
        tools = optional(body, "tools", list)
        thinking = optional(body, "thinking", dict)
        output_config = optional(body, "output_config", dict)
        context = encode({
            "model": body.get("model"),
            "system": system_text(system),
            "tools": strip_markers(tools),
            "thinking_off": bool(thinking and thinking.get("type") == "disabled"),
            "effort": output_config.get("effort") if output_config else None,
            "chat_template_kwargs": body.get("chat_template_kwargs"),
        })
        history = History("messages", context, tuple(_items(body.get("messages"))))
        return ApiRequest(history=history, stream=stream, include_usage=stream,
                          wants_token_ids=False, max_output_tokens=max_tokens)

    def tokenize_body(self, body: JsonObject, req: ApiRequest) -> JsonObject | None:
        return None

    def prefill_body(self, body: JsonObject, params: Mapping[str, object]) -> bytes:
        out = dict(body)
        out["stream"] = False
        out["max_tokens"] = 1
        out["kv_transfer_params"] = params
        return encode(out)

    def decode_body(
        self, body: JsonObject, params: Mapping[str, object], *, token_ids: bool
    ) -> bytes:
        out = dict(body)
        out["kv_transfer_params"] = params
        return encode(out)

    def prefill_answer(self, raw: bytes) -> tuple[dict[str, object] | None, int]:
        answer = _ANSWER.decode(raw)
        usage = answer.usage
        if usage is None:
            return answer.kv_transfer_params, 0
        prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) \
            + (usage.cache_creation_input_tokens or 0)
        return answer.kv_transfer_params, prompt

    def scanner(self, rewrite: Rewrite) -> StreamScanner:
        return MessagesScan(rewrite)

    def rewrite_body(self, obj: JsonObject, rewrite: Rewrite) -> DecodeRead:
        params = obj.pop("kv_transfer_params", None)
        text, calls = content_answer(obj.get("content"))
        if rewrite.cached_tokens is not None:
            set_cache_read(obj.get("usage"), rewrite.cached_tokens)
        return DecodeRead(params, text, calls, None, [])

    def error(self, exc: ClientError | RouterError) -> bytes:
        if isinstance(exc, RouterError):
            inner = exc.to_body().get("error")
            message = inner.get("message") if isinstance(inner, Mapping) else None
            text = message if isinstance(message, str) else exc.message
            return anthropic_error_json(exc.status, text)
        return anthropic_error_json(exc.status, exc.message)


def session_of(user_id: str) -> str | None:
    """The session in Claude Code's ``metadata.user_id``: a JSON object's ``session_id``,
    or the ``_session_<id>`` suffix of the older ``user_<h>_account_<id>_session_<id>``
    form; ``None`` for anything else (a bare user id names a user, not a conversation)."""
    if user_id.startswith("{"):
        try:
            value = _DECODER.decode(user_id.encode("utf-8"))
        except (msgspec.DecodeError, UnicodeEncodeError, RecursionError):
            return None
        session = value.get("session_id") if isinstance(value, dict) else None
        return session if isinstance(session, str) and session else None
    match = _SESSION_SUFFIX.search(user_id)
    return match.group(1) if match else None


def strip_markers(value: object) -> object:
    """``value`` without any ``cache_control`` key, at any depth (a copy)."""
    if isinstance(value, dict):
        return {k: strip_markers(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_markers(v) for v in value]
    return value


def is_billing_header(text: object) -> bool:
    """Claude Code's ``x-anthropic-billing-header: ...`` text, which changes every request;
    vLLM drops it from the prompt (top-level and inline system)."""
    return isinstance(text, str) and text.startswith(BILLING_HEADER)


def system_text(system: object) -> str | None:
    """The system prompt as vLLM renders it: a string, or the text of the text blocks
    joined, billing headers left out (markers and block boundaries do not change it)."""
    if isinstance(system, str):
        return None if is_billing_header(system) else system
    if not isinstance(system, list):
        return None
    return "".join(b["text"] for b in system
                   if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) and not is_billing_header(b["text"]))


def _canonical(message: dict[str, Any]) -> dict[str, Any] | None:
    """A message as its identity sees it: no ``cache_control`` markers; one text block as
    its string (vLLM renders both alike); a system message as its text without billing
    headers, ``None`` when nothing is left (vLLM renders no message then)."""
    role, content = message["role"], message["content"]
    if role == "system":
        text = system_text(content)
        return {"role": "system", "content": text} if text else None
    if isinstance(content, list):
        blocks = strip_markers(content)
        assert isinstance(blocks, list)
        text = single_text(blocks)
        return {"role": role, "content": blocks if text is None else text}
    return {"role": role, "content": content}


def _items(messages: object) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages must be a non-empty list", "messages")
    out: list[ChatMessage] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ClientError("every message must be an object with role user, assistant or "
                              "system", "messages")
        content = message.get("content")
        if not isinstance(content, str | list):
            raise ClientError("a message's content must be a string or a list of blocks",
                              "messages")
        answer = None
        if message["role"] == "assistant":
            answer = answer_digest(*content_answer(content))
        canonical = _canonical(message)
        if canonical is not None:
            out.append(ChatMessage(encode(canonical), answer))
    if not any(m["role"] != "system" for m in messages):
        raise ClientError("messages must hold a user or assistant message", "messages")
    return out


def content_answer(content: object) -> tuple[str, list[ToolCall]]:
    """The answer in Messages content (D's ``content``, or a re-sent assistant message):
    text blocks joined, ``tool_use`` blocks as (name, input as JSON)."""
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            name = block.get("name")
            calls.append(ToolCall(name if isinstance(name, str) else "",
                                  encode(block.get("input", {})).decode("utf-8")))
    return "".join(texts), calls


def set_cache_read(usage: object, cached_tokens: int) -> bool:
    """Anthropic's usage from the prompt tokens P did not compute: the prompt is
    ``input_tokens`` + cache read + cache creation as D reported it; the cache read becomes
    ``cached_tokens`` and ``input_tokens`` the rest."""
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return False
    read = usage.get("cache_read_input_tokens")
    creation = usage.get("cache_creation_input_tokens")
    creation = creation if isinstance(creation, int) else 0
    prompt = usage["input_tokens"] + (read if isinstance(read, int) else 0) + creation
    cached = max(0, min(cached_tokens, prompt - creation))
    usage["input_tokens"] = prompt - creation - cached
    usage["cache_read_input_tokens"] = cached
    return True


class _Block(msgspec.Struct):
    type: str = ""
    name: str | None = None
    text: str | None = None
    input: msgspec.Raw = msgspec.Raw()  # a tool_use block's start input, kept as sent


class _Delta(msgspec.Struct):
    type: str = ""
    text: str | None = None
    partial_json: str | None = None


class _Event(msgspec.Struct):
    type: str = ""
    index: int = 0
    content_block: _Block | None = None
    delta: _Delta | None = None


_EVENT = msgspec.json.Decoder(_Event)


class MessagesScan:
    """The ``StreamScanner`` of a Messages stream (module docstring). The answer is read
    from the relayed events in batches of ``BATCH_BYTES``, off the per-chunk path."""

    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._text: list[str] = []
        self._tools: dict[int, list[list[str]]] = {}
        self._start_inputs: dict[int, str] = {}
        self.done = False
        self.error: object = None
        self.params: object = None
        self.params_seen = False
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []

    def feed(self, events: bytes) -> bytes:
        if _STOP in events:
            self.done = True
        rewrite = self._rewrite.cached_tokens is not None and _MARK_USAGE in events
        if rewrite or _MARK_PARAMS in events or _ERROR in events:
            events = b"".join(self._event(e) for e in split_events(events))
        self._batch.append(events)
        self._batch_bytes += len(events)
        if self._batch_bytes >= BATCH_BYTES:
            self._parse_batch()
        return events

    def cut(self, status: int, message: str) -> bytes:
        return b"event: error\ndata: " + anthropic_error_json(status, message) + b"\n\n"

    def answer(self) -> tuple[str, list[ToolCall]]:
        """The streamed answer as the client rebuilds it: a ``tool_use`` block's input is its
        ``input_json_delta`` pieces joined or, when the stream sent none (a call cut by
        ``max_tokens`` before its first argument), the block's start ``input`` (``{}``), which
        is what the SDKs keep and re-send."""
        self._parse_batch()
        calls = [ToolCall("".join(n), "".join(a) or self._start_inputs.get(i, ""))
                 for i, (n, a) in sorted(self._tools.items())]
        return "".join(self._text), calls

    def _event(self, event: bytes) -> bytes:
        if event.startswith(_ERROR):
            self.error = event
            self.done = True
            return event
        head, sep, data = event.partition(b"data: ")
        try:
            obj = _DECODER.decode(data.rstrip(b"\n"))
        except msgspec.DecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        changed = False
        if "kv_transfer_params" in obj:
            self.params = obj.pop("kv_transfer_params")
            self.params_seen = changed = True
        cached = self._rewrite.cached_tokens
        if cached is not None:
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else obj.get("usage")
            changed = set_cache_read(usage, cached) or changed
        return head + sep + dumps(obj) + b"\n\n" if changed else event

    def _parse_batch(self) -> None:
        if not self._batch:
            return
        data = b"".join(self._batch)
        self._batch, self._batch_bytes = [], 0
        for event in split_events(data):
            if b"content_block_" not in event[:40]:
                continue
            _, _, payload = event.partition(b"data: ")
            try:
                parsed = _EVENT.decode(payload.rstrip(b"\n"))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            block, delta = parsed.content_block, parsed.delta
            if block is not None and block.type == "tool_use":
                self._tools.setdefault(parsed.index, [[], []])[0].append(block.name or "")
                if len(block.input):
                    self._start_inputs[parsed.index] = bytes(block.input).decode("utf-8")
            elif block is not None and block.type == "text" and block.text:
                self._text.append(block.text)
            if delta is None:
                continue
            if delta.type == "text_delta" and delta.text:
                self._text.append(delta.text)
            elif delta.type == "input_json_delta" and delta.partial_json:
                self._tools.setdefault(parsed.index, [[], []])[1].append(delta.partial_json)
