"""A capture proxy: logs what an agent harness sends and forwards it unchanged.

    .venv/bin/python scripts/harness_proxy.py --listen 8090 --upstream http://127.0.0.1:8000 \
        --log /tmp/captures.jsonl

Every request is forwarded to ``--upstream`` with the same method, path, headers and body;
the upstream's status, headers and body (streamed as it comes) go back to the client. Once
answered, it is appended to ``--log`` as one JSON line: ``method``, ``path`` with its query
string, ``headers``, ``body`` (parsed JSON when it is JSON, else text), ``status``,
``response_headers`` and ``response`` (the answer's text, its first 4 MiB).
``Authorization``, ``x-api-key`` and cookie headers are logged as ``<redacted>``.
``--end-turn`` rewrites a Messages answer's ``"stop_reason":"max_tokens"`` to ``end_turn``
on its way to the client (see its help). Used to see what Codex CLI and Claude Code send
(``tests/data/harness``, docs/router.md "The harnesses, measured"); not part of kvrelay.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

_MAX_TOKENS = b'"stop_reason":"max_tokens"'
_END_TURN = b'"stop_reason":"end_turn"'
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
MAX_LOGGED_ANSWER_BYTES = 4 * 1024 * 1024
_SECRET = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})


def _logged_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: ("<redacted>" if k.lower() in _SECRET else v) for k, v in headers.items()}


def make_app(upstream: str, log: Path, *, end_turn: bool = False) -> web.Application:
    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = ClientSession(timeout=ClientTimeout(total=None, sock_read=1800))
        yield
        await app["session"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        started = time.time()
        raw = await request.read()
        try:
            body: object = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        session: ClientSession = request.app["session"]
        async with session.request(request.method, upstream + request.path_qs,
                                   headers=headers, data=raw or None,
                                   auto_decompress=False) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            await resp.prepare(request)
            answer = bytearray()
            try:
                async for chunk in up.content.iter_any():
                    if len(answer) < MAX_LOGGED_ANSWER_BYTES:
                        answer += chunk
                    if end_turn:
                        chunk = chunk.replace(_MAX_TOKENS, _END_TURN)
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionError:
                pass  # the client hung up first (Codex does, once its stream completed)
        with log.open("a") as f:
            f.write(json.dumps({
                "t": started, "method": request.method, "path": request.path_qs,
                "headers": _logged_headers(dict(request.headers)), "body": body,
                "status": up.status,
                "response_headers": {k: v for k, v in up.headers.items()},
                "response": bytes(answer[:MAX_LOGGED_ANSWER_BYTES]).decode("utf-8", "replace"),
            }) + "\n")
        return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, default=8090)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--upstream", default="http://127.0.0.1:8000")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--end-turn", action="store_true",
                        help="tell the client a Messages answer that hit max_tokens ended its "
                             "turn (stop_reason end_turn): the generated models never emit "
                             "EOS, and Claude Code answers a max_tokens stop with recovery "
                             "requests")
    args = parser.parse_args()
    web.run_app(make_app(args.upstream.rstrip("/"), args.log, end_turn=args.end_turn),
                host=args.host,
                port=args.listen, print=None)


if __name__ == "__main__":
    main()
