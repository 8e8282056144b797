#!/usr/bin/env python3
"""With bidirectional_kv_xfer on, P's prefill slowed down once D held retained blocks.

Cause: while D retains a finished turn's blocks (up to ``decoder_kv_blocks_ttl``), its engine
core has unfinished requests and steps about every millisecond (an empty batch, to poll for
NIXL notifications), and its worker spin-waits for those steps. ``VLLM_CPU_OMP_THREADS_BIND``
binds only the worker's compute threads, so D's engine core and API server float onto P's
core. Fix: ``kvrelay up`` pins every process of a CPU server to the server's cores
(``ClusterConfig.pin_processes``). This script runs a few conversations with pinning off,
then on, and prints P's prefill time for each (each one adds a retained turn on D).

    .venv/bin/python scripts/repro_bidirectional_slowdown.py [--model bench] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrelay.client.pd import PDClient
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.launcher import LocalCluster, free_port_block

sys.path.insert(0, str(Path(__file__).parent))
from bench_pull import history


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for pin in (False, True):
        config = ClusterConfig(model=args.model, pin_processes=pin,
                               base_port=free_port_block(2, 8300),
                               side_channel_base_port=free_port_block(2, 5800))
        cluster = LocalCluster(config).start()
        try:
            with PDClient(cluster.prefill[0].url, cluster.decode[0].url,
                          cluster.served_model_name) as pd:
                for run in range(args.runs):
                    turn = pd.turn(history(args.tokens, seed=run + 100 * pin), 16)
                    print(f"pin_processes={pin} conversation={run} "
                          f"P prefill {turn.prefill.seconds:.2f} s, turn {turn.e2e_s:.2f} s",
                          flush=True)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
