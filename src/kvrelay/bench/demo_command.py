"""``kvrelay demo`` (what ``make demo`` runs): a local cluster, the router, one agent
conversation with and without reuse, then a short agent benchmark and context sweep.

Everything it starts is stopped when it ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    demo = sub.add_parser("demo", help="start a local cluster and show what KV reuse saves")
    demo.add_argument("--model", default="tiny", help="default model size or local model dir")
    demo.add_argument("--turns", type=int, default=6, help="turns of the showcase conversation")
    demo.add_argument("--out", type=Path, default=None, help="results folder")
    demo.add_argument("--no-bench", action="store_true",
                      help="only the showcase conversation, no agent/sweep benchmark")
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
                           side_channel_base_port=free_port_block(2, start=5600))
    cluster = LocalCluster(config, out / "runs")
    router: ServiceProcess | None = None
    print(f"[1/4] starting a local vLLM P/D cluster ({args.model} model, 1 P + 1 D); "
          f"logs in {cluster.run_dir}", flush=True)
    try:
        cluster.start()
        router = start_router(config, cluster, free_port_block(1, start=8000), [])
        model = cluster.served_model_name
        router_url = str(router.url)
        print(f"[2/4] router {router_url} in front of P {cluster.prefill[0].url} and "
              f"D {cluster.decode[0].url}", flush=True)
        print(f"[3/4] one agent conversation, {args.turns} turns, with and without reuse",
              flush=True)
        result = run_showcase(router_url, model, turns=args.turns, progress=sys.stderr)
        print()
        print(result.table())
        print()
        print(result.summary())
        print()
        if not args.no_bench:
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
        if router is not None:
            router.stop()
        cluster.stop()
