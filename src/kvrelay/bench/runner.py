"""Running benchmark modes: a local cluster plus ``kvrelay route`` per mode, or a running router.

``run_managed`` starts, for each mode (see ``modes``), a fresh local cluster configured for
it and the router as a subprocess in front of it, runs the workload, and stops both before
the next mode, so modes never compete for cores. ``run_external`` benches an already-running
router under one user-given label instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Protocol, TextIO

import httpx

from kvrelay.bench.client import ChatClient, StatsDecisions, decision_counters
from kvrelay.bench.execute import run_workload
from kvrelay.bench.modes import ModeSpec, cluster_config_for
from kvrelay.bench.progress import Progress
from kvrelay.bench.report import ModeRun
from kvrelay.bench.workloads import Workload
from kvrelay.cluster.config import ClusterConfig


def router_command(
    mode: ModeSpec,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    host: str,
    port: int,
    ttl_s: float,
    python: str = sys.executable,
) -> list[str]:
    """The ``kvrelay route`` command line for ``mode`` in front of the given nodes."""
    cmd = [python, "-m", "kvrelay.cli", "route"]
    for url in prefill_urls:
        cmd += ["--prefill", url]
    for url in decode_urls:
        cmd += ["--decode", url]
    cmd += ["--host", host, "--port", str(port), "--ttl-s", str(ttl_s), "--log-level", "warning"]
    if mode.direct:
        cmd.append("--direct")
    return cmd


class ServiceStartError(RuntimeError):
    """A child service (router, fake engines) exited or did not answer in time; the message
    holds the tail of its log."""


class ServiceProcess:
    """A child process in its own session, dying with its parent, logging to ``log_path``.

    ``start()`` returns once every URL in ``ready_urls`` answers 200 (``ServiceStartError``
    if the process exits first or ``ready_timeout_s`` passes; the process is then stopped).
    ``stop()`` sends SIGTERM to the process group, SIGKILL after ``timeout_s``; idempotent.
    """

    def __init__(self, name: str, command: Sequence[str], ready_urls: Sequence[str],
                 log_path: Path, ready_timeout_s: float = 60.0) -> None:
        self.name = name
        self.command = list(command)
        self.ready_urls = list(ready_urls)
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(("$ " + " ".join(self.command) + "\n").encode())
        self._log.flush()
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(self.ready_urls)
        while pending:
            if self.process.poll() is not None:
                raise ServiceStartError(
                    f"{self.name} exited with {self.process.returncode}; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(pending[0], timeout=2.0).status_code == 200:
                    pending.pop(0)
                    continue
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"{self.name} not ready after {self.ready_timeout_s:.0f} s ({pending[0]}); "
                    f"log {self.log_path}:\n{_tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterHandle(Protocol):
    """A started P/D cluster as the runner needs it."""

    @property
    def prefill_urls(self) -> list[str]: ...
    @property
    def decode_urls(self) -> list[str]: ...
    @property
    def served_model_name(self) -> str: ...
    def stop(self) -> None: ...


ClusterFactory = Callable[[ClusterConfig, Path], ClusterHandle]
RouterCommandFactory = Callable[..., list[str]]


@dataclass
class _Local:
    cluster: Any

    @property
    def prefill_urls(self) -> list[str]:
        return [n.url for n in self.cluster.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [n.url for n in self.cluster.decode]

    @property
    def served_model_name(self) -> str:
        return str(self.cluster.served_model_name)

    def stop(self) -> None:
        self.cluster.stop()


def local_cluster(config: ClusterConfig, run_dir: Path) -> ClusterHandle:
    """Start a real vLLM ``LocalCluster`` (blocks until healthy)."""
    from kvrelay.cluster.launcher import LocalCluster

    return _Local(LocalCluster(config, run_dir).start())


@dataclass(frozen=True)
class BenchOptions:
    """How requests are sent and shown: conversation id prefix, router tenant (for the
    ``/stats`` fallback), extra body fields, client timeout, progress stream."""

    id_prefix: str = ""
    tenant: str = "default"
    extra_body: Mapping[str, object] | None = None
    timeout_s: float = 900.0
    progress: TextIO | None = None


async def bench_router(
    workload: Workload, mode: str, router_url: str, model: str, options: BenchOptions,
    info: Mapping[str, Any] | None = None,
) -> ModeRun:
    """Run ``workload`` against ``router_url``; ``info`` gets the ``/stats`` counters' delta."""
    async with ChatClient(router_url, model, timeout_s=options.timeout_s,
                          stats=StatsDecisions(options.tenant),
                          extra_body=options.extra_body) as client:
        before = await client.get_json("/stats")
        progress = Progress(mode, workload.num_turns, options.progress)
        try:
            records = await run_workload(workload, client, mode=mode,
                                         id_prefix=options.id_prefix, on_turn=progress.update)
        finally:
            progress.close()
        after = await client.get_json("/stats")
    return ModeRun(mode, records, {**(info or {}), "router_url": router_url, "model": model,
                                   "router_stats_delta": stats_delta(before, after)})


