"""The bench's Anthropic Messages client: one agent turn over ``/v1/messages``, measured.

Same measurement contract as ``ChatClient`` (``bench.client``), Messages events instead of
chat chunks (``t0`` read just before the request is sent):

* ``ttft_s``: arrival of the first ``content_block_start`` (or, without one, the first
  ``content_block_delta``), minus ``t0``: the first sign that D is generating the answer.
  A forced call's head (``<tool_call>``, its name) is decoded before its first argument
  delta; timing the block's start keeps the TTFTs of tool-call and text turns comparable
  (the fake engine opens a forced call's block as soon as D admitted the request), so a
  wait for D's blocks shows undiluted by that decode;
* ``tpot_s``: ``(last delta - first delta) / (n - 1)``, ``n`` the answer's output tokens
  (``message_delta``'s usage, else the number of deltas) for a text answer, the number of
  argument deltas for a tool call (its head is before the first);
* ``e2e_s``: ``message_stop`` (or the stream's end) minus ``t0``; a non-streamed request
  reports ``ttft_s = e2e_s``;
* usage: the prompt is ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens`` of ``message_start`` (the router's rewrite moves tokens
  between them), the output ``message_delta``'s ``output_tokens``;
* the decision: the router's headers, else the ``/stats`` fallback (``ChatClient``'s);
* failures (HTTP errors, an ``error`` event, transport errors, a stream without a delta)
  are returned as ``TurnResult(error=...)``, never raised.

Requests. Every request carries the same ``tools`` (``TOOLS``: one tool, ``run``, whose
input is ``{"input": <string>}``), so the prompt's tool definitions never change within a
conversation; a turn that forces a call adds ``tool_choice {"type": "tool", "name":
"run"}``, the others send no ``tool_choice`` (the API's ``auto``). ``messages_body`` turns a
bench history (``bench.tool_calls``' convention) into Messages form: leading system messages
become ``system``, a tool-call answer an assistant ``tool_use`` block (its id, name and
input as the server gave them), a tool result a user ``tool_result`` block. The answer's
tool call comes back in ``TurnResult.tool_call`` when its input is a complete JSON object
(a call cut off by ``max_tokens`` is none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvrelay.bench.client import (
    CONVERSATION_HEADER,
    ChatClient,
    Decision,
    TurnResult,
    decision_from_headers,
)
from kvrelay.bench.tokens import ChatMessage
from kvrelay.bench.tool_calls import TOOL_USE_ID, ToolUse
from kvrelay.client.sse import json_chunk, json_count, sse_data

TOOL_NAME = "run"
#: The tool every request offers (Claude Code's Bash-like: one string in, its output back).
TOOLS: tuple[Mapping[str, object], ...] = ({
    "name": TOOL_NAME,
    "description": "Run a command in the agent's workspace and return its output.",
    "input_schema": {"type": "object", "properties": {"input": {"type": "string"}},
                     "required": ["input"]},
},)
MESSAGES_PATH = "/v1/messages"


def messages_body(
    model: str,
    history: Sequence[ChatMessage],
    *,
    max_tokens: int,
    stream: bool,
    tool_call: bool,
    extra_body: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The ``/v1/messages`` body of one turn (module docstring). ``ValueError`` for a
    ``tool`` message without the call's ``tool_use_id`` or a role Messages has no form for."""
    system: list[str] = []
    messages: list[dict[str, object]] = []
    for m in history:
        role, content = m["role"], m["content"]
        if role == "system" and not messages:
            system.append(content)
            continue
        call = ToolUse.of_message(m)
        if call is not None:
            messages.append({"role": "assistant", "content": [{
                "type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]})
        elif role == "tool":
            if not m.get(TOOL_USE_ID):
                raise ValueError("a tool result needs the call's tool_use_id "
                                 "(bench.tool_calls.answer_tool_results)")
            messages.append({"role": "user", "content": [{
                "type": "tool_result", "tool_use_id": m[TOOL_USE_ID], "content": content}]})
        elif role in ("user", "assistant", "system"):
            messages.append({"role": role, "content": content})
        else:
            raise ValueError(f"no Messages form for a {role!r} message")
    body: dict[str, object] = {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
        "tools": [dict(t) for t in TOOLS], "messages": messages, **(extra_body or {}),
    }
    if system:
        body["system"] = "\n\n".join(system)
    if tool_call:
        body["tool_choice"] = {"type": "tool", "name": TOOL_NAME}
    return body


@dataclass
class _Block:
    kind: str
    id: str = ""
    name: str = ""
    parts: list[str] = field(default_factory=list)


@dataclass
class MessagesStreamMeter:
    """Pure accumulator of a streamed Messages response: feed it each SSE ``data`` payload
    and the clock reading at its arrival (see the module's measurement contract)."""

    started_s: float
    first_block_s: float | None = None
    first_delta_s: float | None = None
    last_delta_s: float | None = None
    deltas: int = 0
    tool_deltas: int = 0
    blocks: dict[int, _Block] = field(default_factory=dict)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    done: bool = False

    def feed(self, payload: str, now: float) -> None:
        try:
            event = json_chunk(payload)
        except ValueError:
            self.error = f"malformed stream event: {payload[:200]!r}"
            return
        if event is None:
            return
        kind = event.get("type")
        if kind == "error":
            self.error = f"stream error: {json.dumps(event.get('error'))[:500]}"
        elif kind == "message_start":
            message = event.get("message")
            if isinstance(message, dict):
                self.prompt_tokens = _prompt_tokens(message.get("usage")) or self.prompt_tokens
        elif kind == "content_block_start":
            if self.first_block_s is None:
                self.first_block_s = now
            block = event.get("content_block")
            if isinstance(block, dict):
                self.blocks[_index(event)] = _Block(str(block.get("type") or ""),
                                                    str(block.get("id") or ""),
                                                    str(block.get("name") or ""))
        elif kind == "content_block_delta":
            self._delta(event, now)
        elif kind == "message_delta":
            usage = event.get("usage")
            if isinstance(usage, dict):
                self.output_tokens = json_count(usage.get("output_tokens")) or self.output_tokens
        elif kind == "message_stop":
            self.done = True

    def _delta(self, event: Mapping[str, object], now: float) -> None:
        delta = event.get("delta")
        if not isinstance(delta, dict):
            return
        piece = delta.get("text") if delta.get("type") == "text_delta" else (
            delta.get("partial_json") if delta.get("type") == "input_json_delta" else None)
        if not isinstance(piece, str):
            return
        if self.first_delta_s is None:
            self.first_delta_s = now
        self.last_delta_s = now
        self.deltas += 1
        if delta["type"] == "input_json_delta":
            self.tool_deltas += 1
        block = self.blocks.setdefault(_index(event), _Block(
            "tool_use" if delta["type"] == "input_json_delta" else "text"))
        block.parts.append(piece)

    def tool_call(self) -> ToolUse | None:
        """The answer's first ``tool_use`` block whose input is a complete JSON object."""
        for _, block in sorted(self.blocks.items()):
            if block.kind == "tool_use":
                return _tool_use(block.id, block.name, "".join(block.parts))
        return None

    def result(
        self, ended_s: float, status: int, decision: Decision | None, error: str | None = None
    ) -> TurnResult:
        call = self.tool_call()
        text = "".join("".join(b.parts) for _, b in sorted(self.blocks.items())
                       if b.kind == "text")
        steps = self.tool_deltas if call is not None else (self.output_tokens or self.deltas)
        tpot: float | None = None
        if self.first_delta_s is not None and self.last_delta_s is not None and steps > 1:
            tpot = (self.last_delta_s - self.first_delta_s) / (steps - 1)
        error = error or self.error
        if error is None and self.first_delta_s is None:
            error = "stream ended without content"
        first = self.first_block_s if self.first_block_s is not None else self.first_delta_s
        return TurnResult(
            status=status, text=text,
            ttft_s=None if first is None else first - self.started_s,
            tpot_s=tpot, e2e_s=ended_s - self.started_s, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.output_tokens or self.deltas, decision=decision,
            error=error, tool_call=call,
        )


def _index(event: Mapping[str, object]) -> int:
    index = json_count(event.get("index"))
    return 0 if index is None else index


def _prompt_tokens(usage: object) -> int | None:
    if not isinstance(usage, dict):
        return None
    parts = [json_count(usage.get(k)) for k in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
    return None if parts[0] is None else sum(p or 0 for p in parts)


def _tool_use(block_id: str, name: str, input_json: str) -> ToolUse | None:
    try:
        value = json.loads(input_json)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return ToolUse(block_id, name, json.dumps(value, ensure_ascii=False))


class MessagesClient(ChatClient):
    """Agent turns against one Messages-speaking base URL (the router, or vLLM): the chat
    client's connection, options (``extra_body`` merged into every body) and ``/stats``
    fallback, turns over ``/v1/messages`` (module docstring)."""

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        max_tokens: int,
        conversation_id: str | None = None,
        stream: bool = True,
        tool_call: bool = False,
    ) -> TurnResult:
        """Send one turn, forcing a call of ``run`` when ``tool_call``, and measure it.
        ``ValueError`` (raised) for a history ``messages_body`` cannot send."""
        body = messages_body(self.model, messages, max_tokens=max_tokens, stream=stream,
                             tool_call=tool_call, extra_body=self.extra_body)
        headers = {CONVERSATION_HEADER: conversation_id} if conversation_id else {}
        if stream:
            return await self._measured(
                lambda started: self._streamed_messages(body, headers, started),
                conversation_id)
        return await self._measured(
            lambda started: self._whole_message(body, headers, started), conversation_id)

    async def _streamed_messages(
        self, body: dict[str, object], headers: dict[str, str], started: float
    ) -> TurnResult:
        meter = MessagesStreamMeter(started)
        async with self.http.stream("POST", MESSAGES_PATH, json=body, headers=headers) as resp:
            decision = decision_from_headers(resp.headers)
            if resp.status_code >= 400:
                detail = (await resp.aread()).decode(errors="replace")[:1000]
                return meter.result(self.clock(), resp.status_code, decision,
                                    error=f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                payload = sse_data(line)
                if payload is not None:
                    meter.feed(payload, self.clock())
                    if meter.done or meter.error:
                        break
        return meter.result(self.clock(), resp.status_code, decision)

    async def _whole_message(
        self, body: dict[str, object], headers: dict[str, str], started: float
    ) -> TurnResult:
        resp = await self.http.post(MESSAGES_PATH, json=body, headers=headers)
        ended = self.clock()
        decision = decision_from_headers(resp.headers)
        if resp.status_code >= 400:
            return TurnResult(resp.status_code, "", None, None, ended - started, None, 0,
                              decision, error=f"HTTP {resp.status_code}: {resp.text[:1000]}")
        data = resp.json()
        content = data.get("content") if isinstance(data, dict) else None
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        text = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
        calls = [b for b in blocks if b.get("type") == "tool_use"]
        call = _tool_use(str(calls[0].get("id") or ""), str(calls[0].get("name") or ""),
                         json.dumps(calls[0].get("input"))) if calls else None
        usage = data.get("usage") if isinstance(data, dict) else None
        output = json_count(usage.get("output_tokens")) if isinstance(usage, dict) else None
        return TurnResult(resp.status_code, text, ended - started, None, ended - started,
                          _prompt_tokens(usage), output or 0, decision, tool_call=call)
