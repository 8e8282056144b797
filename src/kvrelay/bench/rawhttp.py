"""A minimal keep-alive HTTP/1.1 client for load generation (``scripts/soak.py``,
``scripts/bench_router_overhead.py``, ``tests/component/test_router_soak.py``).

Why not httpx: on a 2-core machine a full client's per-request CPU is comparable to the
router's, so the load generator, not the router, would be what is measured. ``Conn`` speaks
just enough HTTP/1.1 for JSON POSTs and chunked SSE streams from vLLM-like servers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

from kvrelay.client.sse import DONE, EventBuffer, chunk_content, chunk_error, json_chunk


class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self, path: str, body: dict[str, Any]) -> asyncio.StreamReader:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.writer.write(head.encode() + data)
        assert self.reader is not None
        return self.reader

    @staticmethod
    async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return int(lines[0].split()[1]), headers

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding") == "chunked":
            out = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    return out
                out += chunk[:-2]
        return await reader.readexactly(int(headers.get("content-length", "0")))

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        reader = await self._send(path, body)
        status, headers = await self._head(reader)
        data = await self._body(reader, headers)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        return json.loads(data)

    async def stream(
        self, path: str, body: dict[str, Any], started: float
    ) -> tuple[str, float, dict[str, str]]:
        """POST and read an SSE response: the reply text, the first token's time, the
        headers. ``RuntimeError`` on a non-200 status, an error event or no ``[DONE]``."""
        reader = await self._send(path, body)
        status, headers = await self._head(reader)
        if status != 200:
            data = await self._body(reader, headers)
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"not a chunked stream: {headers}")
        parts: list[str] = []
        ttft = 0.0
        events = EventBuffer()
        done = False
        error: str | None = None
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            for payload in events.feed(chunk[:-2]):
                if payload == DONE:
                    done = True
                    continue
                obj = json_chunk(payload)
                if obj is None:
                    continue
                failure = chunk_error(obj)
                if failure is not None:
                    error = json.dumps(failure)[:200]
                content = chunk_content(obj)
                if content:
                    if not ttft:
                        ttft = time.perf_counter() - started
                    parts.append(content)
        if error is not None:
            raise RuntimeError(f"error event: {error}")
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return "".join(parts), ttft, headers

    async def stream_raw(
        self, path: str, body: dict[str, Any], started: float, first: bytes
    ) -> tuple[bytes, float, dict[str, str]]:
        """POST and read a whole streamed response of any SSE dialect (Responses, Messages):
        its body, the time the first chunk holding ``first`` arrived, the headers.
        ``RuntimeError`` on a non-200 status."""
        reader = await self._send(path, body)
        status, headers = await self._head(reader)
        if status != 200:
            data = await self._body(reader, headers)
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"not a chunked stream: {headers}")
        parts: list[bytes] = []
        ttft = 0.0
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            if not ttft and first in chunk:
                ttft = time.perf_counter() - started
            parts.append(chunk[:-2])
        return b"".join(parts), ttft, headers

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


async def get_text(url: str) -> str:
    """GET ``url`` on a fresh connection (``Connection: close``) and return the body."""
    parts = urlsplit(url)
    host, port, path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Connection: close\r\n\r\n".encode())
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.strip() or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return body.decode()
