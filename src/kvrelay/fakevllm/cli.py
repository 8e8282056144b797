"""``kvrelay fake-engine``: N fake prefill and M fake decode vLLM engines in one process.

    kvrelay fake-engine --prefill 2 --decode 2 --base-port 8200 --latency-preset cpu

P ``i`` listens on ``base_port + i``, D ``j`` on ``base_port + prefill + j``; NIXL side
channels (in-process, nothing listens there) are ``side_channel_base_port + k`` in the same
order. Runs until Ctrl-C (or SIGTERM). docs/testing.md describes the knobs and the
``/fake/faults`` admin endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import replace
from typing import Any, TextIO

from kvrelay.core.report import DEFAULT_REPORT_HOSTS
from kvrelay.fakevllm.cluster import FakeCluster
from kvrelay.fakevllm.config import FakeEngineConfig
from kvrelay.fakevllm.latency import latency_preset
from kvrelay.fakevllm.versions import VLLM_VERSIONS

DEFAULT_BASE_PORT = 8200
DEFAULT_SIDE_CHANNEL_BASE_PORT = 5600


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "fake-engine",
        help="run fake vLLM P/D engines (NixlConnector, bidirectional) in-process; Ctrl-C stops",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fake_engine_arguments(parser)
    parser.set_defaults(func=_run)


def add_fake_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="number of fake P engines")
    parser.add_argument("--decode", type=int, default=1, help="number of fake D engines")
    parser.add_argument("--decode-data-parallel", type=int, default=1, metavar="N",
                        help="ranks each D runs behind its URL, like vLLM's "
                             "--data-parallel-size (engine ids <id>_dp<rank>)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                        help="HTTP port of the first engine (0: any free ports)")
    parser.add_argument("--side-channel-base-port", type=int,
                        default=DEFAULT_SIDE_CHANNEL_BASE_PORT)
    parser.add_argument("--latency-preset", choices=["fast", "cpu"], default="fast",
                        help="fast: no simulated latency; cpu: roughly the real CPU cluster")
    parser.add_argument("--ttl-s", type=float, default=480.0,
                        help="decoder_kv_blocks_ttl: how long D keeps a finished turn's KV")
    parser.add_argument("--lease-s", type=float, default=30.0,
                        help="kv_lease_duration: how long P holds blocks for D to read")
    parser.add_argument("--threshold", type=int, default=64,
                        help="kv_recompute_threshold: fewer remote tokens are recomputed")
    parser.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"],
                        default="recompute")
    parser.add_argument("--no-bidirectional", action="store_true",
                        help="one-way P->D only: D retains nothing")
    parser.add_argument("--prefill-prefix-caching", action="store_true",
                        help="enable prefix caching on P (off by default, like kvrelay up)")
    parser.add_argument("--no-decode-prefix-caching", action="store_true")
    parser.add_argument("--vllm-version", choices=VLLM_VERSIONS, default="0.32",
                        help="vLLM release whose wire protocol the engines speak (0.33: "
                             "kv_transfer_params on the final streamed chunk, "
                             "remote_registration_generation in every params)")
    parser.add_argument("--model", default=None,
                        help="local HF model dir for tokenizer + chat template (default: tiny)")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--num-gpu-blocks", type=int, default=16384,
                        help="KV cache size in blocks of 128 tokens (a request that does not "
                             "fit waits, as in vLLM)")
    parser.add_argument("--decode-num-gpu-blocks", type=int, default=None,
                        help="D engines' KV cache size in blocks, when it differs from P's "
                             "(default: --num-gpu-blocks)")
    parser.add_argument("--no-kvrelay-retention", action="store_true",
                        help="D keeps retained turns for the global TTL as stock vLLM does "
                             "(default: kvrelay's managed retention)")
    parser.add_argument("--retention-headroom", type=float, default=0.0,
                        help="fraction of D's KV cache kept free of retained turns")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    parser.add_argument("--report-delay-s", type=float, default=0.1,
                        help="delay of kvrelay's D-side report after a response completes")
    parser.add_argument("--records-limit", type=int, default=1000,
                        help="request records kept per engine (GET /fake/requests/ID)")
    parser.add_argument("--report-hosts", default=",".join(DEFAULT_REPORT_HOSTS),
                        help="comma-separated hosts a report may be posted to")


def cluster_from_args(args: argparse.Namespace) -> FakeCluster:
    """The (not yet started) ``FakeCluster`` that ``args`` describe."""
    config = FakeEngineConfig(
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        bidirectional_kv_xfer=not args.no_bidirectional,
        kv_recompute_threshold=args.threshold,
        decoder_kv_blocks_ttl=args.ttl_s,
        kv_lease_duration=args.lease_s,
        kv_load_failure_policy=args.kv_load_failure_policy,
        vllm_version=args.vllm_version,
        latency=latency_preset(args.latency_preset),
        seed=args.seed,
        report_delay_s=args.report_delay_s,
        records_limit=args.records_limit,
        report_hosts=tuple(h.strip() for h in args.report_hosts.split(",") if h.strip()),
        kvrelay_retention=not args.no_kvrelay_retention,
        retention_headroom=args.retention_headroom,
    )
    return FakeCluster(
        num_prefill=args.prefill,
        num_decode=args.decode,
        prefill_config=replace(config, enable_prefix_caching=args.prefill_prefix_caching),
        decode_config=replace(config, enable_prefix_caching=not args.no_decode_prefix_caching,
                              num_gpu_blocks=args.decode_num_gpu_blocks or args.num_gpu_blocks),
        model_dir=args.model,
        host=args.host,
        base_port=args.base_port or None,
        side_channel_base_port=args.side_channel_base_port,
        decode_data_parallel=args.decode_data_parallel,
    )


async def serve(args: argparse.Namespace, stop: asyncio.Event, out: TextIO = sys.stdout) -> int:
    """Start the engines, print where they are, run until ``stop`` is set, then stop them."""
    cluster = cluster_from_args(args)
    print(f"starting {args.prefill} fake P + {args.decode} fake D "
          f"(latency {args.latency_preset}, vLLM {args.vllm_version} protocol)",
          file=out, flush=True)
    await cluster.start()
    try:
        for engine in cluster.engines:
            info = engine.describe()
            print(f"{info['name']:>10}  {info['url']}  side channel "
                  f"{info['side_channel_host']}:{info['side_channel_port']}  "
                  f"engine {info['engine_id']}", file=out, flush=True)
        print(f"model {cluster.prefill_config.served_model_name}; Ctrl-C to stop",
              file=out, flush=True)
        await stop.wait()
    finally:
        await cluster.stop()
        print("stopped", file=out, flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        try:
            return await serve(args, stop)
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return int(uvloop.run(main()))
