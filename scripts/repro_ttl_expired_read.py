#!/usr/bin/env python3
"""What a real vLLM P does with D's params read after D's ``decoder_kv_blocks_ttl``.

Starts 1 P + 1 D (tiny model) with a short TTL, runs turn 1, waits past the TTL, then sends
turn 2 to P carrying D's params and reports the status, elapsed time and P's external-KV
counter delta. Used to check the fake engine's TTL behaviour against vLLM.

    .venv/bin/python scripts/repro_ttl_expired_read.py [--ttl-s 30] [--timeout-s 120]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

from kvrelay.client.pd import PDClient
from kvrelay.client.prometheus import external_kv_tokens
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.launcher import LocalCluster, free_port_block

sys.path.insert(0, str(Path(__file__).parent))
from bench_pull import history


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttl-s", type=int, default=30)
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/kvrelay-ttl-repro"))
    args = ap.parse_args()
    config = ClusterConfig(decoder_kv_blocks_ttl_s=args.ttl_s,
                           base_port=free_port_block(2, 8400),
                           side_channel_base_port=free_port_block(2, 5900))
    cluster = LocalCluster(config, run_dir=args.run_dir).start()
    try:
        p_url, d_url = cluster.prefill[0].url, cluster.decode[0].url
        with PDClient(p_url, d_url, cluster.served_model_name,
                      timeout_s=args.timeout_s) as pd:
            messages = list(history(args.tokens, seed=7))
            turn1 = pd.turn(messages, 16)
            assert turn1.retained is not None, "D returned no params (bidirectional off?)"
            print(f"turn 1 ok; D retained {turn1.retained.num_tokens} tokens", flush=True)
            follow = [*messages, {"role": "assistant", "content": turn1.text},
                      {"role": "user", "content": "and then?"}]
            wait_s = args.ttl_s + 2
            print(f"waiting {wait_s} s (TTL {args.ttl_s} s)", flush=True)
            time.sleep(wait_s)
            before = external_kv_tokens(pd.metrics(p_url))
            started = time.perf_counter()
            try:
                pre = pd.prefill(follow, turn1.retained)
                outcome = f"ok, P returned params for {pre.prompt_tokens} prompt tokens"
            except httpx.HTTPError as e:
                outcome = f"{type(e).__name__}: {e}"
            elapsed = time.perf_counter() - started
            pulled = external_kv_tokens(pd.metrics(p_url)) - before
            print(f"expired read: {outcome} after {elapsed:.1f} s; P pulled {pulled:.0f} tokens",
                  flush=True)
    finally:
        cluster.stop()
    print(f"logs: {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
