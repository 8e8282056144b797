"""One client connection under uvicorn's httptools protocol: every request head limited and
timed, pipelined or not; malformed HTTP answered with an OpenAI error.

**Heads** are checked while they are read, before the parser sees them (no auth, no
routing): a request line or header line over ``max_line_bytes``, a head over
``max_head_bytes`` or more than ``max_headers`` header lines get 431 at once. The router
then stops reading that connection and closes it ``REJECT_LINGER_S`` later (closing with
unread input would reset the connection and could destroy the 431 before the client reads
it), so a client sending a huge header costs at most that many bytes of buffering. A head
must be complete within ``header_timeout_s`` of the connection opening or of the previous
response (else the connection is closed); a body has its own deadline (``asgi.read_body``).

**Pipelining.** The parser is fed one request at a time, cut at the exact end of its body
(``Content-Length``). Whatever the client sends after a complete request, while that
request is being answered, is held unparsed and checked as the next request's head: once a
whole head is held the router stops reading (uvicorn's rule: one request ahead); a held head
over a limit stops reading at once, abandons the request in progress (``ABANDON``: its
legs to P and D are cancelled now, a stream ends with an error event, an answer not begun
is a 431, and a 431 for the held head follows) and closes the connection
``REJECT_LINGER_S`` later: a client that floods a pipelined head costs no engine or router
work beyond that point. Held
bytes go to the parser when the response is complete, and the next head's deadline starts
then. So no head is ever parsed unlimited, and a client can make the router buffer at most
one head plus one read.

A chunked body's end is known only to the parser: such a request is the connection's last
(answered with ``Connection: close``), and a request sent in the same read right behind it
closes the connection. After a response that completes before its request's body was read
to the end (an early 401), the rest of that body and the next head are due within
``header_timeout_s`` (a chunked body's rest closes the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvrelay.router.asgi import DISCONNECT_SCOPE_KEY, CutOrder, DisconnectWatch
from kvrelay.router.errors import refusal_json

log = logging.getLogger("kvrelay.router")

REJECT_LINGER_S = 2.0
ABANDON = CutOrder(
    431, "Request header fields too large (a request pipelined behind this one)",
    why="(a request pipelined behind it was over a head limit)", logged=False,
)
"""What a request in progress answers when a head pipelined behind it goes over a limit."""
_OVER = -1


def head_size(head: bytes | bytearray, scan_from: int, max_head_bytes: int,
              max_line_bytes: int, max_headers: int) -> int:
    """The size of the complete request head at the start of ``head`` (through its empty
    line), 0 if it is not complete yet, ``-1`` if it is over a limit (complete or not).
    ``scan_from`` is where a new end may begin (bytes before it were checked already)."""
    end = head.find(b"\r\n\r\n", max(0, scan_from - 3))
    size = end + 4 if end >= 0 else len(head)
    lines = bytes(head[: end if end >= 0 else len(head)]).split(b"\r\n")
    if (
        size > max_head_bytes
        or len(lines) - 1 > max_headers
        or any(len(line) > max_line_bytes for line in lines)
    ):
        return _OVER
    return size if end >= 0 else 0


def line_path(head: bytes | bytearray, max_line_bytes: int) -> str:
    """The path in the request line at the start of ``head`` (its first ``max_line_bytes``;
    the query left out), ``""`` when there is none: which API a refused head was for."""
    parts = bytes(head[:max_line_bytes]).lstrip(b"\r\n").split(b"\r\n", 1)[0].split(b" ")
    return parts[1].partition(b"?")[0].decode("latin-1") if len(parts) >= 2 else ""


class LingeringTransport:
    """A transport whose ``close()``, while the peer may still be sending (a request whose
    body was not read to its end, a rejected head), stops reading and closes
    ``REJECT_LINGER_S`` later: closing a socket with unread input resets the connection,
    and the peer may lose the answer it was about to read (a 413 for a body it is still
    sending, a 431). Everything else is the wrapped transport's."""

    __slots__ = ("_loop", "_transport", "_unread", "is_closing", "write")

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
        unread: Callable[[], bool],
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._unread = unread
        self.write = transport.write
        self.is_closing = transport.is_closing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        if not self._unread():
            transport.close()
            return
        with contextlib.suppress(RuntimeError, OSError):
            transport.pause_reading()
        self._loop.call_later(REJECT_LINGER_S, transport.close)


