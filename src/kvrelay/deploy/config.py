"""What a kvrelay deployment on Kubernetes is made of: pure, typed settings.

``DeployConfig`` comes from defaults, then a TOML file (keys are the field names), then
command-line flags (``kvrelay deploy k8s``); later layers win. ``from_settings`` rejects
unknown keys and wrong types with a message that names them, so a typo in a TOML file is an
error rather than a silently ignored setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

#: Kubernetes object names (DNS-1035 label): the StatefulSets' pod DNS names derive from them.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


class DeployConfigError(ValueError):
    """A setting is unknown, has the wrong type, or is out of range."""


@dataclass(frozen=True)
class DeployConfig:
    """A kvrelay deployment: P and D vLLM StatefulSets on GPUs, N router replicas sharing a
    Redis, Services, probes, PodDisruptionBudgets and a Prometheus ServiceMonitor.

    Sizes are Kubernetes quantities (``"8"``, ``"64Gi"``). ``redis_url`` set means an
    external Redis (nothing is deployed for it). ``pod_cidrs`` are the pod networks the
    router replicas' addresses come from: D's connector posts reports only there.
    """

    name: str = "kvrelay"
    namespace: str | None = None
    #: vLLM with kvrelay installed (P, D load
    #: ``kv_connector_module_path: kvrelay.vllm_plugin.connector``).
    image: str = "kvrelay-vllm:latest"
    #: The router needs only kvrelay; default: ``image``.
    router_image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    model: str = "Qwen/Qwen3-8B"
    served_model_name: str | None = None
    max_model_len: int | None = None
    prefill: int = 1
    decode: int = 1
    router_replicas: int = 2
    gpus_per_node: int = 1
    #: vLLM ``--data-parallel-size`` of each P / D pod: ranks behind its one URL, each with
    #: ``gpus_per_node`` GPUs (the router keeps each conversation on its rank).
    prefill_data_parallel: int = 1
    decode_data_parallel: int = 1
    gpu_resource: str = "nvidia.com/gpu"
    engine_cpu: str = "8"
    engine_memory: str = "64Gi"
    router_cpu: str = "2"
    router_memory: str = "2Gi"
    #: ``/dev/shm`` size of P and D (NCCL with tensor parallelism needs it large).
    shm_size: str = "16Gi"
    engine_port: int = 8000
    side_channel_port: int = 5600
    router_port: int = 8000
    #: The router's listener for D's reports; default ``router_port + 1``.
    internal_port: int | None = None
    ttl_s: int = 480
    kv_recompute_threshold: int = 64
    kv_lease_duration_s: int = 30
    #: vLLM's KV block size on the GPUs (16 is vLLM's CUDA default).
    block_size: int = 16
    prefill_prefix_caching: bool = False
    decode_prefix_caching: bool = True
    #: vLLM ``--tool-call-parser`` (``hermes`` for Qwen2.5/Qwen3); none: no auto tool choice.
    tool_call_parser: str | None = None
    redis_url: str | None = None
    redis_image: str = "redis:7.2-alpine"
    pod_cidrs: tuple[str, ...] = ("10.0.0.0/8",)
    #: Secret with key ``HF_TOKEN`` for gated models (optional).
    hf_token_secret: str | None = None
    engine_args: tuple[str, ...] = ()
    prefill_engine_args: tuple[str, ...] = ()
    decode_engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    #: Secret whose keys become the router's environment (``KVRELAY_TAG_KEY``,
    #: ``KVRELAY_API_KEYS``, ``KVRELAY_ADMIN_KEY``, ``KVRELAY_METRICS_KEY``, ...): keys never
    #: in the pod's args, where anyone who can read the pod spec (or ``ps``) sees them.
    router_secret: str | None = None
    service_monitor: bool = True
    #: Extra labels for the ServiceMonitor (``release=prometheus`` for kube-prometheus-stack).
    service_monitor_labels: tuple[str, ...] = ()
    drain_timeout_s: int = 30

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise DeployConfigError(
                f"name {self.name!r}: use lowercase letters, digits and '-', start with a "
                "letter, at most 40 characters")
        for key in ("prefill", "decode", "router_replicas", "gpus_per_node",
                    "prefill_data_parallel", "decode_data_parallel"):
            if getattr(self, key) < 1:
                raise DeployConfigError(f"{key} must be at least 1")
        for key in ("engine_port", "side_channel_port", "router_port"):
            _check_port(key, getattr(self, key))
        _check_port("internal_port", self.router_internal_port)
        if self.router_internal_port == self.router_port:
            raise DeployConfigError("internal_port must differ from router_port")
        ranks = max(self.prefill_data_parallel, self.decode_data_parallel)
        if self.side_channel_port <= self.engine_port < self.side_channel_port + ranks:
            raise DeployConfigError("side_channel_port must differ from engine_port (each "
                                    "data-parallel rank k listens on side_channel_port + k)")
        _check_port("side_channel_port + ranks", self.side_channel_port + ranks - 1)
        for label in self.service_monitor_labels:
            if "=" not in label:
                raise DeployConfigError(f"service_monitor_labels: {label!r} is not KEY=VALUE")
        if self.ttl_s <= 0 or self.block_size <= 0 or self.kv_recompute_threshold < 0:
            raise DeployConfigError("ttl_s and block_size must be positive, "
                                    "kv_recompute_threshold not negative")
        for cidr in self.pod_cidrs:  # D's connector would fail on it, or refuse every report
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise DeployConfigError(f"pod_cidrs: {cidr!r} is not a network like "
                                        "10.244.0.0/16 (one per --pod-cidr)") from None
        for key in ("engine_args", "prefill_engine_args", "decode_engine_args"):
            for arg in getattr(self, key):
                flag = arg.split("=", 1)[0]
                owned = engine_flag_owned(flag)
                if owned is not None:
                    raise DeployConfigError(f"{key}: {flag} is set by the manifest ({owned}); "
                                            f"use {ENGINE_FLAGS_OWNED[owned]}")
        route = check_router_args(self.router_args)
        if route.response_store == "memory" and self.router_replicas > 1:
            raise DeployConfigError(
                "router_args: --response-store memory keeps each replica's own store, so a "
                "previous_response_id another replica answered is not found; use redis")


    @property
    def router_internal_port(self) -> int:
        return self.internal_port if self.internal_port is not None else self.router_port + 1

    @property
    def router_image_or_default(self) -> str:
        return self.router_image or self.image

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

ROUTER_FLAGS_OWNED = {
    "--host": "--router-port", "--port": "--router-port", "--internal-host": "--internal-port",
    "--internal-port": "--internal-port", "--internal-url": "--internal-port",
    "--state": "--redis-url", "--deployment": "--name", "--ttl-s": "--ttl-s",
    "--block-size": "--block-size", "--kv-recompute-threshold": "--kv-recompute-threshold",
    "--drain-timeout-s": "--drain-timeout-s", "--prefill": "--prefill",
    "--decode": "--decode",
}
"""``kvrelay route`` flags the manifest sets from its own settings (and the setting to use):
given again in ``router_args`` they would part from the ports, probes, Services and grace
period the manifest derives from the setting (the router's last value wins)."""

ENGINE_FLAGS_OWNED = {
    "--host": "the manifest's (0.0.0.0)", "--port": "--engine-port",
    "--served-model-name": "--served-model-name", "--block-size": "--block-size",
    "--kv-transfer-config": "--ttl-s, --kv-recompute-threshold, --pod-cidr",
    "--tensor-parallel-size": "--gpus-per-node",
    "--data-parallel-size": "--prefill-data-parallel, --decode-data-parallel",
}
"""``vllm serve`` flags the manifest sets: given again in engine args (the last value wins)
they would part the engines from the probes, Services and router URLs built from the
setting (``--port``), or drop kvrelay's connector (``--kv-transfer-config``: probe 14, K10)."""

ENGINE_FLAG_ALIASES = {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size"}
"""vLLM's short forms of the flags above."""


def engine_flag_owned(flag: str) -> str | None:
    """The manifest's flag that ``flag`` sets in ``vllm serve``, if any: vLLM's parser takes
    ``_`` for ``-``, its short forms and unambiguous abbreviations (``--kv-transfer-c``),
    so each is that flag too (probe 15, L4: ``-tp=2``, ``--block_size=32`` rendered)."""
    name = ENGINE_FLAG_ALIASES.get(flag, flag)
    if not name.startswith("--"):
        return None
    name = "--" + name[2:].replace("_", "-")
    if name in ENGINE_FLAGS_OWNED:
        return name
    prefixed = [owned for owned in ENGINE_FLAGS_OWNED if owned.startswith(name)]
    return prefixed[0] if len(name) > 3 and prefixed else None


ROUTER_FLAGS_SECRET = ("--api-key", "--admin-key", "--tag-key", "--metrics-key")
"""Keys: in the router Secret (``router_secret``), never in the pod's args."""


class _RouteArgs(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise DeployConfigError(f"router_args: {message}")


def check_router_args(args: tuple[str, ...]) -> argparse.Namespace:
    """``args`` parsed as ``kvrelay route`` arguments (with its own parser);
    ``DeployConfigError`` unless they are, and the manifest does not set them itself, and
    they carry no key."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in ROUTER_FLAGS_OWNED:
            raise DeployConfigError(
                f"router_args: {flag} is set by the manifest; use {ROUTER_FLAGS_OWNED[flag]}")
        if flag == "--check-config":
            raise DeployConfigError("router_args: --check-config would make every replica "
                                    "exit after checking its config")
        if flag in ROUTER_FLAGS_SECRET:
            raise DeployConfigError(
                f"router_args: {flag} would put a key in the pod's args; put "
                f"KVRELAY_{flag[2:].upper().replace('-', '_')}"
                f"{'S' if flag == '--api-key' else ''} in the router Secret (router_secret)")
    return route_parser().parse_args(list(args))


def route_parser() -> argparse.ArgumentParser:
    """``kvrelay route``'s arguments, its errors a ``DeployConfigError``, no abbreviations
    (``--po=9000`` or ``--api-k=...`` would pass ``check_router_args``' checks, and the
    router, which takes them, would listen elsewhere or show a key in its args)."""
    from kvrelay.router.cli import add_route_arguments

    parser = _RouteArgs(prog="kvrelay route", add_help=False, allow_abbrev=False)
    add_route_arguments(parser)
    return parser



def _check_port(key: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise DeployConfigError(f"{key} {port} is not a TCP port")


def from_settings(*layers: Mapping[str, object]) -> DeployConfig:
    """A ``DeployConfig`` from layers of settings (later layers win); keys are field names."""
    hints = {f.name: str(f.type) for f in dataclasses.fields(DeployConfig)}
    merged: dict[str, object] = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in hints:
                known = ", ".join(sorted(hints))
                raise DeployConfigError(f"unknown setting {key!r}; known: {known}")
            merged[key] = _coerce(key, value, hints[key])
    return DeployConfig(**merged)  # type: ignore[arg-type]


def load_toml(path: Path) -> dict[str, object]:
    """The settings of a TOML file (a ``[k8s]`` table, or the top level)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DeployConfigError(f"cannot read {path}: {exc}") from exc
    table = data.get("k8s", data)
    if not isinstance(table, dict):
        raise DeployConfigError(f"{path}: [k8s] must be a table")
    return dict(table)


def _coerce(key: str, value: object, hint: str) -> object:
    """Check ``value`` against the field's annotation, a string (``int | None``, ...): the
    module uses postponed annotations."""
    optional = "None" in hint
    if value is None:
        if optional:
            return None
        raise DeployConfigError(f"{key} must not be empty")
    if hint.startswith("tuple"):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise DeployConfigError(f"{key} must be a list of strings")
        if not all(isinstance(v, str) for v in value):
            raise DeployConfigError(f"{key} must be a list of strings")
        return tuple(value)
    if hint.startswith("bool"):
        if not isinstance(value, bool):
            raise DeployConfigError(f"{key} must be true or false")
        return value
    if hint.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DeployConfigError(f"{key} must be an integer")
        return value
    if not isinstance(value, str):
        raise DeployConfigError(f"{key} must be a string")
    return value

