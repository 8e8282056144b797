"""A stand-in for the kvrelay router, for ``kvrelay bench`` tests: an OpenAI chat endpoint
that streams a deterministic answer, decides "pull" for every turn after a conversation's
first (like a router in front of a bidirectional cluster) and reports it in headers and/or
``/stats``.

Use in-process (``StubRouter`` + ``serve_in_thread``) or as a script:
``python bench_stub_router.py --port N [--direct] [--no-headers]`` (``--direct`` reports
``direct`` instead of ``pull``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvrelay.core.conversation import ConversationKey

TAG_KEY = bytes(range(32))
"""The stub's conversation tag key (``StatsDecisions`` needs the same)."""


def answer_for(messages: list[dict[str, str]], max_tokens: int) -> str:
    """The deterministic answer: printable characters derived from the prompt."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
    return "".join(digest[i % len(digest)] for i in range(max_tokens))


@dataclass
class StubRouter:
    """Knobs and observations. ``first_content_delay_s``: pause after the role chunk;
    ``token_delay_s``: pause between content chunks; ``fail_turns``: (conversation id, turn
    number) pairs answered with HTTP 500; ``error_mid_stream``: send an error event instead
    of content."""

    action_after_first: str = "pull"
    headers: bool = True
    stats: bool = True
    first_content_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fail_turns: set[tuple[str, int]] = field(default_factory=set)
    error_mid_stream: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    turns_seen: dict[str, int] = field(default_factory=dict)
    recent: list[dict[str, Any]] = field(default_factory=list)
    by_action: dict[str, int] = field(default_factory=dict)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/stats", self.get_stats, methods=["GET"]),
        ])

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub-model"}]})

    async def get_stats(self, request: Request) -> Response:
        if not self.stats:
            return JSONResponse({"error": "no stats"}, status_code=404)
        return JSONResponse({"decisions": {"by_action": dict(self.by_action), "by_reason": {},
                                           "recent": list(self.recent)}})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        conv = request.headers.get("x-conversation-id")
        self.requests.append({"body": body, "conversation_id": conv})
        turn = self.turns_seen.get(conv or "", 0) + 1
        if conv:
            self.turns_seen[conv] = turn
        action = self.action_after_first if turn > 1 else "recompute"
        reason = action if turn > 1 else "no_entry"
        prompt_tokens = sum(len(m["content"]) for m in body["messages"])
        reused = prompt_tokens // 2 if turn > 1 else 0
        self.by_action[action] = self.by_action.get(action, 0) + 1
        if conv:
            self.recent.append({"at_s": time.monotonic(), "action": action, "reason": reason,
                                "reused_tokens": reused,
                                "key": ConversationKey("default", conv).hashed(TAG_KEY)})
        headers = {}
        if self.headers:
            headers = {"X-KVRelay-Action": action, "X-KVRelay-Reason": reason,
                       "X-KVRelay-Reused-Tokens": str(reused)}
        if (conv or "", turn) in self.fail_turns:
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500,
                                headers=headers)
        text = answer_for(body["messages"], int(body["max_tokens"]))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(text),
                 "total_tokens": prompt_tokens + len(text)}
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": text}}], "usage": usage}, headers=headers)
        return StreamingResponse(self._stream(text, usage), headers=headers,
                                 media_type="text/event-stream")

    async def _stream(self, text: str, usage: dict[str, int]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(self.first_content_delay_s)
            if self.error_mid_stream:
                yield _sse({"error": {"message": "stub mid-stream failure", "code": 500}})
                return
            for i, ch in enumerate(text):
                if i:
                    await asyncio.sleep(self.token_delay_s)
                yield _sse({"choices": [{"index": 0, "delta": {"content": ch}}]})
            yield _sse({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


@contextmanager
def serve_in_thread(app: Starlette, port: int) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1:``port`` in a daemon thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("stub server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--no-headers", action="store_true")
    args, _ = ap.parse_known_args()
    stub = StubRouter(action_after_first="direct" if args.direct else "pull",
                      headers=not args.no_headers)
    uvicorn.run(stub.app(), host="127.0.0.1", port=args.port, log_level="error")
