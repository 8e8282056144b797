"""``kvrelay fake-engine`` as a child process, configured like a local vLLM cluster.

The fake engines (``kvrelay.fakevllm``) stand in for real vLLM P/D servers where only the
protocol and simulated latency matter: ``kvrelay bench --engines fake`` and ``bench replay
--trace``. ``FakeEngineOptions`` is the typed form of the options they are started with;
``fake_engine_command`` is the one place that turns it into the ``kvrelay fake-engine`` command
line, whose flags ``kvrelay.fakevllm.cli`` parses (``tests/unit/test_fake_engine_command.py``
round-trips every field through that parser).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvrelay.cluster.config import ClusterConfig, served_model_name
from kvrelay.cluster.launcher import ServiceProcess, resolve_model
from kvrelay.fakevllm.versions import VllmVersion

FakeLatency = Literal["fast", "cpu"]


@dataclass(frozen=True)
class FakeEngineOptions:
    """One ``kvrelay fake-engine`` process: ``num_prefill`` P and ``num_decode`` D engines on
    ``base_port + i`` (P first), NIXL side channels on ``side_channel_base_port + i``.

    ``vllm_version`` is the vLLM release whose wire protocol the engines speak.
    ``model_dir`` (tokenizer and chat template), ``num_gpu_blocks`` and ``report_delay_s``
    are left to the fake's defaults when ``None`` (``tiny``'s tokenizer, its KV cache size,
    the connector's ~100 ms report delay). ``kvrelay_retention``: D manages its retained
    turns as kvrelay's connector does (False: stock vLLM's global TTL);
    ``retention_headroom``: the share of D's cache kept free of retention (``None``: the
    fake's default, none). ``decode_num_gpu_blocks``: D's cache size when it differs from
    P's (``None``: ``num_gpu_blocks``), so a benchmark can put D under memory pressure alone.
    """

    num_prefill: int
    num_decode: int
    host: str
    base_port: int
    side_channel_base_port: int
    latency_preset: FakeLatency
    ttl_s: float
    lease_s: float
    threshold: int
    kv_load_failure_policy: Literal["recompute", "fail"]
    bidirectional: bool
    prefill_prefix_caching: bool
    decode_prefix_caching: bool
    served_model_name: str
    max_model_len: int
    vllm_version: VllmVersion = "0.32"
    model_dir: Path | None = None
    num_gpu_blocks: int | None = None
    report_delay_s: float | None = None
    kvrelay_retention: bool = True
    retention_headroom: float | None = None
    decode_num_gpu_blocks: int | None = None

    @property
    def urls(self) -> list[str]:
        """Every engine's base URL, P first."""
        return [f"http://{self.host}:{self.base_port + i}"
                for i in range(self.num_prefill + self.num_decode)]


def fake_engine_options(
    config: ClusterConfig,
    latency: FakeLatency,
    *,
    ttl_s: float | None = None,
    num_gpu_blocks: int | None = None,
    report_delay_s: float | None = None,
    vllm_version: VllmVersion = "0.32",
) -> FakeEngineOptions:
    """Fake engines shaped like ``config``'s cluster (nodes, ports, kv-transfer and
    prefix-caching settings, model); ``ttl_s`` (fractional seconds allowed) overrides the
    config's TTL."""
    return FakeEngineOptions(
        num_prefill=config.num_prefill,
        num_decode=config.num_decode,
        host=config.host,
        base_port=config.base_port,
        side_channel_base_port=config.side_channel_base_port,
        latency_preset=latency,
        ttl_s=float(config.decoder_kv_blocks_ttl_s if ttl_s is None else ttl_s),
        lease_s=float(config.kv_lease_duration_s),
        threshold=config.kv_recompute_threshold,
        kv_load_failure_policy=config.kv_load_failure_policy,
        bidirectional=config.bidirectional,
        prefill_prefix_caching=config.prefill_prefix_caching,
        decode_prefix_caching=config.decode_prefix_caching,
        served_model_name=served_model_name(config, Path(config.model)),
        max_model_len=config.max_model_len,
        vllm_version=vllm_version,
        # the fake's default tokenizer is tiny's
        model_dir=None if config.model == "tiny" else resolve_model(config.model),
        num_gpu_blocks=num_gpu_blocks,
        report_delay_s=report_delay_s,
    )


def fake_engine_command(options: FakeEngineOptions, python: str) -> list[str]:
    """The ``kvrelay fake-engine`` command line for ``options``."""
    cmd = [
        python, "-m", "kvrelay.cli", "fake-engine",
        "--prefill", str(options.num_prefill), "--decode", str(options.num_decode),
        "--host", options.host, "--base-port", str(options.base_port),
        "--side-channel-base-port", str(options.side_channel_base_port),
        "--latency-preset", options.latency_preset,
        "--ttl-s", repr(options.ttl_s),
        "--threshold", str(options.threshold),
        "--lease-s", repr(options.lease_s),
        "--kv-load-failure-policy", options.kv_load_failure_policy,
        "--max-model-len", str(options.max_model_len),
        "--served-model-name", options.served_model_name,
        "--vllm-version", options.vllm_version,
    ]
    if options.model_dir is not None:
        cmd += ["--model", str(options.model_dir)]
    if options.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks", str(options.num_gpu_blocks)]
    if options.decode_num_gpu_blocks is not None:
        cmd += ["--decode-num-gpu-blocks", str(options.decode_num_gpu_blocks)]
    if options.report_delay_s is not None:
        cmd += ["--report-delay-s", repr(options.report_delay_s)]
    if options.retention_headroom is not None:
        cmd += ["--retention-headroom", repr(options.retention_headroom)]
    if not options.kvrelay_retention:
        cmd.append("--no-kvrelay-retention")
    if not options.bidirectional:
        cmd.append("--no-bidirectional")
    if options.prefill_prefix_caching:
        cmd.append("--prefill-prefix-caching")
    if not options.decode_prefix_caching:
        cmd.append("--no-decode-prefix-caching")
    return cmd


def fake_engine_process(
    options: FakeEngineOptions, log_path: Path, python: str, ready_timeout_s: float = 120.0
) -> ServiceProcess:
    """The (not yet started) fake-engine process; ready once every engine answers
    ``/health``."""
    return ServiceProcess("fake engines", fake_engine_command(options, python),
                          [f"{url}/health" for url in options.urls], log_path, ready_timeout_s)
