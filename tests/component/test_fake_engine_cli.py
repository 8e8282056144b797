"""``kvrelay fake-engine``: the arguments build the cluster they describe, and ``serve``
prints every engine's URL and side channel and stops cleanly."""

from __future__ import annotations

import asyncio
import io

import httpx
import pytest

from kvrelay.cli import build_parser
from kvrelay.fakevllm.cli import cluster_from_args, serve
from tests.component.fake_engine_helpers import until


def test_arguments_map_to_engine_configs() -> None:
    args = build_parser().parse_args([
        "fake-engine", "--prefill", "2", "--decode", "3", "--base-port", "0",
        "--latency-preset", "cpu", "--ttl-s", "60", "--threshold", "128",
        "--prefill-prefix-caching", "--kv-load-failure-policy", "fail", "--vllm-version", "0.33",
        "--decode-data-parallel", "4"])
    assert callable(args.func)
    cluster = cluster_from_args(args)
    assert (cluster.num_prefill, cluster.num_decode, cluster.base_port) == (2, 3, None)
    assert cluster.decode_data_parallel == 4
    p, d = cluster.prefill_config, cluster.decode_config
    assert p.enable_prefix_caching and d.enable_prefix_caching
    assert p.decoder_kv_blocks_ttl == d.decoder_kv_blocks_ttl == 60
    assert p.kv_recompute_threshold == 128 and p.kv_load_failure_policy == "fail"
    assert p.latency.decode_s_per_token > 0
    assert p.vllm_version == d.vllm_version == "0.33" and p.protocol.stream_kv_params


def test_vllm_version_defaults_to_032_and_refuses_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["fake-engine"])
    assert cluster_from_args(args).decode_config.vllm_version == "0.32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fake-engine", "--vllm-version", "0.34"])
    assert "invalid choice: '0.34'" in capsys.readouterr().err


async def test_serve_prints_urls_and_side_channels_until_stopped() -> None:
    args = build_parser().parse_args([
        "fake-engine", "--prefill", "1", "--decode", "2", "--base-port", "0",
        "--side-channel-base-port", "7600"])
    out, stop = io.StringIO(), asyncio.Event()
    task = asyncio.create_task(serve(args, stop, out))
    await until(lambda: "Ctrl-C" in out.getvalue() or task.done(), "engines started")
    lines = out.getvalue().splitlines()
    engines = [line.split() for line in lines if "side channel" in line]
    assert [e[0] for e in engines] == ["prefill-0", "decode-0", "decode-1"]
    assert [e[4] for e in engines] == ["127.0.0.1:7600", "127.0.0.1:7601", "127.0.0.1:7602"]
    async with httpx.AsyncClient(trust_env=False) as http:
        for e in engines:
            assert (await http.get(e[1] + "/health")).status_code == 200
    stop.set()
    assert await task == 0
    assert out.getvalue().splitlines()[-1] == "stopped"
