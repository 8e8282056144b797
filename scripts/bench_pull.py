#!/usr/bin/env python3
"""Turn-2 TTFT on a real local P/D cluster: P pulls turn 1's KV back from D vs recomputes it.

For each context length and run: a fresh conversation whose history is ~L tokens; turn 1 runs
P -> D (non-streamed, so D's retained params come back); then turn 2 runs twice on the same
engines: once with D's params (P pulls over NIXL), once without (P recomputes; P prefix
caching is off). Reported per length: P's prefill time and the client-seen TTFT (P time + D's
first streamed token), median/min/max over the runs, and whether pull and recompute produced
the same text (greedy).

    .venv/bin/python scripts/bench_pull.py --lengths 2048 8192 16384 --runs 5

Starts its own cluster unless --prefill-url/--decode-url are given. Not a test: it measures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from kvrelay.bench.tokens import filler_words
from kvrelay.client.pd import PDClient
from kvrelay.client.prometheus import external_kv_tokens
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.launcher import LocalCluster


def history(num_tokens: int, seed: int, words: list[str]) -> list[dict[str, object]]:
    """A system + user history of ~``num_tokens`` tokens: ``num_tokens - 64`` of ``words``
    (``kvrelay.bench.tokens.filler_words``, one token each) and the template's."""
    rng = random.Random(seed)
    return [
        {"role": "system", "content": f"You are agent #{seed}."},
        {"role": "user", "content": "".join(rng.choice(words) for _ in range(num_tokens - 64))},
    ]


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--turn1-tokens", type=int, default=32)
    ap.add_argument("--turn2-tokens", type=int, default=8)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefill-url")
    ap.add_argument("--decode-url")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--nixl-progress-delay-us", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/bench_pull"))
    args = ap.parse_args()

    cluster: LocalCluster | None = None
    if args.prefill_url and args.decode_url:
        p_url, d_url, model = args.prefill_url, args.decode_url, args.served_model_name or "tiny"
    else:
        overrides = {}
        if args.nixl_progress_delay_us is not None:
            overrides["nixl_progress_delay_us"] = args.nixl_progress_delay_us
        config = ClusterConfig(model=args.model, **overrides)  # type: ignore[arg-type]
        print(f"starting local cluster ({args.model}) ...", file=sys.stderr, flush=True)
        cluster = LocalCluster(config).start()
        p_url, d_url = cluster.prefill[0].url, cluster.decode[0].url
        model = cluster.served_model_name
    rows: list[dict[str, object]] = []
    words = filler_words(args.model)
    try:
        with PDClient(p_url, d_url, model) as client:
            for length in args.lengths:
                samples: dict[str, list[float]] = {
                    "pull_p_s": [], "recompute_p_s": [], "pull_ttft_s": [], "recompute_ttft_s": []
                }
                same = 0
                pulled_tokens: list[float] = []
                for run in range(args.runs):
                    msgs = history(length, seed=length * 1000 + run + int(time.time()) % 1000,
                                   words=words)
                    t1 = client.turn(msgs, max_tokens=args.turn1_tokens)
                    assert t1.retained is not None, "D retained nothing (bidirectional off?)"
                    msgs2 = [*msgs, {"role": "assistant", "content": t1.text},
                             {"role": "user", "content": "Continue with the next step."}]
                    before = external_kv_tokens(client.metrics(p_url))
                    pull = client.turn(
                        msgs2, max_tokens=args.turn2_tokens, reuse=t1.retained, stream=True
                    )
                    pulled_tokens.append(external_kv_tokens(client.metrics(p_url)) - before)
                    rec = client.turn(msgs2, max_tokens=args.turn2_tokens, stream=True)
                    samples["pull_p_s"].append(pull.prefill.seconds)
                    samples["recompute_p_s"].append(rec.prefill.seconds)
                    samples["pull_ttft_s"].append(pull.ttft_s)
                    samples["recompute_ttft_s"].append(rec.ttft_s)
                    same += int(pull.text == rec.text)
                    print(f"L={length} run={run} prompt={pull.prefill.prompt_tokens} "
                          f"pulled={pulled_tokens[-1]:.0f} P pull {pull.prefill.seconds:.3f}s "
                          f"recompute {rec.prefill.seconds:.3f}s | TTFT pull {pull.ttft_s:.3f}s "
                          f"recompute {rec.ttft_s:.3f}s same={pull.text == rec.text}",
                          file=sys.stderr, flush=True)
                rows.append({
                    "context_tokens": length,
                    "runs": args.runs,
                    "pulled_tokens_median": statistics.median(pulled_tokens),
                    "same_output": f"{same}/{args.runs}",
                    **{k: stats(v) for k, v in samples.items()},
                })
    finally:
        if cluster is not None:
            cluster.stop()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_pull.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| context | runs | pulled tokens | P pull s (med [min-max]) | P recompute s | "
        "TTFT pull s | TTFT recompute s | recompute/pull (P) | same output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        def f(key: str, r: dict[str, object] = r) -> str:
            s = r[key]
            assert isinstance(s, dict)
            return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"
        pull_p = r["pull_p_s"]
        rec_p = r["recompute_p_s"]
        assert isinstance(pull_p, dict) and isinstance(rec_p, dict)
        ratio = rec_p["median"] / pull_p["median"]
        lines.append(f"| {r['context_tokens']} | {r['runs']} | {r['pulled_tokens_median']:.0f} | "
                     f"{f('pull_p_s')} | {f('recompute_p_s')} | {f('pull_ttft_s')} | "
                     f"{f('recompute_ttft_s')} | {ratio:.1f}x | {r['same_output']} |")
    table = "\n".join(lines)
    (args.out / "bench_pull.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
