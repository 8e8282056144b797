"""Serving the router with uvicorn: slow-client deadlines and graceful shutdown.

uvicorn bounds idle keep-alive connections but not a client that trickles its request:
* headers: ``protocol_class`` closes a connection that has not delivered a complete request
  head ``header_timeout_s`` after it opened or after its previous response ended;
* body: ``limits.read_body`` answers 408 when the body is not in ``body_timeout_s`` after the
  handler started reading it.
Slow clients hold only their own connection; the event loop never waits for them.

Graceful shutdown (``RouterServer``): the first SIGTERM or SIGINT sets the router to draining
(new requests get 503), closes the listening socket (new connections are refused) and idle
keep-alive connections, lets requests in flight, streams included, finish for up to
``drain_timeout_s`` (whole seconds, rounded up), cancels what is left, runs the app's
shutdown and returns, so ``kvrelay route`` exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvrelay.router.config import RouterConfig
from kvrelay.router.limits import GuardState

log = logging.getLogger("kvrelay.router")

_Protocol: Any = AutoHTTPProtocol  # httptools if installed, else h11


class _HeaderDeadline(_Protocol):  # type: ignore[misc]
    """uvicorn's HTTP protocol plus a deadline for each request head (module docstring)."""

    header_timeout_s: float = 30.0
    _kvrelay_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._kvrelay_arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._kvrelay_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._kvrelay_disarm()
        super().connection_lost(exc)

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
            return  # a request is being served: its body has its own deadline
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(header_timeout_s: float) -> type[Any]:
    """uvicorn's ``http`` protocol class with a request-head deadline."""
    return type("KVRelayHttpProtocol", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s})


class RouterServer(uvicorn.Server):
    """A uvicorn server that drains on SIGTERM/SIGINT and returns normally (see module)."""

    def __init__(
        self, config: uvicorn.Config, guard: GuardState, *, install_signals: bool = True
    ) -> None:
        super().__init__(config)
        self.guard = guard
        self._install_signals = install_signals

    def begin_drain(self) -> None:
        """Refuse new work and start the graceful shutdown."""
        if not self.guard.draining:
            log.info("draining: %d request(s) in flight", self.guard.in_flight)
        self.guard.draining = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not uvicorn's: it would re-raise the signal after shutdown (exit status -15)
        if self.guard.draining:
            self.force_exit = True
        else:
            self.begin_drain()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self._install_signals:
            yield
            return
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(
    config: RouterConfig, app: Starlette, *, install_signals: bool = True, **uvicorn_options: Any
) -> RouterServer:
    """The server for ``app`` (from ``create_app(config)``) on ``config.host:config.port``."""
    options: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "log_level": config.log_level,
        "access_log": False,
        "timeout_keep_alive": 30,
        "backlog": 4096,
        "http": protocol_class(config.header_timeout_s),
        "timeout_graceful_shutdown": math.ceil(config.drain_timeout_s),
    }
    options.update(uvicorn_options)
    guard: GuardState = app.state.guard
    return RouterServer(uvicorn.Config(app, **options), guard, install_signals=install_signals)


def serve(config: RouterConfig, **uvicorn_options: Any) -> None:
    """Run the router until SIGTERM/SIGINT, then drain (blocking)."""
    from kvrelay.router.app import create_app

    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    server = make_server(config, create_app(config), **uvicorn_options)
    server.run()
    log.info("router stopped")
