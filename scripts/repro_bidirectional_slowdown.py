#!/usr/bin/env python3
"""Reproduce an open problem: with bidirectional_kv_xfer on, P's prefill slows down once D
holds retained blocks.

Observed here (bench model, 8k-token prompts, 1 P + 1 D on 2 cores, 2026-11-30):
bidirectional on: P prefill 5.3 s, then 15.6 s, then 18.4 s for the next conversations;
bidirectional off: 6-9 s throughout. Not yet diagnosed (candidates: D's retained-block
bookkeeping or NIXL notification polling competing for P's core).

    .venv/bin/python scripts/repro_bidirectional_slowdown.py [--model bench] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.launcher import LocalCluster, free_port_block
from kvrelay.cluster.pd_client import PDClient

sys.path.insert(0, str(Path(__file__).parent))
from bench_pull import history


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for bidirectional in (True, False):
        config = ClusterConfig(model=args.model, bidirectional=bidirectional,
                               base_port=free_port_block(2, 8300),
                               side_channel_base_port=free_port_block(2, 5800))
        cluster = LocalCluster(config).start()
        try:
            with PDClient(cluster.prefill[0].url, cluster.decode[0].url,
                          cluster.served_model_name) as pd:
                for run in range(args.runs):
                    turn = pd.turn(history(args.tokens, seed=run + 100 * bidirectional), 16)
                    print(f"bidirectional={bidirectional} conversation={run} "
                          f"P prefill {turn.prefill.seconds:.2f} s, turn {turn.e2e_s:.2f} s",
                          flush=True)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
