"""Calling an ASGI app directly, without an HTTP client: exact control of the headers and of
how the body is delivered (chunks, and how many of them the app actually read), and fast
enough for tens of thousands of fuzzed requests.

The client stays connected until the response is complete, as a real one does: once the
body is delivered, ``receive()`` waits for the end of the response (then reports the
disconnect, like an ASGI server). ``disconnect_after_body=True`` is a client that goes away
as soon as it has sent its body; ``disconnect_on=event`` one that goes away when ``event``
is set (e.g. once a node holds the request)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.router.asgi import ASGIApp, Message
from tests.component.router_process import is_openai_error as openai_error_shape


@dataclass
class Answer:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    chunks_read: int = 0

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.decode("latin-1").lower() == name.lower():
                return v.decode("latin-1")
        return None

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    app: ASGIApp,
    method: str,
    path: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    chunks: Sequence[bytes] = (b"",),
    query: bytes = b"",
    *,
    disconnect_after_body: bool = False,
    disconnect_on: asyncio.Event | None = None,
) -> Answer:
    """One HTTP request; the body is delivered as ``chunks``."""
    answer = Answer()
    pending = list(chunks) or [b""]
    complete = asyncio.Event()
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path,
        "raw_path": path.encode("utf-8", "surrogateescape"), "query_string": query,
        "root_path": "", "headers": list(headers),
        "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000),
    }

    async def receive() -> Message:
        if not pending:
            if disconnect_on is not None:
                await disconnect_on.wait()
            elif not disconnect_after_body:
                await complete.wait()
            return {"type": "http.disconnect"}
        answer.chunks_read += 1
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            if not message.get("more_body", False):
                complete.set()

    await app(scope, receive, send)
    return answer


def is_openai_error(answer: Answer) -> bool:
    """``{"error": {"message": str, "type": str, "param": str|null, "code": int}}``."""
    try:
        body = answer.json()
    except ValueError:
        return False
    return openai_error_shape(body)
