"""How long ``kvrelay tune`` takes on a large trace (target: 1M turns in under a minute).

Writes a synthetic trace in the public chat format (``kvrelay.tune.synth``: ~1M turns with
16-token block hashes, about 2.6 GB) unless ``--trace`` names one, then times the phases
of ``kvrelay tune`` in this process: reading + building retentions, the model over the
default TTL grid with the recommendation, and the report with its charts. Not a test: the
numbers depend on the machine. Hold the heavy lock:

    flock /tmp/kvrelay-heavy.lock .venv/bin/python scripts/bench_tune.py --keep /tmp/1m.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.tune.analyze import TraceSource, analyze, load_retentions
from kvrelay.tune.costsource import CostValues
from kvrelay.tune.kvbytes import KvSize
from kvrelay.tune.model import ModelParams
from kvrelay.tune.report import write_report
from kvrelay.tune.synth import SynthSpec, write_trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=None, help="an existing trace to time")
    parser.add_argument("--conversations", type=int, default=210_000,
                        help="synthetic conversations (210k: ~1.06M turns in one hour)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the synthetic trace here and keep it (for reruns)")
    parser.add_argument("--decode", type=int, default=8)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            trace = args.keep or Path(tmp) / "trace.jsonl"
            t = time.perf_counter()
            n = write_trace(SynthSpec(conversations=args.conversations, seed=1,
                                      conversations_per_s=args.conversations / 3500,
                                      duration_s=3600), trace)
            print(f"wrote {n} turns ({trace.stat().st_size / 1e9:.2f} GB) in "
                  f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
        kv = KvSize(131072, "Llama-3-8B, bf16")
        costs = CostValues()
        params = ModelParams(kv_bytes_per_token=kv.bytes_per_token, costs=costs.estimates())
        started = time.perf_counter()
        loaded = load_retentions(TraceSource((trace,), num_decode=args.decode), sys.stderr)
        read_s = time.perf_counter() - started
        t = time.perf_counter()
        result = analyze(loaded, inputs=[str(trace)], kv=kv, costs=costs, params=params,
                         budget_gib=40.0)
        model_s = time.perf_counter() - t
        t = time.perf_counter()
        write_report(result, Path(tmp) / "out")
        report_s = time.perf_counter() - t
        total = time.perf_counter() - started
        print(f"{result.num_turns} turns, {trace.stat().st_size / 1e9:.2f} GB: read + build "
              f"{read_s:.1f} s, model ({len(result.points)} TTLs, {args.decode} D) + "
              f"recommendation {model_s:.1f} s, report + charts {report_s:.1f} s; "
              f"total {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
