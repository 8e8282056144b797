"""``python -m kvrelay.cli route`` as a subprocess in front of an in-process ``FakeCluster``,
for black-box tests that reach the router only over real sockets (its public port, its
internal listener, its log file, its exit status): they hold for any implementation of the
router's HTTP layer, and never import ``kvrelay.router``.

    async with FakeCluster(1, 1, CONFIG, sleep=gate) as cluster, \\
            run_router(cluster, log_dir, "--max-in-flight", "4") as router:
        async with router.client() as c:
            ...
        assert (await router.metrics()).value("kvrelay_router_in_flight") == 0

Readiness is a TCP connect on every listening port (``/health`` is under test itself). The
router runs with ``--health-interval-s 3600`` (one background round, at start-up),
``--block-size 128`` and fixed costs that make every pull pay (``--fixed-costs``,
``tests.costs.PULL_PAYS``: no decision follows this machine's speed) unless the caller's
arguments say otherwise; a router whose ``route --help`` lacks ``--fixed-costs`` runs
without it (``dropped_flags``).

Flags added by issue #12 (``ISSUE_12_FLAGS``) are passed only to a router whose
``route --help`` lists them: the router before #12 then runs with its old listeners and
limits, so each test fails there on the behaviour it checks, not on an unknown flag;
``RouterProcess.dropped_flags`` says which were left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.cluster.launcher import spawn_supervised
from kvrelay.fakevllm import FakeCluster, FakeEngineConfig
from tests.component.fake_vllm_version import engine_config
from tests.costs import fixed_costs_flag
from tests.ports import free_ports

#: Options issue #12 adds to ``kvrelay route`` (see the module docstring).
ISSUE_12_FLAGS = frozenset({
    "--internal-host", "--internal-port", "--internal-url", "--max-in-flight-per-tenant",
})
#: Safety net for things that must happen (a bound on waiting, never a timing assertion).
PATIENCE_S = 30.0


@functools.cache
def route_flags() -> frozenset[str]:
    """Every ``--option`` that ``python -m kvrelay.cli route --help`` lists."""
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "route", "--help"],
        capture_output=True, text=True, check=True, env=_env(),
    )
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


async def until(predicate: Callable[[], bool], what: str, bound_s: float = PATIENCE_S) -> None:
    """Yield to the event loop until ``predicate()`` holds; ``AssertionError`` after
    ``bound_s`` (a safety net for something that must happen, not a timing check)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


