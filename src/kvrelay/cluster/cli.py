"""``kvrelay model init`` and ``kvrelay up``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvrelay.cluster.config import (
    DEFAULT_NIXL_PROGRESS_DELAY_US,
    ClusterConfig,
    RestartPolicy,
    block_size_of,
    router_command,
)
from kvrelay.cluster.launcher import (
    ClusterStartError,
    LocalCluster,
    ServiceProcess,
    ServiceStartError,
)
from kvrelay.cluster.supervisor import GaveUp, NodeUnit, ServiceUnit, Supervised, Supervisor


def register(sub: Any) -> None:
    model = sub.add_parser("model", help="generate the default local models")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    init = model_sub.add_parser("init", help="generate (or find cached) a default model")
    init.add_argument("--size", default="tiny", help="tiny (tests, demo) or bench")
    init.set_defaults(func=_model_init)

    up = sub.add_parser("up", help="start a local vLLM P/D cluster (Ctrl-C stops it)")
    add_cluster_arguments(up)
    up.add_argument("--monitoring", action="store_true",
                    help="also start Prometheus (Debian package prometheus) scraping the "
                         "router, P and D; docs/monitoring.md shows how to add Grafana")
    up.add_argument("--prometheus-port", type=int, default=9090)
    up.set_defaults(func=_up)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    d = ClusterConfig()
    parser.add_argument("--prefill", type=int, default=d.num_prefill, help="number of P nodes")
    parser.add_argument("--decode", type=int, default=d.num_decode, help="number of D nodes")
    parser.add_argument(
        "--model", default=d.model, help="default model size (tiny, bench) or a local model dir"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--base-port", type=int, default=d.base_port)
    parser.add_argument("--side-channel-base-port", type=int, default=d.side_channel_base_port)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, auto on cuda")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--kv-cache-space-gib", type=int, default=d.kv_cache_space_gib)
    parser.add_argument("--ttl-s", type=int, default=d.decoder_kv_blocks_ttl_s,
                        help="decoder_kv_blocks_ttl: how long D keeps a finished turn's KV")
    parser.add_argument("--kv-recompute-threshold", type=int, default=d.kv_recompute_threshold)
    parser.add_argument("--no-bidirectional", action="store_true",
                        help="one-way P->D only (the recompute baseline)")
    parser.add_argument("--prefill-prefix-caching", action="store_true",
                        help="enable prefix caching on P (off by default, as in the seed)")
    parser.add_argument("--no-decode-prefix-caching", action="store_true")
    parser.add_argument("--nixl-progress-delay-us", type=int,
                        default=DEFAULT_NIXL_PROGRESS_DELAY_US)
    parser.add_argument("--no-restore-affinity", action="store_true",
                        help="keep vLLM's CPU main-thread re-pinning (reproduces the stall)")
    parser.add_argument("--no-pin-processes", action="store_true",
                        help="let each CPU server's API server and engine core float over all "
                             "cores (reproduces P's slowdown while D retains blocks)")
    parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    parser.add_argument(
        "--max-restarts", type=int, default=d.restart.max_attempts, metavar="N",
        help="restart a node or the router that exits, up to N times in a row with backoff "
             "(0: stop the cluster instead)")
    parser.add_argument(
        "--tool-call-parser", default=d.tool_call_parser, metavar="NAME",
        help="vLLM tool-call parser for auto tool choice: auto (from the model's model_type; "
             "the default models use hermes), none (off), or any vLLM parser name")
    for flag, role in (("--engine-arg", "every node"), ("--prefill-engine-arg", "P nodes"),
                       ("--decode-engine-arg", "D nodes")):
        parser.add_argument(
            flag, action="append", default=[], metavar="ARGS",
            help=f"one extra vLLM server argument for {role}, passed as is (repeatable: "
                 f"{flag}=--max-num-seqs=8, or {flag}=--max-num-seqs {flag}=8); they come "
                 "last and override kvrelay's")
    parser.add_argument("--run-dir", type=Path, default=None, help="where node logs go")
    parser.add_argument("--router-port", type=int, default=8000,
                        help="port of the kvrelay router started in front of the cluster")
    parser.add_argument("--no-router", action="store_true", help="start the engines only")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `kvrelay route` (repeatable)")



def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    dtype = args.dtype or ("float32" if args.device == "cpu" else "auto")
    return ClusterConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        base_port=args.base_port,
        side_channel_base_port=args.side_channel_base_port,
        device=args.device,
        dtype=dtype,
        max_model_len=args.max_model_len,
        kv_cache_space_gib=args.kv_cache_space_gib,
        decoder_kv_blocks_ttl_s=args.ttl_s,
        kv_recompute_threshold=args.kv_recompute_threshold,
        bidirectional=not args.no_bidirectional,
        prefill_prefix_caching=args.prefill_prefix_caching,
        decode_prefix_caching=not args.no_decode_prefix_caching,
        nixl_progress_delay_us=args.nixl_progress_delay_us,
        restore_affinity=not args.no_restore_affinity,
        pin_processes=not args.no_pin_processes,
        startup_timeout_s=args.startup_timeout_s,
        tool_call_parser=args.tool_call_parser,
        restart=RestartPolicy(max_attempts=args.max_restarts),
        engine_args=tuple(args.engine_arg),
        prefill_engine_args=tuple(args.prefill_engine_arg),
        decode_engine_args=tuple(args.decode_engine_arg),
    )


def _model_init(args: argparse.Namespace) -> int:
    from kvrelay.cluster.model import ensure_model

    print(ensure_model(args.size))
    return 0


def start_router(
    config: ClusterConfig, cluster: LocalCluster, port: int, extra: list[str]
) -> ServiceProcess:
    """Start ``kvrelay route`` in front of ``cluster`` and wait until it answers /health."""
    cmd = router_command(
        [n.url for n in cluster.prefill], [n.url for n in cluster.decode],
        host=config.host, port=port, ttl_s=config.decoder_kv_blocks_ttl_s,
        block_size=block_size_of(config), kv_recompute_threshold=config.kv_recompute_threshold,
        python=config.python, extra=extra,
    )
    url = f"http://{config.host}:{port}"
    return ServiceProcess("router", cmd, [f"{url}/health"], cluster.run_dir / "router.log",
                          url=url).start()


def start_monitoring(config: ClusterConfig, cluster: LocalCluster,
                     router: ServiceProcess | None, port: int) -> ServiceProcess:
    """Start Prometheus scraping the cluster, write the Grafana dashboard next to it, and say
    where both are. Raises ``ServiceStartError`` when Prometheus is not installed or does
    not start."""
    from kvrelay.deploy.grafana import dashboard_text
    from kvrelay.deploy.prometheus import (
        PROMETHEUS_PACKAGE,
        ScrapeTarget,
        find_prometheus,
        prometheus_service,
    )

    binary = find_prometheus()
    if binary is None:
        raise ServiceStartError(f"--monitoring needs the `prometheus` binary: install the "
                                f"Debian package {PROMETHEUS_PACKAGE} (`make setup` does)")
    targets = [ScrapeTarget(n.spec.role, n.url) for n in cluster.nodes]
    if router is not None and router.url:
        targets.append(ScrapeTarget("router", router.url))
    service = prometheus_service(binary, targets, cluster.run_dir / "monitoring", config.host,
                                 port).start()
    dashboard = cluster.run_dir / "monitoring" / "grafana-dashboard.json"
    dashboard.write_text(dashboard_text())
    print(f"{'prometheus':>10}  {service.url}  (scrapes the router, P and D every 5 s; "
          f"Grafana dashboard: {dashboard}, see docs/monitoring.md)", flush=True)
    return service


def _up(args: argparse.Namespace) -> int:
    config = cluster_config_from_args(args)
    cluster = LocalCluster(config, args.run_dir)
    print(f"starting {config.num_prefill} P + {config.num_decode} D on {config.model!r}; "
          f"logs in {cluster.run_dir}", flush=True)
    try:
        cluster.start()
    except ClusterStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    router: ServiceProcess | None = None
    prometheus: ServiceProcess | None = None
    stop = install_stop_signals()
    try:
        if not args.no_router:
            router = start_router(config, cluster, args.router_port, args.router_arg)
        for node in cluster.nodes:
            print(f"{node.spec.name:>10}  {node.url}  side channel {node.side_channel}  "
                  f"cores {','.join(map(str, node.spec.cores)) or '-'}", flush=True)
        if router is not None:
            print(f"{'router':>10}  {router.url}  (OpenAI API: {router.url}/v1)", flush=True)
        parser = cluster.config.tool_call_parser
        print("tool calls: " + (f"auto tool choice with the {parser} parser" if parser != "none"
                                else "off (no parser known for this model; --tool-call-parser)"),
              flush=True)
        units: list[Supervised] = [NodeUnit(cluster, node) for node in cluster.nodes]
        if router is not None:
            units.append(ServiceUnit(router))
        if args.monitoring:
            prometheus = start_monitoring(config, cluster, router, args.prometheus_port)
            units.append(ServiceUnit(prometheus))
        print(f"model {cluster.served_model_name}; Ctrl-C to stop", flush=True)
        supervisor = Supervisor(units, config.restart, config.startup_timeout_s,
                                say=lambda line: print(line, flush=True))
        while not stop.wait(1.0):
            supervisor.poll()
        return 0
    except (ClusterStartError, GaveUp) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping cluster", flush=True)
        started = time.monotonic()
        if prometheus is not None:
            prometheus.stop()
        if router is not None:
            router.stop()
        cluster.stop()
        print(f"stopped in {time.monotonic() - started:.1f} s", flush=True)


def install_stop_signals() -> threading.Event:
    """SIGINT and SIGTERM set the returned event instead of killing the process mid-cleanup."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop
