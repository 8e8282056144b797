"""An async OpenAI chat client that measures one turn: TTFT, TPOT, end-to-end, decision.

Timing contract (all from ``clock``, ``time.perf_counter`` by default; ``t0`` is read just
before the request is sent):

* ``ttft_s``: arrival of the first SSE chunk whose ``delta.content`` is non-empty, minus
  ``t0``. Role-only chunks, empty contents and usage chunks do not count.
* ``tpot_s``: ``(last content chunk - first content chunk) / (completion_tokens - 1)``, with
  ``completion_tokens`` from the stream's usage chunk (else the number of content chunks);
  ``None`` for fewer than two tokens.
* ``e2e_s``: end of the response (``[DONE]`` or the stream's end) minus ``t0``.

Non-streamed requests (``stream=False``) report ``ttft_s = e2e_s`` and no TPOT.

Decision: the router's ``X-KVRelay-Action`` / ``X-KVRelay-Reason`` / ``X-KVRelay-Reused-Tokens``
(and ``X-KVRelay-Released-Cause``) response headers when present; otherwise, with a
``StatsDecisions`` probe, the newest ``/stats`` record of this conversation that was not
seen before; else ``None``. Failures (HTTP errors, mid-stream error events, transport
errors) are returned as ``TurnResult`` with ``error`` set, never raised, so a benchmark run
records them and goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Self

import httpx

from kvrelay.bench.tokens import ChatMessage
from kvrelay.bench.tool_calls import ToolUse
from kvrelay.client.sse import (
    DONE,
    Usage,
    chunk_content,
    chunk_error,
    json_chunk,
    json_count,
    sse_data,
    usage_of,
)
from kvrelay.core.conversation import ConversationKey

Clock = Callable[[], float]
DecisionSource = Literal["headers", "stats"]

ACTION_HEADER = "x-kvrelay-action"
REASON_HEADER = "x-kvrelay-reason"
REUSED_HEADER = "x-kvrelay-reused-tokens"
RELEASED_CAUSE_HEADER = "x-kvrelay-released-cause"
CONVERSATION_HEADER = "X-Conversation-ID"


@dataclass(frozen=True)
class Decision:
    """What the router did with a turn (``action``: pull/recompute/direct) and why."""

    action: str
    reason: str | None
    reused_tokens: int | None
    source: DecisionSource
    released_cause: str | None = None
    """For reason ``released``: why D freed the blocks (``X-KVRelay-Released-Cause``)."""


def decision_from_headers(headers: Mapping[str, str]) -> Decision | None:
    """The decision carried by response headers (case-insensitive), ``None`` without one."""
    lowered = {k.lower(): v for k, v in headers.items()}
    action = lowered.get(ACTION_HEADER)
    if not action:
        return None
    reused: int | None
    try:
        reused = int(lowered[REUSED_HEADER])
    except (KeyError, ValueError):
        reused = None
    return Decision(action, lowered.get(REASON_HEADER) or None, reused, "headers",
                    lowered.get(RELEASED_CAUSE_HEADER) or None)


@dataclass(frozen=True)
class TurnResult:
    """One request's measurements; ``error`` is set (and ``ok`` false) when it failed.
    ``tool_call``: the tool call the answer made (only the Messages client reads them)."""

    status: int
    text: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    prompt_tokens: int | None
    completion_tokens: int
    decision: Decision | None
    error: str | None = None
    tool_call: ToolUse | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class StreamMeter:
    """Pure accumulator of a streamed chat response: feed it each SSE ``data`` payload and
    the clock reading at its arrival (see the module's timing contract)."""

    started_s: float
    first_content_s: float | None = None
    last_content_s: float | None = None
    content_chunks: int = 0
    parts: list[str] = field(default_factory=list)
    usage: Usage | None = None
    error: str | None = None
    done: bool = False

    def feed(self, payload: str, now: float) -> None:
        if payload.strip() == DONE:
            self.done = True
            return
        try:
            chunk = json_chunk(payload)
        except ValueError:
            self.error = f"malformed stream chunk: {payload[:200]!r}"
            return
        if chunk is None:
            return
        error = chunk_error(chunk)
        if error is not None:
            self.error = f"stream error: {json.dumps(error)[:500]}"
            return
        content = chunk_content(chunk)
        if content:
            if self.first_content_s is None:
                self.first_content_s = now
            self.last_content_s = now
            self.content_chunks += 1
            self.parts.append(content)
        self.usage = usage_of(chunk) or self.usage

    def result(
        self, ended_s: float, status: int, decision: Decision | None, error: str | None = None
    ) -> TurnResult:
        completion = self.content_chunks
        prompt: int | None = None
        if self.usage is not None:
            completion = self.usage.completion_tokens or completion
            prompt = self.usage.prompt_tokens
        tpot: float | None = None
        if (self.first_content_s is not None and self.last_content_s is not None
                and completion > 1):
            tpot = (self.last_content_s - self.first_content_s) / (completion - 1)
        error = error or self.error
        if error is None and self.first_content_s is None:
            error = "stream ended without content"
        return TurnResult(
            status=status,
            text="".join(self.parts),
            ttft_s=None if self.first_content_s is None else self.first_content_s - self.started_s,
            tpot_s=tpot,
            e2e_s=ended_s - self.started_s,
            prompt_tokens=prompt,
            completion_tokens=completion,
            decision=decision,
            error=error,
        )


def decision_counters(stats: object) -> dict[str, Any]:
    """The decision part of a ``/stats`` body (``by_action``, ``by_reason``, ``recent``):
    under ``"decisions"``, or at the top level; ``{}`` for anything else."""
    if not isinstance(stats, dict):
        return {}
    inner = stats.get("decisions")
    return inner if isinstance(inner, dict) else stats


class StatsDecisions:
    """Fallback decision source: the router's ``GET /stats`` ring of recent decisions.

    The router records a turn when it decides it, keyed by the conversation's keyed tag
    (``ConversationKey.hashed``), which only a client given the router's tag key can compute
    (``tag_key``: the bytes ``RouterConfig.conversation_tag_key`` derives); each
    conversation has at most one turn in flight, so after a turn ends the newest record of its
    key is that turn's, unless that record was already returned (``at_s`` not newer than the
    last one seen) or pushed out of the ring: then ``None``. Disables itself without a tag key
    or when ``/stats`` answers 404.
    """

    def __init__(self, tenant: str = "default", tag_key: bytes | None = None) -> None:
        self.tenant = tenant
        self.tag_key = tag_key
        self.available = tag_key is not None
        self._seen: dict[str, float] = {}

    async def lookup(self, http: httpx.AsyncClient, conversation_id: str) -> Decision | None:
        if not self.available:
            return None
        try:
            resp = await http.get("/stats")
        except httpx.HTTPError:
            return None
        if resp.status_code == 404:
            self.available = False
            return None
        if resp.status_code != 200:
            return None
        try:
            recent = decision_counters(resp.json()).get("recent") or []
        except ValueError:
            return None
        assert self.tag_key is not None  # else not available
        key = ConversationKey(self.tenant, conversation_id).hashed(self.tag_key)
        records = [r for r in recent if isinstance(r, dict) and r.get("key") == key]
        if not records:
            return None
        newest = max(records, key=lambda r: float(r.get("at_s") or 0.0))
        at_s = float(newest.get("at_s") or 0.0)
        if at_s <= self._seen.get(conversation_id, float("-inf")):
            return None
        self._seen[conversation_id] = at_s
        return Decision(str(newest.get("action")), newest.get("reason"),
                        json_count(newest.get("reused_tokens")), "stats")


class ChatClient:
    """Chat turns against one OpenAI-compatible base URL (the router, or any server).

    The conversation id travels in the ``X-Conversation-ID`` header, which plain vLLM
    ignores. ``extra_body`` is merged into every request (e.g. ``{"ignore_eos": True}``).
    ``transport`` is for tests (e.g. ``httpx.MockTransport``).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 900.0,
        stats: StatsDecisions | None = None,
        extra_body: Mapping[str, object] | None = None,
        clock: Clock = time.perf_counter,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.stats = stats
        self.extra_body = dict(extra_body or {})
        self.clock = clock
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        max_tokens: int,
        conversation_id: str | None = None,
        stream: bool = True,
        tool_call: bool = False,
    ) -> TurnResult:
        """Send one turn and measure it (see the module docstring). ``tool_call=True`` is a
        ``ValueError``: chat completions here do not force tool calls (``MessagesClient``
        does)."""
        if tool_call:
            raise ValueError("the chat client cannot force a tool call: use the Messages "
                             "client (bench --api messages)")
        body: dict[str, object] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
            **self.extra_body,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {CONVERSATION_HEADER: conversation_id} if conversation_id else {}
        if stream:
            return await self._measured(
                lambda started: self._streamed(body, headers, started), conversation_id)
        return await self._measured(
            lambda started: self._whole(body, headers, started), conversation_id)

    async def _measured(
        self, send: Callable[[float], Awaitable[TurnResult]], conversation_id: str | None
    ) -> TurnResult:
        """``send(t0)`` with transport errors and bodies that are not JSON returned as a
        failed ``TurnResult``, and the ``/stats`` fallback for a decision without headers."""
        started = self.clock()
        try:
            result = await send(started)
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
            return TurnResult(0, "", None, None, self.clock() - started, None, 0, None,
                              error=f"{type(exc).__name__}: {exc}")
        if result.decision is None and self.stats is not None and conversation_id:
            decision = await self.stats.lookup(self.http, conversation_id)
            if decision is not None:
                result = replace(result, decision=decision)
        return result

    async def _streamed(
        self, body: dict[str, object], headers: dict[str, str], started: float
    ) -> TurnResult:
        meter = StreamMeter(started)
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            decision = decision_from_headers(resp.headers)
            if resp.status_code >= 400:
                detail = (await resp.aread()).decode(errors="replace")[:1000]
                return meter.result(self.clock(), resp.status_code, decision,
                                    error=f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                payload = sse_data(line)
                if payload is not None:
                    meter.feed(payload, self.clock())
                    if meter.done:
                        break
        return meter.result(self.clock(), resp.status_code, decision)

    async def _whole(
        self, body: dict[str, object], headers: dict[str, str], started: float
    ) -> TurnResult:
        resp = await self.http.post("/v1/chat/completions", json=body, headers=headers)
        ended = self.clock()
        decision = decision_from_headers(resp.headers)
        if resp.status_code >= 400:
            return TurnResult(resp.status_code, "", None, None, ended - started, None, 0,
                              decision, error=f"HTTP {resp.status_code}: {resp.text[:1000]}")
        data = resp.json()
        usage = usage_of(data) or Usage(None, None)
        text = str(((data.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
        return TurnResult(resp.status_code, text, ended - started, None, ended - started,
                          usage.prompt_tokens, usage.completion_tokens or 0, decision)

    async def get_json(self, path: str) -> Any | None:
        """``GET path`` as JSON, or ``None`` if it fails or is not JSON."""
        try:
            resp = await self.http.get(path)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def served_model(self) -> str | None:
        """The first model id of ``GET /v1/models``, if the server lists one."""
        data: Any = await self.get_json("/v1/models")
        try:
            return str(data["data"][0]["id"])
        except (TypeError, KeyError, IndexError):
            return None

