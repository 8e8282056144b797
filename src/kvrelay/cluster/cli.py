"""``kvrelay model init`` and ``kvrelay up``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from kvrelay.cluster.arguments import add_cluster_arguments, cluster_config_from_args
from kvrelay.cluster.config import ClusterConfig, router_metrics_url
from kvrelay.cluster.launcher import (
    ClusterStartError,
    LocalCluster,
    ServiceProcess,
    ServiceStartError,
    check_router,
    start_router,
)
from kvrelay.cluster.supervisor import GaveUp, NodeUnit, ServiceUnit, Supervised, Supervisor

if TYPE_CHECKING:
    from kvrelay.deploy.prometheus import ScrapeTarget


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


def _model_init(args: argparse.Namespace) -> int:
    from kvrelay.models import ensure_model

    print(ensure_model(args.size))
    return 0


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
    if router is not None:
        targets += router_scrape_targets(router)
    service = prometheus_service(binary, targets, cluster.run_dir / "monitoring", config.host,
                                 port).start()
    dashboard = cluster.run_dir / "monitoring" / "grafana-dashboard.json"
    dashboard.write_text(dashboard_text())
    print(f"{'prometheus':>10}  {service.url}  (scrapes the router, P and D every 5 s; "
          f"Grafana dashboard: {dashboard}, see docs/monitoring.md)", flush=True)
    return service


def router_scrape_targets(router: ServiceProcess) -> list[ScrapeTarget]:
    """What Prometheus scrapes of a router ``start_router`` started: its internal listener,
    whose ``/metrics`` is complete and needs no key (the public one leaves out the
    request-size series, or needs ``--metrics-key``: docs/security.md); its public URL only
    when the internal port is the OS's pick."""
    from kvrelay.deploy.prometheus import ScrapeTarget

    url = router_metrics_url(router.command) or router.url
    return [ScrapeTarget("router", url)] if url else []


def _up(args: argparse.Namespace) -> int:
    config = cluster_config_from_args(args)
    if not args.no_router:
        try:
            check_router(config, args.router_port, args.router_arg)
        except ClusterStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
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
