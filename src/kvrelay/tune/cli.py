"""``kvrelay tune`` and ``kvrelay tune-synth`` (docs/tune.md).

    kvrelay tune trace.jsonl --model-config config.json --decode 4 --kv-budget-gib 20
    kvrelay tune turns.jsonl.2 turns.jsonl.1 turns.jsonl --stats http://router:8000/stats
    kvrelay tune-synth --conversations 2000 --seed 1 --out trace.jsonl

``kvrelay tune`` reads a kvrelay turn log or a trace (chat JSONL, Mooncake JSONL, CSV), and
predicts per D TTL the follow-up hit rate, the tokens reused, the prefill time saved and the
KV pinned on each D; it recommends a TTL, a recompute threshold and the D memory for a target
hit rate. It writes tune.md (printed too), tune.json and PNG charts to --out.
Exit status: 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvrelay.core.policy import DEFAULT_KV_RECOMPUTE_THRESHOLD

MISSING_EXTRA = ("kvrelay tune needs numpy and matplotlib, which the router-only install "
                 "does not have: pip install 'kvrelay[tune]'")


def register(sub: Any) -> None:
    tune = sub.add_parser("tune", help="what TTL, threshold and D memory a deployment needs, "
                          "from its turn log or a trace", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_argument("inputs", type=Path, nargs="+", metavar="FILE",
                      help="turn log (several: rotated files) or one trace file")
    i = tune.add_argument_group("input")
    i.add_argument("--format", default="auto",
                   choices=["auto", "turnlog", "chat", "mooncake", "csv"])
    i.add_argument("--time-unit", choices=["s", "ms"], default=None,
                   help="timestamp unit (default: s for chat traces and turn logs, ms for "
                        "Mooncake)")
    i.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per hash_ids block (default 16 for chat, 512 for Mooncake)")
    i.add_argument("--decode-s-per-token", type=float, default=0.0,
                   help="traces: a turn ends output_length x this after it arrives (TTLs "
                        "count from the end); default 0")
    i.add_argument("--decode", type=int, default=1,
                   help="traces: number of D nodes; conversations go round robin over them")
    k = tune.add_argument_group("KV size (one of)")
    k.add_argument("--model-config", type=Path, default=None,
                   help="the model's config.json (or its directory)")
    k.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype if not the model's (e.g. fp8)")
    k.add_argument("--kv-bytes-per-token", type=float, default=None)
    c = tune.add_argument_group("cost model (router's learned costs and/or flags)")
    c.add_argument("--stats", default=None, metavar="FILE|URL",
                   help="the router's GET /stats JSON (file, or http(s) URL)")
    c.add_argument("--prefill-s-per-token", type=float, default=None)
    c.add_argument("--transfer-overhead-s", type=float, default=None)
    c.add_argument("--transfer-s-per-token", type=float, default=None)
    c.add_argument("--attention-knee-tokens", type=int, default=None)
    r = tune.add_argument_group("router")
    r.add_argument("--router-margin-s", type=float, default=None,
                   help="ttl_safety_margin_s + near_expiry_s of the router (default 10 + 15)")
    r.add_argument("--threshold", type=int, default=DEFAULT_KV_RECOMPUTE_THRESHOLD,
                   help="the router's kv_recompute_threshold (default %(default)s)")
    r.add_argument("--pull-cost-factor", type=float, default=1.0)
    g = tune.add_argument_group("recommendation")
    g.add_argument("--ttls", default=None,
                   help="comma-separated TTLs in seconds (default 30 ... 7200)")
    g.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV memory per D that retention may pin")
    g.add_argument("--budget-stat", choices=["peak", "p95"], default="peak")
    g.add_argument("--knee-fraction", type=float, default=0.9,
                   help="without a budget: shortest TTL saving this share of the unlimited "
                        "TTL's savings (default 0.9)")
    g.add_argument("--target-hit-rate", type=float, default=0.9,
                   help="report the TTL and D memory for this hit rate (default 0.9)")
    o = tune.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None,
                   help="results folder (default results/tune-TIMESTAMP)")
    o.add_argument("--no-charts", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress, no printed report")
    tune.set_defaults(func=_tune)

    synth = sub.add_parser("tune-synth", help="write a synthetic multi-turn trace (chat JSONL) "
                           "with a chosen gap distribution")
    add_synth_arguments(synth)
    synth.set_defaults(func=_synth)


def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.tune.synth import SynthSpec

    d = SynthSpec()
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--conversations-per-s", type=float, default=d.conversations_per_s,
                   help="Poisson arrival rate of conversations")
    p.add_argument("--turns-mean", type=float, default=d.turns_mean)
    p.add_argument("--max-turns", type=int, default=d.max_turns)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--user-tokens", type=int, default=d.user_tokens,
                   help="median tokens of a user/tool message")
    p.add_argument("--output-tokens", type=int, default=d.output_tokens,
                   help="median tokens of an answer")
    p.add_argument("--length-sigma", type=float, default=d.length_sigma)
    p.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens)
    p.add_argument("--tool-fraction", type=float, default=d.gaps.tool_fraction,
                   help="share of gaps that are tool-call pauses (the rest: human)")
    p.add_argument("--tool-p50-s", type=float, default=d.gaps.tool.median_s)
    p.add_argument("--tool-p90-s", type=float, default=d.gaps.tool.p90_s)
    p.add_argument("--human-p50-s", type=float, default=d.gaps.human.median_s)
    p.add_argument("--human-p90-s", type=float, default=d.gaps.human.p90_s)
    p.add_argument("--gap-scale", type=float, default=1.0,
                   help="multiply every pause by this")
    p.add_argument("--decode-s-per-token", type=float, default=d.decode_s_per_token)
    p.add_argument("--duration-s", type=float, default=None,
                   help="keep only turns arriving before this (a recording window)")


def synth_spec_from_args(args: argparse.Namespace) -> Any:
    from kvrelay.tune.synth import GapMixture, LogNormalPause, SynthSpec

    gaps = GapMixture(args.tool_fraction, LogNormalPause(args.tool_p50_s, args.tool_p90_s),
                      LogNormalPause(args.human_p50_s, args.human_p90_s))
    if args.gap_scale != 1.0:
        if args.gap_scale <= 0:
            raise ValueError("--gap-scale must be positive")
        gaps = gaps.scaled(args.gap_scale)
    return SynthSpec(
        conversations=args.conversations, seed=args.seed,
        conversations_per_s=args.conversations_per_s, turns_mean=args.turns_mean,
        max_turns=args.max_turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, output_tokens=args.output_tokens,
        length_sigma=args.length_sigma, max_context_tokens=args.max_context_tokens,
        gaps=gaps, decode_s_per_token=args.decode_s_per_token, duration_s=args.duration_s,
    )


def _synth(args: argparse.Namespace) -> int:
    from kvrelay.tune.synth import write_trace

    try:
        spec = synth_spec_from_args(args)
        n = write_trace(spec, args.out)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} turns of {spec.conversations} conversations to {args.out}",
          file=sys.stderr)
    return 0


def _tune(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        print(f"error: {MISSING_EXTRA}", file=sys.stderr)
        return 2
    from kvrelay.tune.costsource import CostSourceError
    from kvrelay.tune.kvbytes import ModelConfigError
    from kvrelay.tune.trace import TraceFormatError

    try:
        return _run(args)
    except (TraceFormatError, ModelConfigError, CostSourceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from kvrelay.tune.analyze import DEFAULT_TTLS_S, TraceSource, analyze, load_retentions
    from kvrelay.tune.costsource import CostValues, costs_from_stats, load_stats
    from kvrelay.tune.kvbytes import KvSize, kv_bytes_per_token, load_model_config
    from kvrelay.tune.model import DEFAULT_ROUTER_MARGIN_S, ModelParams
    from kvrelay.tune.report import write_report

    if (args.model_config is None) == (args.kv_bytes_per_token is None):
        raise ValueError("give exactly one of --model-config and --kv-bytes-per-token")
    if args.kv_bytes_per_token is not None:
        kv = KvSize(args.kv_bytes_per_token, "--kv-bytes-per-token")
    else:
        kv = kv_bytes_per_token(load_model_config(args.model_config), args.kv_cache_dtype)
    costs = (costs_from_stats(load_stats(args.stats), args.stats) if args.stats
             else CostValues())
    costs = costs.with_overrides(
        prefill_s_per_token=args.prefill_s_per_token,
        transfer_overhead_s=args.transfer_overhead_s,
        transfer_s_per_token=args.transfer_s_per_token,
        attention_knee_tokens=args.attention_knee_tokens,
    )
    params = ModelParams(
        kv_bytes_per_token=kv.bytes_per_token, costs=costs.estimates(),
        router_margin_s=(DEFAULT_ROUTER_MARGIN_S if args.router_margin_s is None
                         else args.router_margin_s),
        threshold_tokens=args.threshold, pull_cost_factor=args.pull_cost_factor,
    )
    ttls = DEFAULT_TTLS_S if args.ttls is None else parse_ttls(args.ttls)
    source = TraceSource(
        paths=tuple(args.inputs), fmt=args.format,
        time_unit_s={"s": 1.0, "ms": 0.001}.get(args.time_unit or ""),
        block_tokens=args.block_tokens, num_decode=args.decode,
        decode_s_per_token=args.decode_s_per_token,
    )
    progress = None if args.quiet else sys.stderr
    started = time.perf_counter()
    loaded = load_retentions(source, progress)
    result = analyze(
        loaded, inputs=[str(p) for p in args.inputs], kv=kv, costs=costs, params=params,
        ttls_s=ttls, budget_gib=args.kv_budget_gib, budget_stat=args.budget_stat,
        knee_fraction=args.knee_fraction, target_hit_rate=args.target_hit_rate,
    )
    out = args.out or Path("results") / f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    files = write_report(result, out, charts=not args.no_charts)
    if not args.quiet:
        print(files.markdown.read_text())
        for path in (files.json, files.markdown, *files.charts):
            print(f"wrote {path}", file=sys.stderr)
        print(f"{result.num_turns} turns in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
    return 0


def parse_ttls(text: str) -> list[float]:
    """``"60,300,1200"`` -> ``[60.0, 300.0, 1200.0]``; ``ValueError`` on anything else."""
    try:
        ttls = [float(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise ValueError(f"--ttls: not a comma-separated list of seconds: {text!r}") from exc
    if not ttls or any(not t > 0 for t in ttls):
        raise ValueError(f"--ttls: need positive seconds, got {text!r}")
    return ttls
