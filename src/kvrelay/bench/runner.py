"""Running benchmark modes: a local cluster plus ``kvrelay route`` per mode, or a running router.

``run_managed`` starts, for each mode (see ``modes``), a fresh local cluster configured for
it and the router as a subprocess in front of it, runs the workload, and stops both before
the next mode, so modes never compete for cores. ``run_external`` benches an already-running
router under one user-given label instead.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from kvrelay.bench.client import ChatClient, StatsDecisions, decision_counters
from kvrelay.bench.execute import run_workload
from kvrelay.bench.modes import ModeSpec, cluster_config_for
from kvrelay.bench.progress import Progress
from kvrelay.bench.report import ModeRun
from kvrelay.bench.workloads import Workload
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.config import router_command as cluster_router_command
from kvrelay.cluster.launcher import ServiceProcess, free_port


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
    extra = ["--log-level", "warning", *(["--direct"] if mode.direct else [])]
    return cluster_router_command(list(prefill_urls), list(decode_urls), host=host, port=port,
                                  ttl_s=ttl_s, internal_port=0, python=python, extra=extra)


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