class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol plus head limits, pipelining held to one request, a head
    deadline, and OpenAI error bodies for malformed requests (module docstring).

    A connection is in one of three states: reading a head (``_kvrelay_head`` is the head
    so far, the deadline armed), reading a body (``_kvrelay_body_left`` bytes still due,
    ``None`` for chunked), or answering a complete request (``_kvrelay_held`` is what came
    after it). ``_kvrelay_done``: input is no longer handled (rejected, or closing)."""

    header_timeout_s: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_line_bytes: int = 8 * 1024
    max_headers: int = 100
    _kvrelay_timer: asyncio.TimerHandle | None = None
    _kvrelay_head: bytearray | None = None
    _kvrelay_body_left: int | None = 0
    _kvrelay_held: bytearray | None = None
    _kvrelay_in_message: bool = False
    _kvrelay_tail: bool = False
    _kvrelay_last: bool = False
    _kvrelay_done: bool = False
    _kvrelay_paused: bool = False
    _kvrelay_owed: bool = False
    _kvrelay_owed_path: str = ""
    _kvrelay_draining: bool = False

    def connection_made(self, transport: Any) -> None:
        lingering = LingeringTransport(transport, self.loop, self._kvrelay_unread)
        super().connection_made(lingering)  # type: ignore[arg-type]
        self._kvrelay_head = bytearray()
        self._kvrelay_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._kvrelay_disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            watch = cycle.scope.get(DISCONNECT_SCOPE_KEY)
            if isinstance(watch, DisconnectWatch):
                watch.disconnected()

    # -- the parser's callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT_SCOPE_KEY] = True  # type: ignore[literal-required]
        self._kvrelay_in_message = True
        if self._kvrelay_held is not None:
            self._kvrelay_tail = True  # a request behind a chunked body, in the same read

    def on_headers_complete(self) -> None:
        if not self._kvrelay_last:
            self._kvrelay_head = None
            self._kvrelay_disarm()
            self._kvrelay_body_left = _body_length(self.headers)
        super().on_headers_complete()
        if self._kvrelay_draining and self.cycle is not None:
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._kvrelay_in_message = False
        if self._kvrelay_last or self._kvrelay_done:
            return
        if self._kvrelay_body_left is None and self.cycle is not None:
            self._kvrelay_last = True
            self.cycle.keep_alive = False
        self._kvrelay_body_left = 0
        if self.cycle is not None and self.cycle.response_complete:
            self._kvrelay_head = bytearray()  # answered early: the next head is read now
        else:
            self._kvrelay_held = bytearray()

    def on_response_complete(self) -> None:
        if self._kvrelay_done or self._kvrelay_last:
            # closing: nothing behind this response is served (uvicorn would start a request
            # it queued, even on a connection that closes later)
            self.server_state.total_requests += 1
            self.pipeline.clear()
            if self._kvrelay_owed and not self.transport.is_closing():
                self._kvrelay_owed = False  # the cut connection is still open: say why
                self._kvrelay_write(b"431 Request Header Fields Too Large", refusal_json(
                    self._kvrelay_owed_path, 431, "Request header fields too large"))
            self.transport.close()
            return
        super().on_response_complete()
        if self.transport.is_closing() or not self.cycle.keep_alive:
            return
        if self._kvrelay_held is None:  # answered before its body was read to the end
            if self._kvrelay_body_left is None:  # chunked: what follows cannot be framed
                self._kvrelay_done = True
                self.transport.close()
            else:  # the rest of the body, then the next head, are due in the head's time
                self._kvrelay_arm()
            return
        held, self._kvrelay_held = self._kvrelay_held, None
        if self._kvrelay_paused:
            self._kvrelay_paused = False
            with contextlib.suppress(RuntimeError, OSError):
                self.transport.resume_reading()
        self._kvrelay_head = bytearray()
        self._kvrelay_arm()
        if held:
            self._kvrelay_feed(bytes(held))

    # -- input ------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._kvrelay_done:
            return
        if self._kvrelay_held is not None:
            self._kvrelay_hold(data)
            return
        self._kvrelay_feed(data)

    def _kvrelay_feed(self, data: bytes) -> None:
        """Give ``data`` to the parser one request at a time (module docstring)."""
        view = memoryview(data)
        while view and not self._kvrelay_done:
            if self._kvrelay_held is not None:
                self._kvrelay_hold(bytes(view))
                return
            head = self._kvrelay_head
            if head is not None:
                scan_from = len(head)
                head += view
                size = head_size(head, scan_from, self.max_head_bytes, self.max_line_bytes,
                                 self.max_headers)
                if size == _OVER:
                    self._kvrelay_reject()
                    return
                cut = len(view) if size == 0 else size - scan_from
                piece, view = view[:cut], view[cut:]
                self._kvrelay_parse(piece)
                if size and self._kvrelay_head is not None and not self._kvrelay_done:
                    if self._kvrelay_in_message:  # the parser and the check disagree
                        self._kvrelay_bad_request("Invalid HTTP request head")
                        return
                    self._kvrelay_head = bytearray()  # blank lines between requests
                continue
            left = self._kvrelay_body_left
            if left is None:  # chunked: only the parser knows where it ends
                self._kvrelay_parse(view)
                if self._kvrelay_tail and not self._kvrelay_done:
                    self._kvrelay_cut()
                return
            cut = min(left, len(view))
            piece, view = view[:cut], view[cut:]
            self._kvrelay_body_left = left - cut
            self._kvrelay_parse(piece)
            in_body = self._kvrelay_head is None and self._kvrelay_held is None
            if self._kvrelay_body_left == 0 and in_body and view:
                if not self._kvrelay_done:  # the body's end, but no end of the message
                    self._kvrelay_bad_request("Invalid HTTP request body framing")
                return

    def _kvrelay_parse(self, piece: memoryview) -> None:
        if piece:  # uvicorn hands it to httptools, which takes any buffer: no copy
            super().data_received(piece)  # type: ignore[arg-type]

    def _kvrelay_hold(self, data: bytes) -> None:
        """Bytes after a complete request that is still being answered (module
        docstring)."""
        held = self._kvrelay_held
        assert held is not None
        scan_from = len(held)
        held += data
        if self._kvrelay_paused:
            return
        size = head_size(held, scan_from, self.max_head_bytes, self.max_line_bytes,
                         self.max_headers)
        if size == _OVER:
            self._kvrelay_cut()
            self._kvrelay_owed = True
            self._kvrelay_owed_path = line_path(held, self.max_line_bytes)
            self._kvrelay_abandon()
        elif size:
            self._kvrelay_pause()

    def _kvrelay_pause(self) -> None:
        self._kvrelay_paused = True
        with contextlib.suppress(RuntimeError, OSError):
            self.transport.pause_reading()

    def _kvrelay_unread(self) -> bool:
        """Whether the client may still be sending: a rejected head, a body not read to its
        end, or a next request the router stopped reading."""
        cycle = self.cycle
        return (self._kvrelay_done or self._kvrelay_paused
                or (cycle is not None and bool(cycle.more_body)))

    # -- refusals ---------------------------------------------------------------------------

    def _kvrelay_reject(self) -> None:
        body = refusal_json(self._kvrelay_path(), 431, "Request header fields too large")
        self._kvrelay_answer(b"431 Request Header Fields Too Large", body)

    def _kvrelay_bad_request(self, message: str) -> None:
        self._kvrelay_answer(b"400 Bad Request", refusal_json(self._kvrelay_path(), 400, message))

    def _kvrelay_path(self) -> str:
        """The refused request's path, for its API's error shape: from the request line of
        the head being read, else the request being parsed; ``""`` when there is none."""
        head = self._kvrelay_head
        if head:
            return line_path(head, self.max_line_bytes)
        scope = getattr(self, "scope", None)
        return scope.get("path", "") if isinstance(scope, dict) else ""

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what its parser refuses, as an OpenAI error."""
        self._kvrelay_bad_request(msg)

    def _kvrelay_answer(self, status: bytes, body: bytes) -> None:
        """Answer at once and stop reading (closing ``REJECT_LINGER_S`` later); with a
        response in progress, only stop reading and close (``_kvrelay_cut``)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and self._kvrelay_in_answer():
            self._kvrelay_cut()
            return
        self._kvrelay_done = True
        self._kvrelay_head = None
        self._kvrelay_disarm()
        self._kvrelay_write(status, body)
        self.transport.close()

    def _kvrelay_write(self, status: bytes, body: bytes) -> None:
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, len(body)) + body
        )

    def _kvrelay_in_answer(self) -> bool:
        """Whether a request on this connection is being answered (its response started or
        may start)."""
        return self.cycle is not None and not self.cycle.response_complete and (
            self._kvrelay_held is not None or self.cycle.response_started)

    def _kvrelay_cut(self) -> None:
        """Stop reading now and close the connection ``REJECT_LINGER_S`` later, cutting the
        response in progress."""
        self._kvrelay_done = True
        self._kvrelay_head = None
        self._kvrelay_disarm()
        self.transport.close()

    def _kvrelay_abandon(self) -> None:
        """Cut the request in progress now (``ABANDON``), or as soon as its handler makes
        its watch (its body may still be parsed), rather than serve it to the close."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        watch = cycle.scope.get(DISCONNECT_SCOPE_KEY)
        if isinstance(watch, DisconnectWatch):
            watch.cut(ABANDON)
        elif watch:
            cycle.scope[DISCONNECT_SCOPE_KEY] = ABANDON  # type: ignore[literal-required]

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn warns on every Upgrade it does not follow: a client could fill the log."""
        log.debug("an Upgrade request was served as plain HTTP/1.1")

    # -- drain and deadline -----------------------------------------------------------------

    def shutdown(self) -> None:
        """The drain begins (``RouterServer.shutdown``). uvicorn closes every connection not
        serving a request, which also resets one whose client has just connected or has sent
        part of its next request: that request would be lost rather than answered 503.
        Close only a kept-alive connection with nothing of a next request in; every other
        one is served, and closed after its response (``Connection: close``)."""
        self._kvrelay_draining = True
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and not self._kvrelay_head:
            self.transport.close()
        elif cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False

    def _kvrelay_arm(self) -> None:
        self._kvrelay_disarm()
        self._kvrelay_timer = self.loop.call_later(self.header_timeout_s, self._kvrelay_expired)

    def _kvrelay_disarm(self) -> None:
        if self._kvrelay_timer is not None:
            self._kvrelay_timer.cancel()
            self._kvrelay_timer = None

    def _kvrelay_expired(self) -> None:
        self._kvrelay_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request is being answered (its body has its own deadline)
        if not self.transport.is_closing():
            self.transport.close()


def _body_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length as the parser frames it (it refuses conflicting or malformed
    framing itself): ``Content-Length``, 0 without one, ``None`` when chunked."""
    length = b"0"
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            length = value
    try:
        return int(length)
    except ValueError:
        return None


def protocol_class(*, header_timeout_s: float, max_head_bytes: int, max_line_bytes: int,
                   max_headers: int) -> type[Any]:
    """uvicorn's ``http`` protocol class with these head limits and deadline."""
    return type("KVRelayHttpProtocol", (GuardedProtocol,), {
        "header_timeout_s": header_timeout_s,
        "max_head_bytes": max_head_bytes,
        "max_line_bytes": max_line_bytes,
        "max_headers": max_headers,
    })
