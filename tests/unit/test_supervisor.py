"""``kvrelay up``'s supervision policy with fake units and a manual clock: backoff, bounded
attempts, reset after a stable period, and never blocking on a start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.cluster.config import RestartPolicy
from kvrelay.cluster.supervisor import GaveUp, Supervisor


class FakeUnit:
    """A unit whose process dies when told and becomes ready ``start_polls`` polls after a
    respawn (or never, with ``fails_to_start``)."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.running = True
        self.status: int | None = None
        self.respawns = 0
        self.ready_after = 0
        self.fails_to_start = False

    def kill(self, status: int = -9) -> None:
        self.running, self.status = False, status

    def alive(self) -> bool:
        return self.running

    def exit_status(self) -> int | None:
        return None if self.running else self.status

    def respawn(self) -> None:
        self.respawns += 1
        self.running, self.status = not self.fails_to_start, 1 if self.fails_to_start else None
        self.ready_after = 2

    def ready(self) -> bool:
        self.ready_after -= 1
        return self.running and self.ready_after <= 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, policy: RestartPolicy, *names: str):
    clock, said = Clock(), []
    units = [FakeUnit(n, tmp_path / f"{n}.log") for n in names]
    sup = Supervisor(units, policy, startup_timeout_s=60, say=said.append, clock=clock)
    return sup, units, clock, said


def test_exited_node_is_restarted_after_backoff_while_others_keep_running(tmp_path):
    sup, (p, d), clock, said = make(tmp_path, RestartPolicy(initial_backoff_s=2), "p", "d")
    d.kill()
    sup.poll()
    assert said == ["d: exited with status -9; restarting in 2 s (attempt 1/5)"]
    assert sup.phase("d") == "backoff" and d.respawns == 0
    clock.now += 1.9
    sup.poll()
    assert d.respawns == 0
    clock.now += 0.2
    sup.poll()
    assert d.respawns == 1 and sup.phase("d") == "starting"
    sup.poll()  # not ready yet: poll returns, nothing blocks
    assert sup.phase("d") == "starting"
    clock.now += 30
    sup.poll()
    assert sup.phase("d") == "running"
    assert said[1:] == ["d: restarting (attempt 1/5)", "d: back: healthy 30 s after restart 1"]
    assert p.respawns == 0 and sup.phase("p") == "running"
    log = d.log_path.read_text()
    assert "--- kvrelay up: d: restarting (attempt 1/5) ---" in log


def test_backoff_doubles_and_gives_up_after_max_attempts(tmp_path):
    policy = RestartPolicy(max_attempts=3, initial_backoff_s=1, max_backoff_s=3)
    sup, (d,), clock, said = make(tmp_path, policy, "d")
    d.fails_to_start = True
    d.kill()
    with pytest.raises(GaveUp, match="gave up after 3 restarts"):
        for _ in range(100):
            sup.poll()
            clock.now += 0.5
    assert d.respawns == 3
    waits = [line for line in said if "restarting in" in line]
    assert [w.split("restarting in ")[1] for w in waits] == [
        "1 s (attempt 1/3)", "2 s (attempt 2/3)", "3 s (attempt 3/3)"]
    assert said[-1].endswith("giving up after 3 restarts")


def test_start_that_never_gets_healthy_counts_as_a_failed_attempt(tmp_path):
    sup, (d,), clock, said = make(tmp_path, RestartPolicy(max_attempts=2), "d")
    d.kill()
    sup.poll()
    clock.now += 1
    sup.poll()
    d.ready_after = 10**9  # alive, never healthy
    clock.now += 61
    sup.poll()
    assert said[-1] == "d: not healthy 60 s after restart; restarting in 2 s (attempt 2/2)"


def test_attempts_reset_after_staying_healthy(tmp_path):
    policy = RestartPolicy(max_attempts=1, initial_backoff_s=0, reset_after_s=100)
    sup, (d,), clock, _ = make(tmp_path, policy, "d")
    for _ in range(3):  # one attempt allowed, but each time it stays up long enough
        d.kill()
        sup.poll()
        sup.poll()
        clock.now += 1
        sup.poll()
        sup.poll()
        assert sup.phase("d") == "running"
        clock.now += 100
        sup.poll()
    assert d.respawns == 3
    d.kill()
    sup.poll()
    sup.poll()
    d.kill()  # dies again before staying up: the one attempt is spent
    with pytest.raises(GaveUp):
        for _ in range(5):
            sup.poll()


def test_zero_attempts_gives_up_at_once(tmp_path):
    sup, (d,), _, _ = make(tmp_path, RestartPolicy(max_attempts=0), "d")
    d.log_path.write_text("boom: CUDA out of memory\n")
    d.kill(1)
    with pytest.raises(GaveUp, match="boom: CUDA out of memory"):
        sup.poll()
    assert d.respawns == 0


def test_policy_backoff_is_capped_and_validated():
    policy = RestartPolicy(initial_backoff_s=1, max_backoff_s=30)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 5, 6, 10)] == [1, 2, 4, 16, 30, 30]
    with pytest.raises(ValueError):
        RestartPolicy(max_attempts=-1)
