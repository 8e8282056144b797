"""One in-process uvicorn HTTP server that can be started, killed and restarted on its port.

Many of these run in one event loop (one per fake engine). Unlike ``uvicorn.Server.serve`` it
installs no signal handlers (the caller owns Ctrl-C) and it stops *abruptly*, like a killed
process: the listening socket closes, every open connection is reset, and in-flight requests
are cancelled. That is both what the ``crash`` fault needs and what keeps test teardown fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send


class HttpServer:
    """Serves ``app`` on ``host:port`` (``port=0``: any free port, kept across restarts)."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self._app = app
        self.host = host
        self.port = port
        self._server: uvicorn.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._killing = False

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> int:
        """Bind and serve; returns the port. ``OSError`` if the port is taken."""
        if self._server is not None:
            return self.port
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._track,
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        try:
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        self._killing = False
        self._server = server
        return self.port

    async def stop(self) -> None:
        """Kill the server: close the listener, reset connections, cancel requests."""
        server, self._server = self._server, None
        if server is None:
            return
        self._killing = True
        for listener in server.servers:
            listener.close()
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for listener in server.servers:
            with contextlib.suppress(Exception):
                await listener.wait_closed()
        self._killing = False

    async def kill_connection(self, client: object, drain_s: float = 1.0) -> bool:
        """Reset the connection of the request whose ASGI ``scope["client"]`` is ``client``,
        after what was already written to it has left (up to ``drain_s``), so the peer sees
        every byte sent so far and then a dead connection."""
        server = self._server
        if server is None or not isinstance(client, list | tuple):
            return False
        for conn in list(server.server_state.connections):
            if tuple(getattr(conn, "client", None) or ()) == tuple(client):
                transport = conn.transport
                deadline = asyncio.get_running_loop().time() + drain_s
                while (
                    transport.get_write_buffer_size() > 0
                    and asyncio.get_running_loop().time() < deadline
                ):
                    await asyncio.sleep(0.001)
                transport.abort()
                await asyncio.sleep(0)
                return True
        return False

    async def _track(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app as a tracked request, so ``stop`` can cancel it without noise."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._app(scope, receive, send)
        except asyncio.CancelledError:
            if not self._killing:
                raise
        finally:
            if task is not None:
                self._tasks.discard(task)
