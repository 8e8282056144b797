"""``kvrelay demo`` (what ``make demo`` runs): a local cluster, a router that reuses KV and
one that never does, one agent conversation through both in alternated pairs
(``bench.showcase``), and optionally the short agent benchmark and context sweep.

The default ``bench`` model with ~1.5-2.5k-token follow-ups is where P's prefill costs what
a pull saves on this kind of machine (docs/perf.md, "What reuse saves: the demo"); ``--model
tiny`` prefills ~10x faster, so the gap is smaller there (the router's learned costs decide
per turn whether a pull still pays).
Everything it starts is stopped when it ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

NEVER_PULL_FACTOR = 1e9
"""The baseline router's ``--pull-cost-factor``: no predicted pull is cheap enough, so it
recomputes every follow-up (``cost_model``) on the same engines as the reusing router."""

STARTUP_TIMEOUT_S = 900.0
"""vLLM's CPU start-up takes ~1 min alone here, and several times that on a busy machine."""

SIZES = {"bench": (1400, 330), "tiny": (570, 230)}
"""Words of the system prompt and of each tool output, per default model (a word, with its
space, is ~1.2 tokens with the default models' BPE tokenizer: bench's conversation opens at
~1.6k tokens and ends at ~3.5k after 6 turns, tiny's at ~0.7k and ~2k, as they did with the
byte-level tokenizer); a local model dir gets the bench sizes."""


def register(sub: Any) -> None:
    demo = sub.add_parser("demo", help="start a local cluster and show what KV reuse saves")
    demo.add_argument("--model", default="bench",
                      help="default model size (bench, tiny) or local model dir")
    demo.add_argument("--turns", type=int, default=6, help="turns of the showcase conversation")
    demo.add_argument("--pairs", type=int, default=4,
                      help="times the conversation runs through both routers, alternating "
                           "which goes first (default 4)")
    demo.add_argument("--recompute-first", action="store_true",
                      help="the router without reuse opens the first pair (default: the "
                           "reusing one)")
    demo.add_argument("--system-words", type=int, default=None,
                      help="words of the system prompt (default per model: bench 1400, tiny "
                           "570; a word is ~1.2 tokens)")
    demo.add_argument("--tool-words", type=int, default=None,
                      help="words of each turn's tool output (default per model: bench 330, "
                           "tiny 230)")
    demo.add_argument("--out", type=Path, default=None, help="results folder")
    demo.add_argument("--bench", action="store_true",
                      help="then also the short agent benchmark and context sweep (pull mode)")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from kvrelay.bench.demo import run_demo
    from kvrelay.bench.showcase import run_showcase
    from kvrelay.cluster.config import ClusterConfig
    from kvrelay.cluster.launcher import (
        ClusterStartError,
        LocalCluster,
        ServiceProcess,
        free_port_block,
        start_router,
    )

    out = args.out or Path("results") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    config = ClusterConfig(model=args.model, base_port=free_port_block(2, start=8100),
                           side_channel_base_port=free_port_block(2, start=5600),
                           startup_timeout_s=STARTUP_TIMEOUT_S)
    cluster = LocalCluster(config, out / "runs")
    routers: list[ServiceProcess] = []
    default_system_words, default_tool_words = SIZES.get(args.model, SIZES["bench"])
    system_words = args.system_words if args.system_words is not None else default_system_words
    tool_words = args.tool_words if args.tool_words is not None else default_tool_words
    print(f"[1/4] starting a local vLLM P/D cluster ({args.model} model, 1 P + 1 D); "
          f"logs in {cluster.run_dir}", flush=True)
    try:
        cluster.start()
        routers.append(start_router(config, cluster, free_port_block(2, start=8000), []))
        routers.append(start_router(
            config, cluster, free_port_block(2, start=8010),
            ["--pull-cost-factor", str(NEVER_PULL_FACTOR)]))
        model = cluster.served_model_name
        reuse_url, baseline_url = str(routers[0].url), str(routers[1].url)
        print(f"[2/4] routers in front of P {cluster.prefill[0].url} and D "
              f"{cluster.decode[0].url}: {reuse_url} reuses KV (learned costs), "
              f"{baseline_url} never does", flush=True)
        print(f"[3/4] one agent conversation ({args.turns} turns) through both routers, "
              f"{args.pairs} pairs alternating which goes first, after a warm-up of both",
              flush=True)
        started = time.perf_counter()
        result = run_showcase(reuse_url, baseline_url, model, pairs=args.pairs,
                              turns=args.turns, system_words=system_words,
                              tool_words=tool_words, recompute_first=args.recompute_first,
                              progress=sys.stderr)
        print()
        print(result.table())
        print()
        print(result.pairs_table())
        print()
        print(result.summary())
        print(f"(showcase {time.perf_counter() - started:.0f} s)")
        print()
        if args.bench:
            router_url = reuse_url
            print("[4/4] short agent benchmark and context sweep (pull mode)", flush=True)
            summary = run_demo(router_url, out, model=args.model, served_model_name=model,
                               progress=sys.stderr)
            print(summary.markdown)
            for path in summary.files:
                print(f"wrote {path}")
        return 0 if result.same_output else 1
    except ClusterStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping the cluster", flush=True)
        for router in routers:
            router.stop()
        cluster.stop()
