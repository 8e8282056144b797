"""HTTP to the vLLM nodes: a transport seam, errors translated once, here.

``Upstream`` is what the turn path calls: ``post`` (a JSON answer's bytes), ``open_stream``
(an SSE response's raw bytes, unparsed) and ``get``. It runs on a ``Transport``:
``AiohttpTransport`` in production (keep-alive pools per node, C HTTP parser; measured
against httpx in docs/perf.md), any other implementation in tests. Every failure of a call
to a node becomes an ``UpstreamError`` with a ``core.consequences.FailureKind``, which is all
the retry rules look at. ``UpstreamError.to_router_error()`` is the only place an upstream
failure becomes a client answer: 4xx passed through, else 502/503/504 with a message that
names the role and what went wrong, never the node, its URL or an exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import msgspec

from kvrelay.core.consequences import FailureKind, client_fault
from kvrelay.router.config import NodeConfig
from kvrelay.router.errors import RouterError, passthrough_error_body

_JSON_HEADERS = {"Content-Type": "application/json"}
_SSE_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
_GET_HEADERS = {"Accept-Encoding": "identity"}
DP_RANK_HEADER = "X-data-parallel-rank"
"""vLLM's header naming the data-parallel rank that serves a request (``core.engine_group``)."""
"""The router reads what nodes answer to a GET itself (``/metrics``, ``/health``, models)
and does not decompress: it asks for plain bodies (a compressed ``/metrics`` read as no
room at all, probe 11, finding 2)."""

#: Idle keep-alive connections are closed before vLLM's uvicorn closes them (5 s), so a
#: pooled connection is never reused just as the server hangs up on it.
KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """A failed call to a node. ``message`` is for logs and metrics only."""

    def __init__(
        self,
        node_id: str,
        kind: FailureKind,
        message: str,
        *,
        status: int | None = None,
        body: object = None,
    ) -> None:
        super().__init__(f"{node_id}: {message}")
        self.node_id = node_id
        self.kind = kind
        self.message = message
        self.status = status
        self.body = body

    @property
    def client_fault(self) -> bool:
        """An upstream 4xx: the request itself is bad; retrying elsewhere will not help."""
        return client_fault(self.kind, self.status)

    def to_router_error(self, role: str) -> RouterError:
        """The answer for the client (module docstring)."""
        if self.client_fault:
            assert self.status is not None
            return RouterError(
                self.status, self.message, passthrough_error_body(self.status, self.body)
            )
        if self.kind == "status" and self.status == 503:
            return RouterError(
                503, f"the {role} node is at capacity; retry later", headers={"Retry-After": "1"}
            )
        status = {"connect": 503, "timeout": 504}.get(self.kind, 502)
        what = {
            "connect": "is unreachable",
            "timeout": "timed out",
            "closed": "closed the connection",
            "status": "failed",
            "protocol": "sent an invalid response",
        }[self.kind]
        return RouterError(status, f"the {role} node {what}")


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class ByteStream(Protocol):
    """An open 2xx streamed response: ``chunks()`` yields raw bytes as they arrive (raising
    ``UpstreamError`` if the connection breaks); ``aclose()`` releases it (aborting the
    request on the node unless it was read to the end). Idempotent."""

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Transport(Protocol):
    """How the router reaches its nodes. Implementations raise ``UpstreamError`` for
    transport failures and return any HTTP status; ``stream`` returns the status and, for a
    2xx, the open stream (else the whole error body). ``dp_rank`` has a data-parallel node
    serve the request on that rank (``DP_RANK_HEADER``)."""

    async def request(
        self, node: NodeConfig, method: str, path: str, body: bytes | None,
        timeout_s: float | None, max_bytes: int | None = None, *, dp_rank: int | None = None,
    ) -> Answer: ...

    async def stream(
        self, node: NodeConfig, path: str, body: bytes, *, dp_rank: int | None = None,
    ) -> tuple[int, ByteStream | bytes]: ...

    async def aclose(self) -> None: ...


MAX_GET_BYTES = 4 * 1024 * 1024
"""The most a GET to a node (``/health``, ``/v1/models``, ``/metrics``) may answer. vLLM's
``/metrics`` is ~100-300 KB; a broken or hostile node's 30 MB one, read every second and
parsed on the event loop, blocked it 80 ms a read (probe 11, finding F6)."""


def too_large(node_id: str, max_bytes: int) -> UpstreamError:
    """The error of a node answer over ``max_bytes``."""
    return UpstreamError(node_id, "protocol", f"answer over {max_bytes} bytes")


