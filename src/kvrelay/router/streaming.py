"""Relaying D's responses to the client: SSE framing, token-id collection, field stripping.

What the client must never see: ``kv_transfer_params`` and, unless the client asked for them
itself (``return_token_ids``), the token ids the router asked D for. Both are removed from
every body and chunk the router rewrites (the keys themselves, not just their values).
Chunks that carry no such value are passed through byte for byte, so vLLM's own
``"prompt_token_ids": null`` on a first chat chunk may remain.

Where vLLM puts token ids with ``return_token_ids``: chat has ``prompt_token_ids`` at the top
level (of the response, or of the first chunk); completions have it in the choice. Both put
the generated ids in each choice's ``token_ids`` (all of them, or one chunk's worth). Only
choice ``index`` 0 counts (the router refuses ``n > 1``).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvrelay.router.errors import dumps, error_body

SSE_DONE = b"data: [DONE]\n\n"
#: A payload needs rewriting only if it carries params or non-null token ids.
_INTERNAL = re.compile(r'"kv_transfer_params"\s*:\s*\{|"(?:prompt_)?token_ids"\s*:\s*\[')


@dataclass
class Collected:
    """What the router learns from D's response: token ids and (if sent) D's params."""

    prompt_token_ids: list[int] | None = None
    generated_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: object = None
    error: object = None
    saw_done: bool = False
    chunks: int = 0


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def sse_error(status: int, message: str) -> bytes:
    """A mid-stream error event in vLLM's shape (``data: {"error": {...}}``)."""
    return sse(dumps(error_body(status, message)))


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` payloads of an SSE stream, one per event (multi-line data joined)."""
    buf: list[str] = []
    async for line in lines:
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith("data:"):
            buf.append(line[5:].lstrip(" ") if line.startswith("data: ") else line[5:])
    if buf:
        yield "\n".join(buf)


def collect(obj: dict[str, Any], into: Collected) -> None:
    """Add the token ids and params in one response body or chunk to ``into``."""
    top = obj.get("prompt_token_ids")
    if isinstance(top, list) and into.prompt_token_ids is None:
        into.prompt_token_ids = _ints(top)
    if obj.get("kv_transfer_params") is not None:
        into.kv_transfer_params = obj["kv_transfer_params"]
    if obj.get("error") is not None:
        into.error = obj["error"]
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        prompt = choice.get("prompt_token_ids")
        if isinstance(prompt, list) and into.prompt_token_ids is None:
            into.prompt_token_ids = _ints(prompt)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            into.generated_token_ids.extend(_ints(ids))


def strip(obj: dict[str, Any], *, keep_token_ids: bool) -> None:
    """Remove router-internal fields in place (see the module docstring)."""
    obj.pop("kv_transfer_params", None)
    if keep_token_ids:
        return
    obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)


def relay_chunk(
    data: str, into: Collected | None, *, keep_token_ids: bool
) -> bytes:
    """One upstream SSE payload -> the bytes for the client, collecting into ``into``.

    Payloads without any internal field pass through byte for byte (no JSON round trip)."""
    if data == "[DONE]":
        if into is not None:
            into.saw_done = True
        return SSE_DONE
    if into is None and _INTERNAL.search(data) is None:
        return sse(data)
    try:
        obj = json.loads(data)
    except ValueError:
        return sse(data)
    if not isinstance(obj, dict):
        return sse(data)
    if into is not None:
        into.chunks += 1
        collect(obj, into)
    strip(obj, keep_token_ids=keep_token_ids)
    return sse(dumps(obj))


def _ints(values: list[object]) -> list[int]:
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


class ManagedStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always runs ``cleanup`` when the response ends, however it
    ends (completed, client gone, cancelled), even if the body iterator never started."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        cleanup: Any,
        headers: Mapping[str, str] | None = None,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(
            content, media_type=media_type, headers={"cache-control": "no-cache", **(headers or {})}
        )
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass
        finally:
            await self._cleanup()
