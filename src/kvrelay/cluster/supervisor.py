"""Keep a running local cluster serving: restart a node (or the router) that exits.

``kvrelay up`` calls ``Supervisor.poll()`` about once a second. A unit that exits is restarted
after a backoff (``RestartPolicy``), in the background: the other units keep serving, and
``poll`` never blocks on a start. Each step is reported through ``say`` (``kvrelay up``
prints it) and appended to the unit's own log. When a unit fails ``max_attempts`` restarts in
a row, ``poll`` raises ``GaveUp`` and the caller stops the cluster.

What the router sees meanwhile: the node's health checks fail, so it is marked down (its
entries dropped) and routed around; when the restarted node answers ``/health`` again it is
marked up, and its first response carries its new engine id (``remote_engine_id``), which the
router adopts (docs/router.md, "Nodes, costs and failures").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from kvrelay.cluster.config import RestartPolicy
from kvrelay.cluster.launcher import LocalCluster, RunningNode, ServiceProcess, log_tail


class Supervised(Protocol):
    """One restartable child service."""

    @property
    def name(self) -> str: ...

    @property
    def log_path(self) -> Path: ...

    def alive(self) -> bool: ...

    def exit_status(self) -> int | None:
        """The exit status once it exited, else ``None``."""
        ...

    def respawn(self) -> None:
        """Kill what is left of the previous process group and start again, at once."""
        ...

    def ready(self) -> bool:
        """Answers its health check right now."""
        ...


class GaveUp(RuntimeError):
    """A unit failed ``RestartPolicy.max_attempts`` restarts in a row."""


Phase = Literal["running", "backoff", "starting"]


@dataclass
class _Watch:
    unit: Supervised
    phase: Phase = "running"
    #: Consecutive restarts that did not (yet) stay healthy for ``reset_after_s``.
    attempts: int = 0
    #: backoff: when to respawn; starting: when to give this attempt up.
    due_s: float = 0.0
    #: running: healthy since; starting: spawned at.
    since_s: float = 0.0


class Supervisor:
    """Restarts units that exit, with backoff and a bound on consecutive attempts."""

    def __init__(
        self,
        units: Sequence[Supervised],
        policy: RestartPolicy,
        startup_timeout_s: float,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = policy
        self._startup_timeout_s = startup_timeout_s
        self._say = say
        self._clock = clock
        now = clock()
        self._watches = [_Watch(unit, since_s=now) for unit in units]

    def phase(self, name: str) -> Phase:
        return next(w.phase for w in self._watches if w.unit.name == name)

    def poll(self) -> None:
        """One supervision step for every unit; raises ``GaveUp``."""
        for watch in self._watches:
            self._step(watch, self._clock())

    def _step(self, w: _Watch, now: float) -> None:
        if w.phase == "running":
            if w.unit.alive():
                if w.attempts and now - w.since_s >= self._policy.reset_after_s:
                    w.attempts = 0
                return
            self._failed(w, now, f"exited with status {w.unit.exit_status()}")
        elif w.phase == "backoff":
            if now >= w.due_s:
                self._note(w, f"restarting (attempt {w.attempts}/{self._policy.max_attempts})")
                w.unit.respawn()
                w.phase, w.since_s = "starting", now
                w.due_s = now + self._startup_timeout_s
        elif not w.unit.alive():
            self._failed(w, now, f"exited with status {w.unit.exit_status()} while starting")
        elif w.unit.ready():
            self._note(w, f"back: healthy {now - w.since_s:.0f} s after restart {w.attempts}")
            w.phase, w.since_s = "running", now
        elif now > w.due_s:
            self._failed(w, now, f"not healthy {self._startup_timeout_s:.0f} s after restart")

    def _failed(self, w: _Watch, now: float, why: str) -> None:
        if w.attempts >= self._policy.max_attempts:
            self._note(w, f"{why}; giving up after {w.attempts} restarts")
            raise GaveUp(f"{w.unit.name} {why}; gave up after {w.attempts} restarts; last "
                         f"lines of {w.unit.log_path}:\n{log_tail(w.unit.log_path, 30)}")
        w.attempts += 1
        delay_s = self._policy.backoff_s(w.attempts)
        self._note(w, f"{why}; restarting in {delay_s:.0f} s "
                      f"(attempt {w.attempts}/{self._policy.max_attempts})")
        w.phase, w.due_s = "backoff", now + delay_s

    def _note(self, w: _Watch, message: str) -> None:
        line = f"{w.unit.name}: {message}"
        self._say(line)
        try:
            with open(w.unit.log_path, "a") as log:
                log.write(f"--- kvrelay up: {line} ---\n")
        except OSError:
            pass


class NodeUnit:
    """A vLLM node of a ``LocalCluster`` as a ``Supervised`` unit."""

    def __init__(self, cluster: LocalCluster, node: RunningNode) -> None:
        self._cluster = cluster
        self._node = node

    @property
    def name(self) -> str:
        return self._node.spec.name

    @property
    def log_path(self) -> Path:
        return self._node.log_path

    def alive(self) -> bool:
        return self._node.alive()

    def exit_status(self) -> int | None:
        return self._node.process.poll()

    def respawn(self) -> None:
        self._cluster.respawn(self._node)

    def ready(self) -> bool:
        return self._cluster.healthy(self._node)


class ServiceUnit:
    """A ``ServiceProcess`` (the router) as a ``Supervised`` unit."""

    def __init__(self, service: ServiceProcess) -> None:
        self._service = service

    @property
    def name(self) -> str:
        return self._service.name

    @property
    def log_path(self) -> Path:
        return self._service.log_path

    def alive(self) -> bool:
        return self._service.alive()

    def exit_status(self) -> int | None:
        process = self._service.process
        return process.poll() if process is not None else None

    def respawn(self) -> None:
        self._service.spawn()

    def ready(self) -> bool:
        return self._service.ready()
