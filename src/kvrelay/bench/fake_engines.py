"""A cluster of fake vLLM engines (``kvrelay fake-engine``) for benchmarks without vLLM.

``fake_engine_cluster(latency)`` is a ``runner.ClusterFactory``: for a ``ClusterConfig`` it
starts one ``kvrelay fake-engine`` subprocess with as many P and D engines, on the config's
ports, with the config's bidirectional / prefix-caching / TTL / threshold settings, and
returns once every engine answers ``/health``. With ``latency="cpu"`` the engines simulate
the real CPU cluster's prefill, transfer and decode times (``docs/testing.md``), so the
modes compare like the real thing in shape, in seconds instead of minutes; ``fast``
simulates nothing (tests). ``vllm_version`` is the vLLM protocol the engines speak
(``kvrelay fake-engine --vllm-version``: 0.32, or 0.33 with params on the final chunk).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvrelay.bench.runner import ClusterFactory, ClusterHandle
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.launcher import ServiceProcess
from kvrelay.cluster.model import MODEL_SPECS

FakeLatency = Literal["fast", "cpu"]


def fake_engine_command(
    config: ClusterConfig,
    latency: FakeLatency,
    python: str,
    *,
    ttl_s: float | None = None,
    vllm_version: str = "0.32",
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``kvrelay fake-engine`` command line for ``config``; ``ttl_s`` (fractional
    seconds allowed) overrides the config's TTL, ``extra`` is appended."""
    cmd = [
        python, "-m", "kvrelay.cli", "fake-engine",
        "--prefill", str(config.num_prefill), "--decode", str(config.num_decode),
        "--host", config.host, "--base-port", str(config.base_port),
        "--side-channel-base-port", str(config.side_channel_base_port),
        "--latency-preset", latency,
        "--ttl-s", str(config.decoder_kv_blocks_ttl_s if ttl_s is None else ttl_s),
        "--threshold", str(config.kv_recompute_threshold),
        "--lease-s", str(config.kv_lease_duration_s),
        "--kv-load-failure-policy", config.kv_load_failure_policy,
        "--max-model-len", str(config.max_model_len),
        "--served-model-name", served_name(config),
        "--vllm-version", vllm_version,
    ]
    if config.model != "tiny":  # the fake's default tokenizer is tiny's
        from kvrelay.cluster.launcher import resolve_model

        cmd += ["--model", str(resolve_model(config.model))]
    if not config.bidirectional:
        cmd.append("--no-bidirectional")
    if config.prefill_prefix_caching:
        cmd.append("--prefill-prefix-caching")
    if not config.decode_prefix_caching:
        cmd.append("--no-decode-prefix-caching")
    return cmd + list(extra)


def served_name(config: ClusterConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    return config.model if config.model in MODEL_SPECS else Path(config.model).name


@dataclass
class FakeEngines:
    """A started ``kvrelay fake-engine`` process and its engines' URLs."""

    process: ServiceProcess
    prefill_urls: list[str]
    decode_urls: list[str]
    served_model_name: str

    def stop(self) -> None:
        self.process.stop()


def fake_engine_cluster(
    latency: FakeLatency = "cpu", python: str = sys.executable, ready_timeout_s: float = 120.0,
    vllm_version: str = "0.32",
) -> ClusterFactory:
    """A cluster factory starting fake engines (see the module docstring)."""

    def start(config: ClusterConfig, run_dir: Path) -> ClusterHandle:
        base = f"http://{config.host}:"
        urls = [f"{base}{config.base_port + i}"
                for i in range(config.num_prefill + config.num_decode)]
        process = ServiceProcess(
            "fake engines", fake_engine_command(config, latency, python,
                                                vllm_version=vllm_version),
            [f"{u}/health" for u in urls], run_dir / "fake-engine.log", ready_timeout_s,
        ).start()
        return FakeEngines(process, urls[: config.num_prefill], urls[config.num_prefill :],
                           served_name(config))

    return start