async def eventually(
    probe: Callable[[], Awaitable[Any]], accept: Callable[[Any], bool], what: str,
    bound_s: float = PATIENCE_S,
) -> Any:
    """Call ``probe()`` until ``accept(result)``; returns that result. ``AssertionError``
    with the last result after ``bound_s`` (a safety net, see ``until``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while True:
        result = await probe()
        if accept(result):
            return result
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}; last seen: {result!r}")
        await asyncio.sleep(0.02)


class HeldSleep:
    """An injectable engine ``sleep`` (``FakeCluster(sleep=...)``): every call is one
    simulated step (a token under ``slow_stream_s``, a report's ``report_delay_s``). Calls
    return at once, except while held: ``hold()`` holds every following call, ``hold(n)``
    only the next ``n``, until ``release()``. ``held`` counts the calls waiting now."""

    def __init__(self) -> None:
        self._budget: int | None = 0
        self._released = asyncio.Event()
        self.held = 0
        self.calls = 0

    def hold(self, calls: int | None = None) -> None:
        self._budget = calls
        self._released = asyncio.Event()

    def release(self) -> None:
        self._budget = 0
        self._released.set()

    async def __call__(self, seconds: float) -> None:
        self.calls += 1
        if self._budget == 0:
            return
        if self._budget is not None:
            self._budget -= 1
        released = self._released
        self.held += 1
        try:
            await released.wait()
        finally:
            self.held -= 1


class Metrics:
    """One scrape of ``/metrics``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        """Samples called ``name`` whose labels include ``labels``."""
        return [(lab, v) for n, lab, v in self.samples
                if n == name and all(lab.get(k) == want for k, want in labels.items())]

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the matching samples, ``None`` if there is none."""
        found = self.find(name, **labels)
        return sum(v for _, v in found) if found else None

    def total(self, name: str, **labels: str) -> float:
        """Like ``value``, 0 when absent (counters not incremented yet)."""
        return self.value(name, **labels) or 0.0


@dataclass
class RouterProcess:
    process: subprocess.Popen[bytes]
    port: int
    internal_port: int | None
    log_path: Path
    command: list[str]
    dropped_flags: tuple[str, ...] = field(default=())

    host = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def internal_url(self) -> str:
        """The internal listener's base URL; the public one for a router that has none."""
        port = self.internal_port if self.internal_port is not None else self.port
        return f"http://{self.host}:{port}"

    def client(self, **kw: Any) -> httpx.AsyncClient:
        options: dict[str, Any] = {"base_url": self.url, "timeout": PATIENCE_S,
                                   "trust_env": False, **kw}
        return httpx.AsyncClient(**options)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    async def metrics(self, key: str | None = None) -> Metrics:
        """One scrape of the public ``/metrics`` (with ``key`` as its bearer token)."""
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        async with self.client() as c:
            resp = await c.get("/metrics", headers=headers)
        assert resp.status_code == 200, f"GET /metrics answered {resp.status_code}"
        return Metrics(resp.text)

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    async def wait_exit(self, bound_s: float = PATIENCE_S) -> int:
        """The exit status, once the router exited (``AssertionError`` after ``bound_s``)."""
        await until(lambda: self.process.poll() is not None, "the router exited", bound_s)
        return int(self.process.returncode)

    def kill(self) -> None:
        """SIGKILL the router's process group (teardown: no drain to wait for)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.asynccontextmanager
async def run_router(
    cluster: FakeCluster,
    log_dir: Path,
    *args: str,
    internal: bool = False,
    new_flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[RouterProcess]:
    """Start ``kvrelay route`` in front of every engine of ``cluster``; SIGKILL it on exit.

    ``args`` are passed as given (after the defaults, so they win). ``internal`` asks for
    the internal listener of issue #12 on a free loopback port (``--internal-host``,
    ``--internal-port``, ``--internal-url``). ``new_flags`` are further issue-#12 options
    with their values (``["--max-in-flight-per-tenant", "2"]``). Both are passed only to a
    router that lists them (module docstring).
    """
    known = await asyncio.to_thread(route_flags)
    port, iport = free_ports(2)
    internal_port: int | None = None
    extra: list[str] = []
    dropped: list[str] = []
    wanted: list[tuple[str, str]] = list(zip(new_flags[::2], new_flags[1::2], strict=True))
    if internal:
        wanted = [("--internal-host", "127.0.0.1"), ("--internal-port", str(iport)),
                  ("--internal-url", f"http://127.0.0.1:{iport}"), *wanted]
    for flag, value in wanted:
        assert flag in ISSUE_12_FLAGS, f"{flag} is not an issue-#12 flag: pass it in args"
        if flag in known:
            extra += [flag, value]
            if flag == "--internal-port":
                internal_port = int(value)
        else:
            dropped.append(flag)
    if internal_port is None and "--internal-port" in known:
        extra += ["--internal-port", "0"]  # not port + 1: it may be taken
    if "--fixed-costs" in known:
        extra += ["--fixed-costs", fixed_costs_flag()]
    else:
        dropped.append("--fixed-costs")
    command = [sys.executable, "-m", "kvrelay.cli", "route"]
    for url in cluster.prefill_urls:
        command += ["--prefill", url]
    for url in cluster.decode_urls:
        command += ["--decode", url]
    command += ["--port", str(port), "--block-size", "128", "--health-interval-s", "3600",
                "--log-level", "info", *extra, *args]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"router-{port}.log"
    process, log_file = spawn_supervised(command, log_path, {**_env(), **(env or {})})
    router = RouterProcess(process, port, internal_port, log_path, command, tuple(dropped))
    try:
        ports = [port] if internal_port is None else [port, internal_port]
        for p in ports:
            await _wait_listening(router, p)
        await _wait_engines_asked(cluster)
        yield router
    finally:
        router.kill()
        log_file.close()


@dataclass
class Rig:
    """A router subprocess in front of one fake P and one fake D: the module-scoped fixture
    of the black-box security tests (``fake_rig``)."""

    cluster: FakeCluster
    router: RouterProcess

    def generation_requests(self) -> int:
        """Generation requests the engines received so far (``/tokenize`` not counted)."""
        return sum(len(e.records) for e in self.cluster.engines)


@contextlib.asynccontextmanager
async def fake_rig(
    log_dir: Path, *args: str, config: FakeEngineConfig | None = None,
) -> AsyncIterator[Rig]:
    """``run_router(cluster, log_dir, *args)`` in front of ``FakeCluster(1, 1, config)``;
    ``config`` defaults to engines that post D's reports at once."""
    async with FakeCluster(1, 1, config or engine_config(report_delay_s=0.0)) as cluster, \
            run_router(cluster, log_dir, *args) as router:
        yield Rig(cluster, router)


async def _wait_engines_asked(cluster: FakeCluster, bound_s: float = 10.0) -> None:
    """The router asks each node that comes up which engine it runs (``EngineChecks.learn``:
    a one-token completion): wait until every node got that request, so that what a test
    counts at the engines begins after it. Bounded: a node that is not up is not asked."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while any(not e.records for e in cluster.engines) and loop.time() < deadline:
        await asyncio.sleep(0.02)


async def _wait_listening(router: RouterProcess, port: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60.0
    while True:
        if router.process.poll() is not None:
            raise AssertionError(
                f"the router exited with {router.process.returncode} before listening on "
                f"{port}; log:\n{router.log()[-3000:]}")
        try:
            _, writer = await asyncio.open_connection(router.host, port)
        except OSError:
            if loop.time() > deadline:
                raise AssertionError(
                    f"the router never listened on {port}; log:\n{router.log()[-3000:]}"
                ) from None
            await asyncio.sleep(0.05)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def is_openai_error(body: object, status: int | None = None) -> bool:
    """``{"error": {"message": str, "type": str, "param": str|null, "code": int}}`` (with
    ``code == status`` when given), or ``code`` an error OpenAI names
    (``previous_response_not_found``)."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return False
    err = body["error"]
    return (
        set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str) and bool(err["message"])
        and isinstance(err["type"], str) and bool(err["type"])
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] in NAMED_CODES or (isinstance(err["code"], int)
             and (status is None or err["code"] == status)))
    )


NAMED_CODES = frozenset({"previous_response_not_found"})
"""Error codes the router sends as OpenAI names them, in place of the HTTP status."""


def openai_error_of(resp: httpx.Response) -> dict[str, Any]:
    """The response's OpenAI error body; ``AssertionError`` if it is not one."""
    try:
        body = resp.json()
    except ValueError:
        raise AssertionError(
            f"HTTP {resp.status_code} without a JSON body: {resp.text[:300]!r}") from None
    assert is_openai_error(body, resp.status_code), (
        f"HTTP {resp.status_code} without an OpenAI error body: {resp.text[:300]!r}")
    result: dict[str, Any] = body
    return result
