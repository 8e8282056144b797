"""D's responses as the client gets them: SSE bytes passed through, a few events rewritten.

A streamed chunk from D reaches the client byte for byte. The relay only frames events
(``frame``: up to the last blank line; no JSON parse) and looks for a handful of byte
markers; only an event that holds one is parsed and rewritten:

* ``kv_transfer_params`` (vLLM >= 0.33 puts D's retained params on the final chunk, ``null``
  on the chunks before it, and ``null`` on the final one when D retained nothing): taken out,
  the last value kept for the entry (``params_seen`` tells a 0.33 ``null`` from a stream
  that never carries the key);
* the usage event, when the client asked for ``stream_options.include_usage``: it gets
  ``prompt_tokens_details.cached_tokens``, the prompt tokens P did not compute, unless D
  already reported them (OpenAI's convention, so clients and benchmarks see cache reads);
* token ids the router asked D for (``/tokenize`` mode only) and the client did not:
  collected and removed;
* ``{"error": ...}`` events: noted (the entry is then not kept).

The answer the next turn will carry (content, tool calls, or completion text) is read from
the relayed events in batches of ``BATCH_BYTES``, one parse per batch, off the per-chunk
path (``StreamScan.answer``). Non-streamed bodies are parsed once (``rewrite_body``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvrelay.core.identity import ToolCall, message_tool_calls
from kvrelay.router.errors import dumps, error_body

SSE_DONE = b"data: [DONE]\n\n"
BATCH_BYTES = 64 * 1024

_MARK_PARAMS = b'"kv_transfer_params"'
_NULL_PARAMS = b',"kv_transfer_params":null'
"""vLLM 0.33's key on every streamed token chunk (compact JSON, never first): cut as bytes.
Inside a JSON string a quote is escaped, so these bytes only ever are the key itself."""
_MARK_USAGE = b'"usage":{'
_MARK_IDS = b'token_ids":['
_MARK_ERROR = b'"error"'


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolDelta(msgspec.Struct):
    index: int = 0
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolDelta] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    text: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_CHUNKS = msgspec.json.Decoder(list[_Chunk])
_DECODER = msgspec.json.Decoder()


def frame(carry: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """``(complete events, rest)`` of ``carry + chunk``: everything up to the last blank
    line, and what follows it (an event still arriving)."""
    data = carry + chunk if carry else chunk
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return b"", data
    return data[: cut + 2], data[cut + 2 :]


def sse_error(status: int, message: str) -> bytes:
    """A mid-stream error event in vLLM's shape (``data: {"error": {...}}``)."""
    return b"data: " + dumps(error_body(status, message)) + b"\n\n"


@dataclass
class _Answer:
    """The answer being assembled from choice 0: text and tool calls by index."""

    text: list[str] = field(default_factory=list)
    tools: dict[int, list[list[str]]] = field(default_factory=dict)

    def add_delta(self, delta: _Delta | None, text: str | None) -> None:
        if text:
            self.text.append(text)
        if delta is None:
            return
        if delta.content:
            self.text.append(delta.content)
        for call in delta.tool_calls or ():
            name_args = self.tools.setdefault(call.index, [[], []])
            if call.function is not None:
                if call.function.name:
                    name_args[0].append(call.function.name)
                if call.function.arguments:
                    name_args[1].append(call.function.arguments)

    def calls(self) -> list[ToolCall]:
        return [ToolCall("".join(n), "".join(a)) for _, (n, a) in sorted(self.tools.items())]


@dataclass
class Rewrite:
    """How relayed events are changed: ``cached_tokens`` for the usage event (``None``:
    leave usage alone), whether token ids are removed (the router asked for them, the client
    did not) and collected (``/tokenize`` mode)."""

    cached_tokens: int | None = None
    strip_ids: bool = False
    collect_ids: bool = False


