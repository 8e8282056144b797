"""The command-line form of a ``ClusterConfig``: the flags of ``kvrelay up``, which
``kvrelay bench`` takes too for the clusters it starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrelay.cluster.config import DEFAULT_NIXL_PROGRESS_DELAY_US, ClusterConfig, RestartPolicy


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    d = ClusterConfig()
    parser.add_argument("--prefill", type=int, default=d.num_prefill, help="number of P nodes")
    parser.add_argument("--decode", type=int, default=d.num_decode, help="number of D nodes")
    parser.add_argument(
        "--model", default=d.model, help="default model size (tiny, bench) or a local model dir"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--base-port", type=int, default=d.base_port)
    parser.add_argument("--side-channel-base-port", type=int, default=d.side_channel_base_port)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, auto on cuda")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help=f"default {d.max_model_len}: the generated models' context, in "
                             "which agent harnesses' prompts fit; set it for a --model "
                             "with a shorter one")
    parser.add_argument("--kv-cache-space-gib", type=int, default=d.kv_cache_space_gib)
    parser.add_argument("--ttl-s", type=int, default=d.decoder_kv_blocks_ttl_s,
                        help="decoder_kv_blocks_ttl: how long D keeps a finished turn's KV")
    parser.add_argument("--kv-recompute-threshold", type=int, default=d.kv_recompute_threshold)
    parser.add_argument("--no-bidirectional", action="store_true",
                        help="one-way P->D only (the recompute baseline)")
    parser.add_argument(
        "--retention", choices=["managed", "stock"], default=d.retention,
        help="D's retained KV: managed (kvrelay's connector releases it under memory "
             "pressure, over --retention-headroom, at each turn's own retention time and on "
             "the router's orders) or stock (vLLM's global --ttl-s only)")
    parser.add_argument(
        "--retention-headroom", type=_fraction, default=d.retention_headroom, metavar="F",
        help="fraction of D's KV cache kept free of retained turns (managed only)")
    parser.add_argument("--prefill-prefix-caching", action="store_true",
                        help="enable prefix caching on P (off by default, as in the seed)")
    parser.add_argument("--no-decode-prefix-caching", action="store_true")
    parser.add_argument("--nixl-progress-delay-us", type=int,
                        default=DEFAULT_NIXL_PROGRESS_DELAY_US)
    parser.add_argument("--no-restore-affinity", action="store_true",
                        help="keep vLLM's CPU main-thread re-pinning (reproduces the stall)")
    parser.add_argument("--no-pin-processes", action="store_true",
                        help="let each CPU server's API server and engine core float over all "
                             "cores (reproduces P's slowdown while D retains blocks)")
    parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    parser.add_argument(
        "--max-restarts", type=int, default=d.restart.max_attempts, metavar="N",
        help="restart a node or the router that exits, up to N times in a row with backoff "
             "(0: stop the cluster instead)")
    parser.add_argument(
        "--tool-call-parser", default=d.tool_call_parser, metavar="NAME",
        help="vLLM tool-call parser for auto tool choice: auto (from the model's model_type; "
             "the default models use hermes), none (off), or any vLLM parser name")
    for flag, role in (("--engine-arg", "every node"), ("--prefill-engine-arg", "P nodes"),
                       ("--decode-engine-arg", "D nodes")):
        parser.add_argument(
            flag, action="append", default=[], metavar="ARGS",
            help=f"one extra vLLM server argument for {role}, passed as is (repeatable: "
                 f"{flag}=--max-num-seqs=8, or {flag}=--max-num-seqs {flag}=8); they come "
                 "last and override kvrelay's")
    parser.add_argument("--run-dir", type=Path, default=None, help="where node logs go")
    parser.add_argument("--router-port", type=int, default=8000,
                        help="port of the kvrelay router started in front of the cluster")
    parser.add_argument("--no-router", action="store_true", help="start the engines only")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `kvrelay route` (repeatable)")



def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction in [0, 1], got {text}")
    return value


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    dtype = args.dtype or ("float32" if args.device == "cpu" else "auto")
    return ClusterConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        base_port=args.base_port,
        side_channel_base_port=args.side_channel_base_port,
        device=args.device,
        dtype=dtype,
        max_model_len=args.max_model_len,
        kv_cache_space_gib=args.kv_cache_space_gib,
        decoder_kv_blocks_ttl_s=args.ttl_s,
        kv_recompute_threshold=args.kv_recompute_threshold,
        bidirectional=not args.no_bidirectional,
        retention=args.retention,
        retention_headroom=args.retention_headroom,
        prefill_prefix_caching=args.prefill_prefix_caching,
        decode_prefix_caching=not args.no_decode_prefix_caching,
        nixl_progress_delay_us=args.nixl_progress_delay_us,
        restore_affinity=not args.no_restore_affinity,
        pin_processes=not args.no_pin_processes,
        startup_timeout_s=args.startup_timeout_s,
        tool_call_parser=args.tool_call_parser,
        restart=RestartPolicy(max_attempts=args.max_restarts),
        engine_args=tuple(args.engine_arg),
        prefill_engine_args=tuple(args.prefill_engine_arg),
        decode_engine_args=tuple(args.decode_engine_arg),
    )
