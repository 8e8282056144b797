"""Raw HTTP/1.1 over a socket, for attacks an HTTP client will not send: oversized request
lines and headers, a header that never ends, a body that never comes, a client that leaves.

``RawConnection`` keeps every byte the server sent, even when the server resets the
connection afterwards (``asyncio.StreamReader`` raises the reset and loses what it had
buffered), and tells how much of what the client wrote has been taken by the socket.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def request_bytes(
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    content_length: int | None = None,
) -> bytes:
    """A complete request head (``Host`` first) plus ``body``; ``Content-Length`` is
    ``len(body)`` unless given (to announce more than is sent)."""
    length = len(body) if content_length is None else content_length
    lines = [f"{method} {target} HTTP/1.1", "Host: router.test"]
    lines += [f"{name}: {value}" for name, value in headers]
    if length or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class RawResponse:
    """What arrived: the status (0 if no complete status line), headers (lower-case names),
    the body as far as it arrived (de-chunked), and whether the body is complete."""

    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool

    def json(self) -> Any:
        return json.loads(self.body)


def parse_response(raw: bytes) -> RawResponse:
    """The first response in ``raw`` (tolerates a cut-off head or body)."""
    line, sep, rest = raw.partition(b"\r\n")
    parts = line.split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return RawResponse(0, {}, b"", False)
    status = int(parts[1])
    head, sep, body = rest.partition(b"\r\n\r\n")
    headers: dict[str, str] = {}
    for h in head.split(b"\r\n") if head else ():
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if not sep:
        return RawResponse(status, headers, b"", False)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size_line, sep, body = body.partition(b"\r\n")
            if not sep:
                return RawResponse(status, headers, out, False)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return RawResponse(status, headers, out, True)
            out += body[:size]
            if len(body) < size + 2:
                return RawResponse(status, headers, out, False)
            body = body[size + 2:]
    length = int(headers.get("content-length", "0") or 0)
    return RawResponse(status, headers, body[:length], len(body) >= length)


class RawConnection(asyncio.Protocol):
    """A client connection; open with ``await RawConnection.open(host, port)``."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.closed = asyncio.Event()
        self._arrived = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        return conn

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += data
        self._arrived.set()

    def eof_received(self) -> bool:
        self.closed.set()
        self._arrived.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.error = exc
        self.closed.set()
        self._arrived.set()
        self._can_write.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- client side ------------------------------------------------------------------------

    async def send(self, data: bytes) -> bool:
        """Write ``data`` and wait until the socket took it (flow control); False if the
        connection is closed (by the server, or reset)."""
        if self.closed.is_set() or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        await self._can_write.wait()
        return not self.closed.is_set()

    def response(self) -> RawResponse:
        return parse_response(bytes(self.received))

    @property
    def has_status(self) -> bool:
        """Whether a complete status line has arrived."""
        return self.response().status != 0

    async def wait_status(self) -> RawResponse:
        """Wait until a status line arrived or the connection closed (no bound: wrap it)."""
        while not self.has_status and not self.closed.is_set():
            self._arrived.clear()
            await self._arrived.wait()
        return self.response()

    async def read_response(self) -> RawResponse:
        """Wait until the first response is complete or the connection closed."""
        while not self.response().complete and not self.closed.is_set():
            self._arrived.clear()
            await self._arrived.wait()
        return self.response()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
