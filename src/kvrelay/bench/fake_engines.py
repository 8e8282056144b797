"""A cluster of fake vLLM engines (``kvrelay fake-engine``) for benchmarks without vLLM.

``fake_engine_cluster(latency)`` is a ``runner.ClusterFactory``: for a ``ClusterConfig`` it
starts one ``kvrelay fake-engine`` subprocess with as many P and D engines, on the config's
ports, with the config's bidirectional / prefix-caching / TTL / threshold settings
(``cluster.fake_engines``), and returns once every engine answers ``/health``. With
``latency="cpu"`` the engines simulate the real CPU cluster's prefill, transfer and decode
times (``docs/testing.md``), so the modes compare like the real thing in shape, in seconds
instead of minutes; ``fast`` simulates nothing (tests). ``vllm_version`` is the vLLM
protocol the engines speak (``kvrelay fake-engine --vllm-version``: 0.32, or 0.33 with params
on the final chunk).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from kvrelay.bench.runner import ClusterFactory, ClusterHandle
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.fake_engines import FakeLatency, fake_engine_options, fake_engine_process
from kvrelay.cluster.launcher import ServiceProcess
from kvrelay.fakevllm.versions import VllmVersion


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
    vllm_version: VllmVersion = "0.32",
) -> ClusterFactory:
    """A cluster factory starting fake engines (see the module docstring)."""

    def start(config: ClusterConfig, run_dir: Path) -> ClusterHandle:
        options = fake_engine_options(config, latency, vllm_version=vllm_version)
        process = fake_engine_process(options, run_dir / "fake-engine.log", python,
                                      ready_timeout_s).start()
        urls = options.urls
        return FakeEngines(process, urls[: config.num_prefill], urls[config.num_prefill :],
                           options.served_model_name)

    return start
