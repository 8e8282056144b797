"""``kvrelay deploy k8s``: render Kubernetes manifests from flags and/or a TOML file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvrelay.deploy.config import DeployConfig, DeployConfigError, from_settings, load_toml

#: Flags whose value is repeated into a list setting.
_LIST_FLAGS = ("engine_arg", "prefill_engine_arg", "decode_engine_arg", "router_arg",
               "pod_cidr", "service_monitor_label")
_LIST_SETTING = {"engine_arg": "engine_args", "prefill_engine_arg": "prefill_engine_args",
                 "decode_engine_arg": "decode_engine_args", "router_arg": "router_args",
                 "pod_cidr": "pod_cidrs", "service_monitor_label": "service_monitor_labels"}


def register(sub: Any) -> None:
    deploy = sub.add_parser("deploy", help="render deployment manifests")
    deploy_sub = deploy.add_subparsers(dest="deploy_target", metavar="TARGET", required=True)
    k8s = deploy_sub.add_parser(
        "k8s", help="Kubernetes: P/D StatefulSets on GPUs, router replicas, Redis, monitoring",
        description="Print Kubernetes manifests (YAML) for a kvrelay deployment; "
                    "docs/deploy.md explains them. Settings: defaults, then --config FILE "
                    "(TOML, keys as below with '_'), then flags.")
    add_k8s_arguments(k8s)
    k8s.set_defaults(func=_k8s)

    dash = deploy_sub.add_parser(
        "dashboard", help="the Grafana dashboard (JSON, provisionable; docs/monitoring.md)")
    dash.add_argument("-o", "--output", type=Path, default=None, metavar="FILE")
    dash.set_defaults(func=_dashboard)

    prom = deploy_sub.add_parser(
        "prometheus-config", help="prometheus.yml scraping a router and its P and D nodes")
    prom.add_argument("--router", action="append", default=[], metavar="URL",
                      help="a router's internal listener (http://HOST:INTERNAL_PORT, by "
                           "default the router's --port + 1: complete /metrics, no key), or "
                           "its public URL with --router-metrics-key-file; an unauthenticated "
                           "public /metrics leaves out the request-size series")
    prom.add_argument("--router-metrics-key-file", type=Path, default=None, metavar="FILE",
                      help="a file holding the router's --metrics-key (or admin key): "
                           "Prometheus sends it as a bearer token to the --router URLs. An "
                           "absolute path is Prometheus's (written as given); a relative one "
                           "must exist here (written resolved)")
    prom.add_argument("--prefill", action="append", default=[], metavar="URL")
    prom.add_argument("--decode", action="append", default=[], metavar="URL")
    prom.add_argument("--interval-s", type=float, default=5.0)
    prom.add_argument("-o", "--output", type=Path, default=None, metavar="FILE")
    prom.set_defaults(func=_prometheus_config)

    png = deploy_sub.add_parser(
        "dashboard-png", help="draw the dashboard's panels from a Prometheus into a PNG")
    png.add_argument("--prometheus", default="http://127.0.0.1:9090", metavar="URL")
    png.add_argument("--minutes", type=float, default=30.0, help="the last N minutes")
    png.add_argument("--rate-window", default="1m", help="what $__rate_interval becomes")
    png.add_argument("--title", default="kvrelay")
    png.add_argument("-o", "--output", type=Path, required=True, metavar="FILE")
    png.set_defaults(func=_dashboard_png)


def add_k8s_arguments(parser: argparse.ArgumentParser) -> None:
    d = DeployConfig()
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="TOML settings (top level or a [k8s] table)")
    parser.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                        help="write the YAML here instead of stdout")
    s = parser.add_argument_group("settings (default shown)")

    def opt(flag: str, kind: type, help_text: str) -> None:
        key = flag.lstrip("-").replace("-", "_")
        s.add_argument(flag, type=kind, default=None, dest=key,
                       help=f"{help_text} [{getattr(d, key)}]")

    opt("--name", str, "prefix of every object's name")
    opt("--namespace", str, "namespace of every object (none: kubectl's current)")
    opt("--image", str, "image with vLLM and kvrelay installed (P, D)")
    opt("--router-image", str, "router image (none: --image)")
    opt("--image-pull-policy", str, "imagePullPolicy")
    opt("--model", str, "model to serve (Hugging Face id or a path in the image)")
    opt("--served-model-name", str, "model name clients use (none: --model)")
    opt("--max-model-len", int, "vLLM --max-model-len")
    opt("--prefill", int, "P pods")
    opt("--decode", int, "D pods")
    opt("--router-replicas", int, "router replicas")
    opt("--gpus-per-node", int, "GPUs per P/D pod, or per rank (tensor parallel size)")
    opt("--prefill-data-parallel", int, "ranks per P pod (vLLM --data-parallel-size)")
    opt("--decode-data-parallel", int, "ranks per D pod (vLLM --data-parallel-size)")
    opt("--gpu-resource", str, "extended resource name of a GPU")
    opt("--engine-cpu", str, "CPU request of P/D pods")
    opt("--engine-memory", str, "memory request and limit of P/D pods")
    opt("--router-cpu", str, "CPU request of a router pod")
    opt("--router-memory", str, "memory request and limit of a router pod")
    opt("--shm-size", str, "/dev/shm of P/D pods")
    opt("--engine-port", int, "vLLM HTTP port")
    opt("--side-channel-port", int, "NIXL side-channel port")
    opt("--router-port", int, "router HTTP port (OpenAI API, /health, /metrics)")
    opt("--internal-port", int, "router's listener for D's reports (none: router port + 1)")
    opt("--ttl-s", int, "decoder_kv_blocks_ttl: how long D keeps a finished turn's KV")
    opt("--kv-recompute-threshold", int, "smaller reuses are recomputed")
    opt("--kv-lease-duration-s", int, "kv_lease_duration of P's blocks")
    opt("--block-size", int, "vLLM KV block size")
    opt("--tool-call-parser", str, "vLLM tool-call parser (e.g. hermes for Qwen3)")
    opt("--redis-url", str, "external Redis (none: deploy one)")
    opt("--redis-image", str, "image of the deployed Redis")
    opt("--hf-token-secret", str, "Secret holding HF_TOKEN for gated models")
    opt("--drain-timeout-s", int, "router drain on SIGTERM")
    opt("--router-secret", str, "Secret whose keys are the router's environment: "
        "KVRELAY_TAG_KEY (same for every replica), KVRELAY_API_KEYS, KVRELAY_ADMIN_KEY, ...")
    for flag, help_text in (
        ("--engine-arg", "one extra vLLM argument for P and D (repeatable)"),
        ("--prefill-engine-arg", "one extra vLLM argument for P (repeatable)"),
        ("--decode-engine-arg", "one extra vLLM argument for D (repeatable)"),
        ("--router-arg", "one extra `kvrelay route` argument (repeatable)"),
        ("--pod-cidr", "pod network the router replicas' IPs are in; D reports only there "
                       "(repeatable)"),
        ("--service-monitor-label", "KEY=VALUE label of the ServiceMonitor (repeatable)"),
    ):
        key = flag.lstrip("-").replace("-", "_")
        s.add_argument(flag, action="append", default=None, dest=key, metavar="VALUE",
                       help=f"{help_text} [{list(getattr(d, _LIST_SETTING[key]))}]")
    for flag, key, help_text in (
        ("--prefill-prefix-caching", "prefill_prefix_caching", "prefix caching on P"),
        ("--decode-prefix-caching", "decode_prefix_caching", "prefix caching on D"),
        ("--service-monitor", "service_monitor", "render the ServiceMonitor"),
    ):
        s.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, dest=key,
                       help=f"{help_text} [{getattr(d, key)}]")


def config_from_args(args: argparse.Namespace) -> DeployConfig:
    """Defaults, then ``--config``, then the flags that were given."""
    file_layer = load_toml(args.config) if args.config else {}
    flags: dict[str, object] = {}
    for key, value in vars(args).items():
        if value is None or key in ("config", "output", "func", "command", "deploy_target"):
            continue
        flags[_LIST_SETTING.get(key, key)] = value
    return from_settings(file_layer, flags)


def _k8s(args: argparse.Namespace) -> int:
    from kvrelay.deploy.k8s import render, to_yaml

    try:
        config = config_from_args(args)
        docs = render(config)
    except DeployConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if config.router_secret is None:
        print("note: no --router-secret: the router serves without API keys, and its "
              f"{config.router_replicas} replica(s) tag conversations each with a key of its "
              "own (turn logs, /stats); docs/deploy.md, \"Keys\"", file=sys.stderr)
    _write(to_yaml(docs), args.output)
    return 0


def _write(text: str, output: Path | None) -> None:
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _dashboard(args: argparse.Namespace) -> int:
    from kvrelay.deploy.grafana import dashboard_text

    _write(dashboard_text(), args.output)
    return 0


def _prometheus_config(args: argparse.Namespace) -> int:
    from kvrelay.deploy.prometheus import ScrapeTarget, scrape_config

    targets = [ScrapeTarget(component, url)
               for component, urls in (("router", args.router), ("prefill", args.prefill),
                                       ("decode", args.decode))
               for url in urls]
    if not targets:
        print("error: give at least one --router, --prefill or --decode URL", file=sys.stderr)
        return 2
    key_file = args.router_metrics_key_file
    if key_file is not None and not key_file.is_absolute():
        # a file here (Prometheus would read a relative path from the config's folder)
        if not key_file.is_file():
            print(f"error: --router-metrics-key-file {key_file}: no such file here (an "
                  "absolute path is written as given, for Prometheus's host)", file=sys.stderr)
            return 2
        key_file = key_file.resolve()
    # an absolute path is read on Prometheus's host, at every scrape: as given (the
    # documented /etc/prometheus/... failed on any machine without it: probe 14, K11)
    _write(scrape_config(targets, args.interval_s, key_file), args.output)
    return 0


def _dashboard_png(args: argparse.Namespace) -> int:
    import time

    from kvrelay.deploy.dashboard_png import render_png
    from kvrelay.deploy.prometheus import PrometheusClient, PrometheusError

    end_s = time.time()
    start_s = end_s - args.minutes * 60
    step_s = max(1.0, args.minutes * 60 / 300)
    try:
        render_png(PrometheusClient(args.prometheus), args.output, start_s, end_s, step_s,
                   args.rate_window, args.title)
    except PrometheusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
