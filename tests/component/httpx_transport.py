"""The router's ``Transport`` over an ``httpx`` transport (e.g. ``httpx.MockTransport``), so
router tests can script nodes in process: which request fails, how, and when.

Typed against ``kvrelay.router.upstream.Transport`` and translating httpx's errors into the
same ``UpstreamError`` kinds as the production ``AiohttpTransport``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from kvrelay.router.config import NodeConfig
from kvrelay.router.upstream import DP_RANK_HEADER, Answer, ByteStream, UpstreamError, too_large


def _translate(node_id: str, exc: httpx.HTTPError) -> UpstreamError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamError(node_id, "connect", f"cannot connect: {exc!r}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(node_id, "timeout", f"timed out: {exc!r}")
    return UpstreamError(node_id, "closed", f"connection failed: {exc!r}")


class _Stream:
    def __init__(self, node_id: str, response: httpx.Response) -> None:
        self._node_id = node_id
        self._response = response

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                if chunk:
                    yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamError(self._node_id, "timeout", f"stream timed out: {exc!r}") from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise UpstreamError(self._node_id, "closed", f"stream broke: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxTransport:
    """``kvrelay.router.upstream.Transport`` on one ``httpx.AsyncClient``."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._client = httpx.AsyncClient(transport=transport, timeout=30.0, trust_env=False)

    async def request(
        self, node: NodeConfig, method: str, path: str, body: bytes | None,
        timeout_s: float | None, max_bytes: int | None = None, *, dp_rank: int | None = None,
    ) -> Answer:
        headers = {"content-type": "application/json"} if body is not None else {}
        if dp_rank is not None:
            headers[DP_RANK_HEADER] = str(dp_rank)
        try:
            response = await self._client.request(
                method, node.url + path, content=body, headers=headers or None,
            )
        except httpx.HTTPError as exc:
            raise _translate(node.node_id, exc) from exc
        if max_bytes is not None and len(response.content) > max_bytes:
            raise too_large(node.node_id, max_bytes)
        return Answer(response.status_code, response.content)

    async def stream(
        self, node: NodeConfig, path: str, body: bytes, *, dp_rank: int | None = None,
    ) -> tuple[int, ByteStream | bytes]:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if dp_rank is not None:
            headers[DP_RANK_HEADER] = str(dp_rank)
        request = self._client.build_request("POST", node.url + path, content=body,
                                             headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _translate(node.node_id, exc) from exc
        if response.status_code < 400:
            return response.status_code, _Stream(node.node_id, response)
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            raise _translate(node.node_id, exc) from exc
        finally:
            await response.aclose()
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._client.aclose()