def stats_delta(before: Any, after: Any) -> dict[str, dict[str, int]] | None:
    """``by_action``/``by_reason`` counters of ``/stats`` after minus before (``None`` if
    the router has no ``/stats``)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    out: dict[str, dict[str, int]] = {}
    for key in ("by_action", "by_reason"):
        a = decision_counters(before).get(key) or {}
        b = decision_counters(after).get(key) or {}
        out[key] = {k: int(b[k]) - int(a.get(k, 0)) for k in sorted(b) if b[k] != a.get(k, 0)}
    return out


def run_managed(
    workload: Workload,
    modes: Sequence[ModeSpec],
    base: ClusterConfig,
    run_dir: Path,
    options: BenchOptions,
    *,
    cluster_factory: ClusterFactory = local_cluster,
    command_factory: RouterCommandFactory = router_command,
    router_host: str = "127.0.0.1",
    router_ready_timeout_s: float = 60.0,
    router_args: Sequence[str] = (),
) -> list[ModeRun]:
    """For each mode: start its cluster and router (``router_args`` appended to the router's
    command line), run ``workload``, stop both."""
    runs: list[ModeRun] = []
    for mode in modes:
        config = cluster_config_for(mode, base)
        mode_dir = run_dir / mode.name
        cluster = cluster_factory(config, mode_dir / "cluster")
        try:
            port = free_port(router_host)
            url = f"http://{router_host}:{port}"
            cmd = command_factory(mode, cluster.prefill_urls, cluster.decode_urls,
                                  host=router_host, port=port,
                                  ttl_s=float(config.decoder_kv_blocks_ttl_s))
            cmd += list(router_args)
            info = {"bidirectional": config.bidirectional, "direct": mode.direct,
                    "prefill_prefix_caching": config.prefill_prefix_caching,
                    "num_prefill": config.num_prefill, "num_decode": config.num_decode,
                    "cluster_model": config.model, "ttl_s": config.decoder_kv_blocks_ttl_s,
                    "run_dir": str(mode_dir)}
            router = ServiceProcess("router", cmd, [f"{url}/stats"], mode_dir / "router.log",
                                    router_ready_timeout_s)
            with router:
                runs.append(asyncio.run(bench_router(
                    workload, mode.name, url, cluster.served_model_name,
                    replace(options, id_prefix=f"{options.id_prefix}{mode.name}-"), info,
                )))
        finally:
            cluster.stop()
    return runs


def run_external(
    workload: Workload, router_url: str, label: str, model: str, options: BenchOptions
) -> list[ModeRun]:
    """Run ``workload`` against an already-running router, as mode ``label``."""
    return [asyncio.run(bench_router(workload, label, router_url, model, options))]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