class Upstream:
    """The router's calls to its nodes, on ``transport`` (module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def post(self, node: NodeConfig, path: str, body: bytes, *,
                   dp_rank: int | None = None) -> bytes:
        """POST JSON (to data-parallel rank ``dp_rank`` of the node, when given); the body of
        a 2xx answer, else ``UpstreamError``."""
        answer = await self.transport.request(node, "POST", path, body, None, dp_rank=dp_rank)
        if answer.status >= 400:
            raise status_error(node.node_id, answer.status, answer.body)
        return answer.body

    async def get(self, node: NodeConfig, path: str, timeout_s: float | None = None) -> Answer:
        """GET; any status is returned, transport failures raise ``UpstreamError``, and so
        does an answer over ``MAX_GET_BYTES`` (``protocol``: no vLLM sends one)."""
        return await self.transport.request(node, "GET", path, None, timeout_s,
                                            MAX_GET_BYTES)

    async def open_stream(self, node: NodeConfig, path: str, body: bytes, *,
                          dp_rank: int | None = None) -> ByteStream:
        """POST (to rank ``dp_rank``, as ``post``) and return the open SSE response once its
        headers arrived with a 2xx status (an error status is read and raised as
        ``UpstreamError``)."""
        status, result = await self.transport.stream(node, path, body, dp_rank=dp_rank)
        if isinstance(result, bytes):
            raise status_error(node.node_id, status, result)
        return result

    async def aclose(self) -> None:
        await self.transport.aclose()


def status_error(node_id: str, status: int, body: bytes) -> UpstreamError:
    """An HTTP error status as an ``UpstreamError`` (message from vLLM's error body)."""
    try:
        parsed: object = msgspec.json.decode(body)
    except msgspec.DecodeError:
        parsed = None
    return UpstreamError(node_id, "status", _error_message(status, parsed), status=status,
                         body=parsed)


def _error_message(status: int, body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return f"HTTP {status}"


class _AiohttpStream:
    def __init__(self, node_id: str, response: aiohttp.ClientResponse) -> None:
        self._node_id = node_id
        self._response = response
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    self._done = True
                    return
                yield chunk
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _translate(self._node_id, exc, stream=True) from exc

    async def aclose(self) -> None:
        if self._done:
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport:
    """``Transport`` on one ``aiohttp`` session with up to ``max_connections`` keep-alive
    connections per node (created on first use, inside the running loop)."""

    def __init__(
        self, *, max_connections: int, connect_timeout_s: float, read_timeout_s: float
    ) -> None:
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=self._max_connections, keepalive_timeout=KEEPALIVE_S,
                ttl_dns_cache=300,
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False,
                skip_auto_headers=("User-Agent",), trust_env=False,
            )
        return self._session

    async def request(
        self, node: NodeConfig, method: str, path: str, body: bytes | None,
        timeout_s: float | None, max_bytes: int | None = None, *, dp_rank: int | None = None,
    ) -> Answer:
        session = self._client()
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        headers = _JSON_HEADERS if body is not None else _GET_HEADERS
        if dp_rank is not None:
            headers = {**headers, DP_RANK_HEADER: str(dp_rank)}
        try:
            async with session.request(
                method, node.url + path, data=body, headers=headers, timeout=timeout,
            ) as response:
                if max_bytes is None:
                    return Answer(response.status, await response.read())
                if (response.content_length or 0) > max_bytes:
                    raise too_large(node.node_id, max_bytes)
                data = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    data += chunk
                    if len(data) > max_bytes:
                        raise too_large(node.node_id, max_bytes)
                return Answer(response.status, bytes(data))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise _translate(node.node_id, exc) from exc

    async def stream(
        self, node: NodeConfig, path: str, body: bytes, *, dp_rank: int | None = None,
    ) -> tuple[int, ByteStream | bytes]:
        headers = _SSE_HEADERS if dp_rank is None \
            else {**_SSE_HEADERS, DP_RANK_HEADER: str(dp_rank)}
        try:
            response = await self._client().post(node.url + path, data=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise _translate(node.node_id, exc) from exc
        if response.status < 400:
            return response.status, _AiohttpStream(node.node_id, response)
        try:
            return response.status, await response.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _translate(node.node_id, exc) from exc
        finally:
            response.release()

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _translate(node_id: str, exc: BaseException, *, stream: bool = False) -> UpstreamError:
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return UpstreamError(node_id, "connect", f"cannot connect: {exc!r}")
    if isinstance(exc, aiohttp.InvalidURL | ValueError) and not stream:
        return UpstreamError(node_id, "connect", f"bad node URL: {exc!r}")
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamError(node_id, "timeout", f"timed out: {exc!r}")
    return UpstreamError(node_id, "closed", f"connection failed: {exc!r}")
