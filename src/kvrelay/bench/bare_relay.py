"""The leanest P/D pass-through on the router's own HTTP stack: the overhead benchmark's floor.

Same server (uvicorn with httptools and uvloop, raw ASGI), same client (``aiohttp`` through
``kvrelay.router.upstream.AiohttpTransport``) and same JSON codec (``msgspec``) as the
router, and nothing else: no state, no checks, no identity, no report, no limits. A chat or
completions request goes to P with ``max_tokens=1`` and ``do_remote_decode``, then to D with
P's params; D's bytes are relayed unparsed. ``scripts/bench_router_overhead.py`` runs it
beside the router so the router's CPU per turn can be read as a multiple of this floor.

    python -m kvrelay.bench.bare_relay --prefill URL --decode URL --port 8000
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import uvicorn
import uvloop

from kvrelay.core.params import request_remote_decode
from kvrelay.router.config import NodeConfig
from kvrelay.router.upstream import AiohttpTransport, Upstream

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


class BareRelay:
    """An ASGI app relaying P then D (module docstring)."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self._p = NodeConfig("prefill-0", "prefill", prefill_url)
        self._d = NodeConfig("decode-0", "decode", decode_url)
        self._upstream = Upstream(AiohttpTransport(
            max_connections=512, connect_timeout_s=5.0, read_timeout_s=600.0))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self._upstream.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = _DECODER.decode(b"".join(chunks))
        p_body = {**body, "stream": False, "max_tokens": 1,
                  "kv_transfer_params": request_remote_decode()}
        p_body.pop("stream_options", None)
        answer = _DECODER.decode(await self._upstream.post(self._p, path, _ENCODER.encode(p_body)))
        d_body = _ENCODER.encode({**body, "kv_transfer_params": answer["kv_transfer_params"]})
        if not body.get("stream"):
            await _respond(send, 200, await self._upstream.post(self._d, path, d_body))
            return
        stream = await self._upstream.open_stream(self._d, path, d_body)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            async for chunk in stream.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await stream.aclose()


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    config = uvicorn.Config(BareRelay(args.prefill, args.decode), host=args.host,
                            port=args.port, http="httptools", log_level="warning",
                            access_log=False, lifespan="on")
    uvloop.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
