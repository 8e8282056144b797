"""A fake D run data parallel behind one URL: N fake engines (ranks), one API server.

vLLM started with ``--data-parallel-size N`` serves N engine cores behind one API server: each
rank has its own KV cache, its own engine id (the configured one with ``_dp<rank>``
appended, ``core.engine_group``) and its own NIXL side channel, and vLLM's load balancer picks
the rank of each request unless the request names one in its ``X-data-parallel-rank`` header.
``DataParallelFront`` is that server for fake engines: each rank is an ordinary
``FakeEngine`` whose listener is the front (``listen``) and whose engine ids come from the
front (``engine_id``), so everything else (KV, retention, syncs, reports) is per rank as in
vLLM.

* Generation requests go to the rank the header names (one out of range: vLLM's 400, as
  every fake engine's app answers a rank its server does not run), else round robin (vLLM
  balances by queue length; round robin is the same for a test's sequential turns, and
  deterministic).
* ``/metrics`` is every rank's, each with its own ``engine`` label (vLLM's labels per engine
  index); ``/health`` is 200 only while every rank is healthy; the fake's own endpoints
  (``/fake/...``) and the rest go to the header's rank, else rank 0.
* Ids: every rank of one start shares the group id (a random uuid, drawn anew at each start of
  the front after all ranks stopped, as vLLM draws the configured id at each server start). A
  rank restarted alone gets a new group id of its own: its blocks are gone, so its id must not
  be the one it had. vLLM has no such restart (an engine core that dies takes the server
  down); the fake's ``restart`` fault on one rank stays safe that way.
"""

from __future__ import annotations

import random
import uuid

from starlette.types import ASGIApp, Receive, Scope, Send

from kvrelay.fakevllm.engine import FakeEngine, Listen, Listener
from kvrelay.fakevllm.http import build_app
from kvrelay.fakevllm.server import HttpServer

RANK_HEADER = b"x-data-parallel-rank"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                              "/v1/messages"})


class DataParallelFront:
    """One URL (``host:port``, ``port=0``: a free one, kept across restarts) in front of the
    ``num_ranks`` ranks that ``listen`` is given to, in order (module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, num_ranks: int,
                 seed: str | None = None) -> None:
        self._server = HttpServer(self._dispatch, host, port)
        self._num_ranks = num_ranks
        self._apps: list[ASGIApp] = []
        self._engines: list[FakeEngine] = []
        self._running: set[int] = set()
        self._group: str | None = None
        self._issued: set[int] = set()
        self._next = 0
        self._rng = random.Random(seed)

    @property
    def num_ranks(self) -> int:
        return len(self._engines)

    def listen(self) -> Listen:
        """A ``FakeEngine``'s ``listen``: the engine becomes the next rank."""

        def listen(engine: FakeEngine) -> Listener:
            rank = len(self._engines)
            self._engines.append(engine)
            self._apps.append(build_app(engine, self._num_ranks))
            return _RankListener(self, rank)

        return listen

    def engine_id(self, rank: int) -> str:
        """Rank ``rank``'s engine id at its start (module docstring, "Ids")."""
        if self._group is None or rank in self._issued:
            self._group = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
            self._issued = set()
        self._issued.add(rank)
        return f"{self._group}_dp{rank}"

    async def _start(self, rank: int) -> None:
        await self._server.start()
        self._running.add(rank)

    async def _stop(self, rank: int) -> None:
        self._running.discard(rank)
        await self._server.stop()  # one rank's death takes the server down, as in vLLM
        if not self._running:
            self._group = None

    def _rank_for(self, scope: Scope) -> int:
        for name, value in scope.get("headers", ()):
            if name == RANK_HEADER:
                try:
                    rank = int(value)
                except ValueError:
                    break
                # out of range: rank 0's app answers vLLM's 400
                return rank if 0 <= rank < len(self._apps) else 0
        if scope.get("path") in GENERATION_PATHS:
            rank, self._next = self._next, (self._next + 1) % len(self._apps)
            return rank
        return 0

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] == "http" and path in ("/metrics", "/health"):
            await self._merged(path, send)
            return
        await self._apps[self._rank_for(scope)](scope, receive, send)

    async def _merged(self, path: str, send: Send) -> None:
        if path == "/health":
            ok = all(e.running and not e.faults.unhealthy for e in self._engines)
            await _send(send, 200 if ok else 503, b"", b"text/plain")
            return
        parts: list[str] = []
        for rank, engine in enumerate(self._engines):
            if not engine.running:
                continue
            text = engine.metrics_text().replace('engine="0"', f'engine="{rank}"')
            if parts:  # one HELP/TYPE per family, as one registry writes them
                text = "\n".join(line for line in text.splitlines()
                                 if not line.startswith("#"))
            parts.append(text.rstrip("\n"))
        await _send(send, 200, ("\n".join(parts) + "\n").encode(),
                    b"text/plain; version=0.0.4; charset=utf-8")


async def _send(send: Send, status: int, body: bytes, media_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", media_type),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _RankListener:
    """A rank's ``Listener``: the front's server, shared by every rank."""

    def __init__(self, front: DataParallelFront, rank: int) -> None:
        self._front = front
        self.rank = rank

    @property
    def host(self) -> str:
        return self._front._server.host

    @property
    def port(self) -> int:
        return self._front._server.port

    async def start(self) -> int:
        await self._front._start(self.rank)
        return self.port

    async def stop(self) -> None:
        await self._front._stop(self.rank)

    async def kill_connection(self, client: object) -> bool:
        return await self._front._server.kill_connection(client)