class StreamScan:
    """Watches the events of one relayed stream (module docstring). ``feed`` returns the
    bytes to send for complete events."""

    def __init__(self, rewrite: Rewrite) -> None:
        self._rewrite = rewrite
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._answer = _Answer()
        self.done = False
        self.error: object = None
        self.params: object = None
        self.params_seen = False
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []

    def feed(self, events: bytes) -> bytes:
        if events.endswith(SSE_DONE):
            self.done = True
        rw = self._rewrite
        if _NULL_PARAMS in events:
            events = events.replace(_NULL_PARAMS, b"")
            self.params_seen = True
        if (
            _MARK_PARAMS in events
            or _MARK_ERROR in events
            or (rw.cached_tokens is not None and _MARK_USAGE in events)
            or ((rw.strip_ids or rw.collect_ids) and _MARK_IDS in events)
        ):
            events = b"".join(self._event(e) for e in split_events(events))
        self._batch.append(events)
        self._batch_bytes += len(events)
        if self._batch_bytes >= BATCH_BYTES:
            self._parse_batch()
        return events

    def cut(self, status: int, message: str) -> bytes:
        return sse_error(status, message) + SSE_DONE

    def answer(self) -> tuple[str, list[ToolCall]]:
        """The answer relayed so far: its text and tool calls (choice 0)."""
        self._parse_batch()
        return "".join(self._answer.text), self._answer.calls()

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        try:
            obj = _DECODER.decode(event[6:].rstrip(b"\n"))
        except msgspec.DecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        changed = False
        if obj.get("error") is not None:
            self.error = obj["error"]
        if "kv_transfer_params" in obj:
            self.params = obj.pop("kv_transfer_params")
            self.params_seen = True
            changed = True
        rw = self._rewrite
        if rw.collect_ids:
            self._collect_ids(obj)
        if rw.strip_ids:
            changed = strip_ids(obj) or changed
        if rw.cached_tokens is not None:
            changed = add_cached_tokens(obj, rw.cached_tokens) or changed
        return b"data: " + dumps(obj) + b"\n\n" if changed else event

    def _collect_ids(self, obj: dict[str, Any]) -> None:
        top = obj.get("prompt_token_ids")
        if isinstance(top, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = _ints(top)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            prompt = choice.get("prompt_token_ids")
            if isinstance(prompt, list) and self.prompt_token_ids is None:
                self.prompt_token_ids = _ints(prompt)
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.output_token_ids.extend(_ints(ids))

    def _parse_batch(self) -> None:
        if not self._batch:
            return
        data = b"".join(self._batch)
        self._batch, self._batch_bytes = [], 0
        if data.endswith(SSE_DONE):
            data = data[: -len(SSE_DONE)]
        chunks: list[_Chunk] | None = None
        if data.startswith(b"data: {") and data.endswith(b"}\n\n"):
            # vLLM's events are "data: {json}\n\n"; JSON never holds a raw newline, so the
            # whole batch becomes one JSON list with two byte replacements.
            try:
                chunks = _CHUNKS.decode(b"[" + data[6:-2].replace(b"\n\ndata: ", b",") + b"]")
            except (msgspec.DecodeError, msgspec.ValidationError):
                chunks = None
        if chunks is None:
            payloads = [e[6:] for e in split_events(data) if e.startswith(b"data: {")]
            chunks = [_safe_chunk(p) for p in payloads]
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.index == 0:
                    self._answer.add_delta(choice.delta, choice.text)


def rewrite_body(
    obj: dict[str, Any], rewrite: Rewrite
) -> tuple[object, str, list[ToolCall], list[int] | None, list[int]]:
    """A non-streamed answer, changed in place like a stream's events; returns D's params,
    the answer (text, tool calls) and the token ids (``/tokenize`` mode)."""
    params = obj.pop("kv_transfer_params", None)
    prompt_ids: list[int] | None = None
    output_ids: list[int] = []
    text, calls = "", []
    top = obj.get("prompt_token_ids")
    if isinstance(top, list):
        prompt_ids = _ints(top)
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            content = message.get("content")
            text = content if isinstance(content, str) else ""
            calls = message_tool_calls(message)
        elif isinstance(choice.get("text"), str):
            text = choice["text"]
        if isinstance(choice.get("prompt_token_ids"), list) and prompt_ids is None:
            prompt_ids = _ints(choice["prompt_token_ids"])
        if isinstance(choice.get("token_ids"), list):
            output_ids = _ints(choice["token_ids"])
    if rewrite.strip_ids:
        strip_ids(obj)
    if rewrite.cached_tokens is not None:
        add_cached_tokens(obj, rewrite.cached_tokens)
    return params, text, calls, prompt_ids, output_ids


def strip_ids(obj: dict[str, Any]) -> bool:
    """Remove token-id keys (top level and per choice; vLLM's own ``null`` ones too); True if
    any held ids."""
    changed = obj.pop("prompt_token_ids", None) is not None
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            changed = choice.pop("token_ids", None) is not None or changed
            changed = choice.pop("prompt_token_ids", None) is not None or changed
    return changed


def add_cached_tokens(obj: dict[str, Any], cached_tokens: int) -> bool:
    """Fill ``usage.prompt_tokens_details.cached_tokens`` unless D reported it."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return False
    prompt = usage.get("prompt_tokens")
    cached = min(cached_tokens, prompt) if isinstance(prompt, int) else cached_tokens
    usage["prompt_tokens_details"] = {
        **(details if isinstance(details, dict) else {}), "cached_tokens": max(0, cached)
    }
    return True


def split_events(events: bytes) -> list[bytes]:
    """Complete events, each with its trailing blank line."""
    parts = events.split(b"\n\n")
    return [p + b"\n\n" for p in parts if p]


def _safe_chunk(payload: bytes) -> _Chunk:
    try:
        return msgspec.json.decode(payload.rstrip(b"\n"), type=_Chunk)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Chunk()


def _ints(values: list[object]) -> list[int]:
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
