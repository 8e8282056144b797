"""The ``kvrelay fake-engine`` command line the launcher builds (``cluster.fake_engines``) is
what ``kvrelay.fakevllm.cli`` parses: every option arrives in the fake cluster it describes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvrelay.bench.modes import cluster_config_for, parse_modes
from kvrelay.cli import build_parser
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.fake_engines import (
    FakeEngineOptions,
    fake_engine_command,
    fake_engine_options,
)
from kvrelay.fakevllm.cli import cluster_from_args
from kvrelay.fakevllm.latency import latency_preset

#: Not one field at the fake's defaults, so a flag the parser dropped or misread shows.
OPTIONS = FakeEngineOptions(
    num_prefill=2, num_decode=3, host="127.0.0.2", base_port=9100,
    side_channel_base_port=6100, latency_preset="cpu", ttl_s=12.5, lease_s=7.25, threshold=33,
    kv_load_failure_policy="fail", bidirectional=False, prefill_prefix_caching=True,
    decode_prefix_caching=False, served_model_name="m", max_model_len=4096, vllm_version="0.33",
    model_dir=Path("/models/m"), num_gpu_blocks=77, report_delay_s=0.0,
    kvrelay_retention=False, retention_headroom=0.125, decode_num_gpu_blocks=21,
)


def parsed_cluster(options: FakeEngineOptions) -> Any:
    cmd = fake_engine_command(options, "py")
    assert cmd[:4] == ["py", "-m", "kvrelay.cli", "fake-engine"]
    return cluster_from_args(build_parser().parse_args(cmd[3:]))


def test_every_option_reaches_the_fake_cluster() -> None:
    cluster = parsed_cluster(OPTIONS)
    assert (cluster.num_prefill, cluster.num_decode) == (2, 3)
    assert (cluster.host, cluster.base_port, cluster.side_channel_base_port) == (
        "127.0.0.2", 9100, 6100)
    assert cluster.model_dir == "/models/m"
    p, d = cluster.prefill_config, cluster.decode_config
    assert (p.num_gpu_blocks, d.num_gpu_blocks) == (77, 21)
    assert (p.enable_prefix_caching, d.enable_prefix_caching) == (True, False)
    for config in (p, d):
        assert config.latency == latency_preset("cpu")
        assert (config.decoder_kv_blocks_ttl, config.kv_lease_duration) == (12.5, 7.25)
        assert config.kv_recompute_threshold == 33
        assert config.kv_load_failure_policy == "fail"
        assert config.bidirectional_kv_xfer is False
        assert (config.served_model_name, config.max_model_len) == ("m", 4096)
        assert config.report_delay_s == 0.0
        assert config.vllm_version == "0.33"
        assert (config.kvrelay_retention, config.retention_headroom) == (False, 0.125)


def test_options_left_to_the_fake_keep_its_defaults() -> None:
    defaults = parsed_cluster(dataclasses.replace(
        OPTIONS, model_dir=None, num_gpu_blocks=None, report_delay_s=None,
        kvrelay_retention=True, retention_headroom=None, decode_num_gpu_blocks=None))
    reference = cluster_from_args(build_parser().parse_args(["fake-engine"]))
    assert defaults.model_dir is None
    default_version = fake_engine_options(ClusterConfig(), "fast").vllm_version
    assert default_version == reference.decode_config.vllm_version
    assert defaults.decode_config.num_gpu_blocks == reference.decode_config.num_gpu_blocks
    assert defaults.decode_config.report_delay_s == reference.decode_config.report_delay_s
    assert defaults.decode_config.retention_headroom == reference.decode_config.retention_headroom
    assert defaults.decode_config.kvrelay_retention is reference.decode_config.kvrelay_retention
    assert reference.decode_config.managed_retention


def test_options_follow_the_cluster_config_and_the_mode() -> None:
    pull, local = parse_modes("pull,local")
    base = ClusterConfig(num_prefill=2, num_decode=3, base_port=9100, decoder_kv_blocks_ttl_s=60)
    options = fake_engine_options(cluster_config_for(pull, base), "fast", num_gpu_blocks=64)
    assert (options.num_prefill, options.num_decode, options.base_port) == (2, 3, 9100)
    assert options.ttl_s == 60.0 and options.served_model_name == "tiny"
    assert options.bidirectional and not options.prefill_prefix_caching
    assert options.model_dir is None and options.num_gpu_blocks == 64
    assert options.urls[0] == "http://127.0.0.1:9100" and len(options.urls) == 5
    local_options = fake_engine_options(cluster_config_for(local, base), "cpu", ttl_s=0.5)
    assert not local_options.bidirectional and local_options.prefill_prefix_caching
    assert local_options.num_prefill == 1 and local_options.ttl_s == 0.5
