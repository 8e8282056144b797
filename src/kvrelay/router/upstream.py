"""HTTP to the vLLM nodes: one pooled ``httpx.AsyncClient``, errors translated once, here.

Every failure of a call to a node becomes an ``UpstreamError`` with a ``kind``:

* ``connect`` – the request never reached the node (refused, DNS, connect timeout, pool);
* ``timeout`` – sent, but no (complete) answer in time;
* ``closed`` – sent, then the connection broke (reset, closed mid-response);
* ``status`` – the node answered an HTTP error status (``status``, ``body`` set);
* ``protocol`` – the node answered 2xx with something that is not what vLLM sends.

``sent`` tells whether the node may have started on the request (everything but
``connect``): that decides whether single-use KV params may be retried elsewhere.
``UpstreamError.to_router_error()`` is the only place upstream failures become client answers:
4xx passed through, other statuses and ``protocol``/``closed`` 502, ``connect`` 503,
``timeout`` 504.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Mapping
from typing import Literal

import httpx

from kvrelay.router.config import NodeConfig, RouterConfig
from kvrelay.router.errors import RouterError, dumps, passthrough_error_body

UpstreamKind = Literal["connect", "timeout", "closed", "status", "protocol"]

#: Connection pools per node (see ``Upstream``).
POOLS_PER_NODE = 8

_JSON_HEADERS = {"content-type": "application/json", "accept": "application/json"}


class UpstreamError(Exception):
    """A failed call to a node (see the module docstring for ``kind``)."""

    def __init__(
        self,
        node_id: str,
        kind: UpstreamKind,
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
    def sent(self) -> bool:
        """Whether the node may have received (and started) the request."""
        return self.kind != "connect"

    @property
    def client_fault(self) -> bool:
        """An upstream 4xx: the request itself is bad; retrying elsewhere will not help."""
        return self.kind == "status" and self.status is not None and 400 <= self.status < 500

    def to_router_error(self, role: str) -> RouterError:
        """The answer for the client: 4xx passed through, else 502/503/504."""
        if self.client_fault:
            assert self.status is not None
            return RouterError(
                self.status, self.message, passthrough_error_body(self.status, self.body)
            )
        status = {"connect": 503, "timeout": 504}.get(self.kind, 502)
        what = {
            "connect": "is unreachable",
            "timeout": "timed out",
            "closed": "closed the connection",
            "status": f"failed with HTTP {self.status}",
            "protocol": "sent an invalid response",
        }[self.kind]
        return RouterError(status, f"{role} node {self.node_id} {what}")


class UpstreamStream:
    """An open streamed response (status already checked 2xx): read ``lines()``, then
    ``aclose()`` (idempotent; closing early aborts the request on the node)."""

    def __init__(self, node_id: str, response: httpx.Response) -> None:
        self.node_id = node_id
        self.response = response

    async def lines(self) -> AsyncIterator[str]:
        try:
            async for line in self.response.aiter_lines():
                yield line
        except httpx.TimeoutException as exc:
            raise UpstreamError(self.node_id, "timeout", f"stream read timed out: {exc}") from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise UpstreamError(self.node_id, "closed", f"stream broke: {exc!r}") from exc

    async def aclose(self) -> None:
        await self.response.aclose()


class Upstream:
    """The router's HTTP clients to its nodes; ``transport`` replaces the network in tests.

    Keep-alive pools of up to ``max_connections`` each, so 64+ concurrent streams per node
    never queue. httpcore scans every connection of a pool (with a ``poll()`` per idle one)
    whenever a request starts or ends, so each node gets ``POOLS_PER_NODE`` small pools used
    in turn rather than one big one: at 64 streams this halves the router's CPU per request.
    """

    def __init__(
        self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
            keepalive_expiry=30.0,
        )
        timeout = httpx.Timeout(
            connect=config.connect_timeout_s,
            read=config.read_timeout_s,
            write=config.read_timeout_s,
            pool=config.connect_timeout_s,
        )
        self._clients = {
            node.url: [
                httpx.AsyncClient(
                    transport=transport, limits=limits, timeout=timeout, trust_env=False
                )
                for _ in range(POOLS_PER_NODE)
            ]
            for node in config.nodes
        }
        self._turn = itertools.count()

    def client(self, node: NodeConfig) -> httpx.AsyncClient:
        pools = self._clients[node.url]
        return pools[next(self._turn) % len(pools)]

    async def aclose(self) -> None:
        for pools in self._clients.values():
            for client in pools:
                await client.aclose()

    async def post_json(
        self,
        node: NodeConfig,
        path: str,
        body: Mapping[str, object],
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, object]:
        """POST JSON and return the JSON object answered with a 2xx status."""
        client = self.client(node)
        request = client.build_request(
            "POST", node.url + path, content=dumps(body).encode(),
            headers={**_JSON_HEADERS, **(headers or {})},
        )
        response = await self._send(client, node, request, stream=False)
        return _json_object(node.node_id, response)

    async def get(
        self, node: NodeConfig, path: str, timeout_s: float | None = None
    ) -> httpx.Response:
        """GET; any status is returned, transport failures raise ``UpstreamError``."""
        client = self.client(node)
        if timeout_s is not None:
            request = client.build_request(
                "GET", node.url + path, timeout=httpx.Timeout(timeout_s)
            )
        else:
            request = client.build_request("GET", node.url + path)
        try:
            return await client.send(request)
        except httpx.HTTPError as exc:
            raise _translate(node.node_id, exc) from exc

    async def open_stream(
        self,
        node: NodeConfig,
        path: str,
        body: Mapping[str, object],
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamStream:
        """POST and return the open SSE response once its headers arrived with a 2xx status
        (an error status is read and raised as ``UpstreamError``)."""
        client = self.client(node)
        request = client.build_request(
            "POST", node.url + path, content=dumps(body).encode(),
            headers={**_JSON_HEADERS, "accept": "text/event-stream", **(headers or {})},
        )
        response = await self._send(client, node, request, stream=True)
        return UpstreamStream(node.node_id, response)

    @staticmethod
    async def _send(
        client: httpx.AsyncClient, node: NodeConfig, request: httpx.Request, *, stream: bool
    ) -> httpx.Response:
        try:
            response = await client.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise _translate(node.node_id, exc) from exc
        if response.status_code < 400:
            return response
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            raise _translate(node.node_id, exc) from exc
        finally:
            await response.aclose()
        raise UpstreamError(
            node.node_id,
            "status",
            _error_message(response),
            status=response.status_code,
            body=_maybe_json(response),
        )


def _translate(node_id: str, exc: httpx.HTTPError) -> UpstreamError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamError(node_id, "connect", f"cannot connect: {exc!r}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(node_id, "timeout", f"timed out: {exc!r}")
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return UpstreamError(node_id, "connect", f"bad node URL: {exc!r}")
    return UpstreamError(node_id, "closed", f"connection failed: {exc!r}")


def _maybe_json(response: httpx.Response) -> object:
    try:
        return json.loads(response.content)
    except ValueError:
        return None


def _error_message(response: httpx.Response) -> str:
    body = _maybe_json(response)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return f"HTTP {response.status_code}"


def _json_object(node_id: str, response: httpx.Response) -> dict[str, object]:
    body = _maybe_json(response)
    if not isinstance(body, dict):
        raise UpstreamError(node_id, "protocol", "answer is not a JSON object")
    return body
