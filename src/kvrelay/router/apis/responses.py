"""``POST /v1/responses``: OpenAI's Responses API (Codex, the Agents SDK) through P/D.

**Canonical history.** ``input`` as a list of items (a string input is one user message).
The items D produced for one turn (``reasoning``, an assistant ``message``, ``function_call``
items, ``custom_tool_call`` items) are re-sent together; consecutive such items form **one**
history item whose answer digest is their ``output_text`` and tool calls
(``core.identity.answer_digest``; a namespaced call as ``<namespace>__<name>``, a custom
call with its ``input``), the same digest the router computes from D's ``output``. Every
other item (user, developer and system messages, ``function_call_output``) is one item. The
context: model, instructions, tools, reasoning (its effort renders into the prompt),
template kwargs.

**Tools.** ``function``, ``namespace`` and ``custom`` tools are rendered by vLLM
(``RENDERED_TOOLS``) and go through; Codex sends all three kinds, and a ``web_search`` tool,
which vLLM neither renders nor runs (it goes through too). The tools vLLM's tool server runs
(``TOOL_SERVER_TOOLS``) are refused.

**What P/D cannot carry** is refused with a 400 in OpenAI's error shape:
``previous_response_id`` without the response store and ``conversation`` (send the whole
input with ``store: false``), ``background``, and tool-server tools (web search preview,
code interpreter, container, MCP: vLLM runs several engine requests for one response).
Without the store, ``store: true`` is served as ``store: false`` (P and D are told ``store:
false``; the response says so) and nothing is stored. With the router's
response store on (``router.stored_responses``), ``previous_response_id`` is expanded into
the input before this adapter sees the body, and ``store: true`` responses are kept.

**Stream.** vLLM's ``event: <type>`` events pass through byte for byte, except: the
``"kv_transfer_params":null`` every response snapshot carries (cut as bytes), and the final
``response.completed`` / ``response.incomplete`` event, parsed once: D's params taken out,
the answer read from ``response.output``, ``usage.input_tokens_details.cached_tokens`` set
to the prompt tokens P did not compute.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from kvrelay.core.identity import ChatMessage, History, ToolCall, answer_digest
from kvrelay.router.apis.base import ApiRequest, DecodeRead, StreamScanner
from kvrelay.router.apis.chat import openai_user
from kvrelay.router.apis.fields import (
    JsonObject,
    context_bytes,
    encode,
    message_text,
    optional,
    positive,
)
from kvrelay.router.errors import ClientError, RouterError, dumps
from kvrelay.router.sse import Rewrite, split_events

CONTEXT_FIELDS = ("model", "instructions", "tools", "reasoning", "chat_template_kwargs")
_OUTPUT_TYPES = frozenset({"reasoning", "function_call", "custom_tool_call"})
_P_DROPPED = ("stream_options", "background", "top_logprobs")
_NULL_PARAMS = b',"kv_transfer_params":null'
_MARK_PARAMS = b'"kv_transfer_params"'
FINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n",
                b"event: response.failed\n")
"""The events that end a response stream, each with the final response snapshot."""
_ERROR = b"event: error\n"
_SEQUENCE = b'"sequence_number":'
_DIGITS = re.compile(rb" *(\d+)")
_DECODER = msgspec.json.Decoder()


def snapshot_of(event: bytes) -> tuple[bytes, dict[str, Any], dict[str, Any]] | None:
    """One SSE event's head (through ``data: ``), its JSON object and that object's
    ``response`` snapshot, to be patched in place and written back as ``head + dumps(obj)``;
    ``None`` when the event carries no response object (not JSON, or none in it)."""
    head, sep, data = event.partition(b"data: ")
    try:
        obj = _DECODER.decode(data.rstrip(b"\n"))
    except msgspec.DecodeError:
        return None
    response = obj.get("response") if isinstance(obj, dict) else None
    if not isinstance(response, dict):
        return None
    return head + sep, obj, response


class _Usage(msgspec.Struct):
    input_tokens: int = 0


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None
    usage: _Usage | None = None


_ANSWER = msgspec.json.Decoder(_PrefillAnswer)


class ResponsesAdapter:
    """The Responses API (module docstring)."""

    __slots__ = ()
    endpoint = "responses"
    path = "/v1/responses"
    tokenizable = False
    stream_family = "responses"

    def conversation_hint(self, body: JsonObject, headers: Mapping[str, str]) -> str | None:
        return None

    def end_user(self, body: JsonObject) -> str | None:
        return openai_user(body)

    def parse(self, body: JsonObject) -> ApiRequest:
        optional(body, "model", str)
        optional(body, "instructions", str)
        stream = bool(optional(body, "stream", bool))
        optional(body, "store", bool)
        if body.get("previous_response_id") is not None:  # the store expands it before this
            raise ClientError(
                "previous_response_id is not supported: the P/D router keeps no responses. "
                "Send the whole conversation in `input` every turn, with `store: false` (or "
                "run the router with --response-store)", "previous_response_id",
                code="previous_response_not_found")  # OpenAI's: clients re-send the input
        if body.get("conversation") is not None:
            raise ClientError(
                "conversation (the Conversations API) is not supported by the P/D router: "
                "send the whole conversation in `input` every turn (or chain turns with "
                "previous_response_id on a router run with --response-store)", "conversation")
        if optional(body, "background", bool):
            raise ClientError("background responses are not supported by the P/D router",
                              "background")
        _check_tools(body)
        max_tokens = positive(body, "max_output_tokens")
        history = History("responses", context_bytes(body, CONTEXT_FIELDS),
                          tuple(_items(body.get("input"))))
        return ApiRequest(history=history, stream=stream, include_usage=stream,
                          wants_token_ids=False, max_output_tokens=max_tokens)

    def tokenize_body(self, body: JsonObject, req: ApiRequest) -> JsonObject | None:
        return None

    def prefill_body(self, body: JsonObject, params: Mapping[str, object]) -> bytes:
        out = dict(body)
        for key in _P_DROPPED:
            out.pop(key, None)
        out["stream"] = False
        out["store"] = False
        out["max_output_tokens"] = 1
        out["kv_transfer_params"] = params
        return encode(out)

    def decode_body(
        self, body: JsonObject, params: Mapping[str, object], *, token_ids: bool
    ) -> bytes:
        out = dict(body)
        out["store"] = False
        out["kv_transfer_params"] = params
        return encode(out)

    def prefill_answer(self, raw: bytes) -> tuple[dict[str, object] | None, int]:
        answer = _ANSWER.decode(raw)
        return answer.kv_transfer_params, answer.usage.input_tokens if answer.usage else 0

    def scanner(self, rewrite: Rewrite) -> StreamScanner:
        return ResponsesScan(rewrite)

    def rewrite_body(self, obj: JsonObject, rewrite: Rewrite) -> DecodeRead:
        params = obj.pop("kv_transfer_params", None)
        text, calls = output_answer(obj.get("output"))
        if rewrite.cached_tokens is not None:
            set_cached_tokens(obj, rewrite.cached_tokens)
        return DecodeRead(params, text, calls, None, [])

    def error(self, exc: ClientError | RouterError) -> bytes:
        return exc.body()


RENDERED_TOOLS = frozenset({"function", "namespace", "custom"})
"""Tool types vLLM renders into the prompt (0.32 and 0.33): a function; a namespace's
functions, flattened to ``<namespace>__<name>``; a custom tool, as a function taking one
string (``input``)."""

TOOL_SERVER_TOOLS = frozenset({
    "web_search_preview", "web_search_preview_2025_03_11", "code_interpreter", "container",
    "mcp",
})
"""Tool types vLLM hands to its tool server (``--tool-server``: browser, python, container,
MCP), running several engine requests for one response: refused. Any other type
(``web_search``, ``file_search``, ``image_generation``, ``local_shell``, ...) vLLM neither
renders nor runs, so it goes through (and stays in the context digest)."""


def _check_tools(body: Mapping[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ClientError("tools must be a list", "tools")
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise ClientError("every tool must be an object with a string type", "tools")
        if kind in TOOL_SERVER_TOOLS:
            raise ClientError(
                f"tool type {kind!r} is not supported by the P/D router: built-in tools run "
                "on vLLM's tool server, several engine requests for one response; function, "
                "namespace and custom tools go through P/D", "tools")
        if kind == "namespace" and not isinstance(tool.get("tools"), list):
            raise ClientError("a namespace tool needs a list of tools", "tools")


def _items(value: object) -> list[ChatMessage]:
    """The canonical items of ``input`` (module docstring)."""
    if isinstance(value, str):
        if not value:
            raise ClientError("input must not be empty", "input")
        return [ChatMessage(encode({"role": "user", "content": value}))]
    if not isinstance(value, list) or not value:
        raise ClientError("input must be a string or a non-empty list of items", "input")
    out: list[ChatMessage] = []
    group: list[dict[str, Any]] = []
    for item in value:
        if not isinstance(item, dict):
            raise ClientError("every input item must be an object", "input")
        if not isinstance(item.get("type", ""), (str, type(None))):
            raise ClientError("an input item's type must be a string", "input")
        if _is_output(item):
            group.append(item)
            continue
        if group:
            out.append(_group_item(group))
            group = []
        out.append(ChatMessage(encode(item)))
    if group:
        out.append(_group_item(group))
    return out


def _is_output(item: Mapping[str, Any]) -> bool:
    kind = item.get("type")
    if kind in _OUTPUT_TYPES:
        return True
    return kind in (None, "message") and item.get("role") == "assistant"


def _group_item(group: list[dict[str, Any]]) -> ChatMessage:
    text, calls = output_answer(group)
    return ChatMessage(encode(group), answer_digest(text, calls))


def output_answer(output: object) -> tuple[str, list[ToolCall]]:
    """The answer in Responses output items (D's ``output``, or re-sent input items): the
    assistant messages' text and the function calls; reasoning is not part of it."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            args = item.get("arguments" if kind == "function_call" else "input")
            namespace = item.get("namespace")
            name = name if isinstance(name, str) else ""
            if isinstance(namespace, str) and namespace:
                name = f"{namespace}__{name}"
            calls.append(ToolCall(name, args if isinstance(args, str) else ""))
        elif kind in (None, "message") and item.get("role") == "assistant":
            texts.append(message_text(item.get("content")))
    return "".join(texts), calls


def set_cached_tokens(response: Mapping[str, Any], cached_tokens: int) -> bool:
    """``usage.input_tokens_details.cached_tokens`` = the prompt tokens P did not compute
    (D's own count covers what it loaded from P, not what P reused)."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return False
    prompt = usage.get("input_tokens")
    cached = min(cached_tokens, prompt) if isinstance(prompt, int) else cached_tokens
    details = usage.get("input_tokens_details")
    usage["input_tokens_details"] = {
        **(details if isinstance(details, dict) else {}), "cached_tokens": max(0, cached)
    }
    return True


class ResponsesScan:
    """The ``StreamScanner`` of a Responses stream (module docstring)."""

    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite
        self._text = ""
        self._calls: list[ToolCall] = []
        self.done = False
        self.error: object = None
        self.params: object = None
        self.params_seen = False
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []
        self.sequence_number = -1
        """The last event's ``sequence_number`` relayed (-1 before any)."""

    def feed(self, events: bytes) -> bytes:
        self._count(events)
        if _NULL_PARAMS in events:
            events = events.replace(_NULL_PARAMS, b"")
        if _MARK_PARAMS in events or _ERROR in events or any(m in events for m in FINAL_EVENTS):
            events = b"".join(self._event(e) for e in split_events(events))
        return events

    def answer(self) -> tuple[str, list[ToolCall]]:
        return self._text, self._calls

    def cut(self, status: int, message: str) -> bytes:
        """An ``error`` event numbered after the last one relayed (clients order events by
        ``sequence_number``)."""
        return b"event: error\ndata: " + dumps({
            "type": "error", "code": str(status), "message": message, "param": None,
            "sequence_number": self.sequence_number + 1,
        }) + b"\n\n"

    def _count(self, events: bytes) -> None:
        """Keep the last ``sequence_number`` in ``events`` (one reverse search per feed,
        not a parse: the stream stays byte pass-through)."""
        at = events.rfind(_SEQUENCE)
        if at < 0:
            return
        digits = _DIGITS.match(events, at + len(_SEQUENCE))
        if digits is not None:
            self.sequence_number = int(digits.group(1))

    def _event(self, event: bytes) -> bytes:
        if event.startswith(_ERROR):
            self.error = event
            self.done = True
            return event
        final = event.startswith(FINAL_EVENTS)
        if not final and _MARK_PARAMS not in event:
            return event
        found = snapshot_of(event)
        if found is None:
            return event
        head, obj, response = found
        if "kv_transfer_params" in response:
            self.params = response.pop("kv_transfer_params")
            self.params_seen = True
        if final:
            self.done = True
            if event.startswith(b"event: response.failed\n"):
                self.error = response.get("error") or "failed"
            self._text, self._calls = output_answer(response.get("output"))
            if self._rewrite.cached_tokens is not None:
                set_cached_tokens(response, self._rewrite.cached_tokens)
        return head + dumps(obj) + b"\n\n"
