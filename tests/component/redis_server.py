"""A real ``redis-server`` on a free loopback port for the shared-state tests.

No mock and no fakeredis: the scripts, TTLs and reconnects under test are Redis's own. A
missing ``redis-server`` is a setup error of every test that needs it, never a pass or a skip
(``make setup`` installs the Debian package when it can, else says which one to install).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.ports import free_port

READY_DEADLINE_S = 30.0


class RedisServer:
    """``redis-server --port PORT --bind 127.0.0.1 --save '' --appendonly no``; ``stop()``
    kills it (SIGKILL, like a crash) and ``start()`` brings it back on the same port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + READY_DEADLINE_S
        while not self._pong():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server never answered PING")
            time.sleep(0.01)

    def stop(self) -> None:
        """Kill the server (no shutdown save, open connections reset)."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def redis_binary() -> str:
    """The ``redis-server`` binary, or a clear failure of the calling fixture (pytest reports
    it as a setup error of the test, never as a skip or a pass)."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if found is None:
        pytest.fail("redis-server not found: install the Debian package redis-server "
                    "(`make setup` does when run as root) to run the shared-state tests",
                    pytrace=False)
    return found
