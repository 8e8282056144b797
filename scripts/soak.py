"""Soak the router: many concurrent streaming multi-turn conversations for a long time.

Starts ``kvrelay fake-engine`` (``--prefill``/``--decode`` engines, zero simulated latency by
default) and ``kvrelay route`` in front of it, each in its own process, with a small entry cap
(``--max-entries``) and a short D TTL (``--ttl-s``; the router's expired entries are purged
``--expired-retention-s`` after expiry), so the entry count is bounded by the LRU cap and
the TTL rather than by the number of conversations. Then:

1. baseline (``--baseline-s``): the same clients speak the P/D protocol to the engines
   directly (P with ``max_tokens=1`` and ``do_remote_decode``, then a stream from D);
2. soak (``--duration-s``): ``--conversations`` clients each run conversations of
   ``--turns-min``..``--turns-max`` streamed turns through the router, each with a new
   conversation id (churn), until the time is up.

It reports the requests and errors (non-200, an SSE error event, no ``[DONE]``, a broken
connection; there must be none), the router's RSS (``/proc/PID/status`` VmRSS) and live
entries (``kvrelay_router_live_entries`` on ``/metrics``) sampled over time, the decisions,
and TTFT p50/p99 through the router against the direct baseline (the router's added latency).
Exit status 1 if there was an error or the entry count ever exceeded the cap.

    .venv/bin/python scripts/soak.py                    # 64 conversations, 600 s
    .venv/bin/python scripts/soak.py --duration-s 60    # a quick validation run

The client side is ``kvrelay.bench.soak`` (also used by ``tests/component/test_router_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.bench.rawhttp import get_text
from kvrelay.bench.soak import LoadResult, Target, run_load
from kvrelay.client.prometheus import parse_prometheus

# -- the processes and the report -------------------------------------------------------------


@dataclass
class Point:
    t_s: float
    rss_mib: float
    live_entries: float
    pending_reports: float
    requests: int


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def sample_loop(router: str, pid: int, points: list[Point], result: LoadResult,
                      interval_s: float, stop: asyncio.Event) -> None:
    started = time.perf_counter()
    while True:
        try:
            metrics = parse_prometheus(await get_text(router + "/metrics"))
            points.append(Point(
                time.perf_counter() - started, rss_mib(pid),
                metrics.get("kvrelay_router_live_entries") or 0.0,
                metrics.get("kvrelay_router_pending_reports") or 0.0,
                result.requests))
        except OSError as exc:
            print(f"  sample failed: {exc!r}", file=sys.stderr)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except TimeoutError:
            pass


async def soak(args: argparse.Namespace, target: Target, router_pid: int) -> int:
    assert target.router is not None
    turns = (args.turns_min, args.turns_max)
    print(f"warmup, then baseline (direct to the engines) for {args.baseline_s:.0f} s",
          flush=True)
    await run_load(target, clients=4, conversations_per_client=1, turns=turns,
                   max_tokens=args.max_tokens, tag="warm")
    await run_load(target, mode="direct", clients=4, conversations_per_client=1, turns=turns,
                   max_tokens=args.max_tokens)
    baseline = await run_load(target, mode="direct", clients=args.conversations,
                              duration_s=args.baseline_s, turns=turns,
                              max_tokens=args.max_tokens, seed=args.seed)
    print(f"soak through the router: {args.conversations} conversations for "
          f"{args.duration_s:.0f} s", flush=True)
    result = LoadResult()
    points: list[Point] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(
        sample_loop(target.router, router_pid, points, result, args.sample_s, stop))
    cpu_before = cpu_s(router_pid)
    await run_load(target, clients=args.conversations, duration_s=args.duration_s,
                   turns=turns, max_tokens=args.max_tokens, seed=args.seed, result=result)
    router_cpu = cpu_s(router_pid) - cpu_before
    stop.set()
    await sampler
    await asyncio.sleep(1.0)  # the last reports
    text = await get_text(target.router + "/metrics")
    metrics = parse_prometheus(text)
    final = Point(result.wall_s + 1.0, rss_mib(router_pid),
                  metrics.get("kvrelay_router_live_entries") or 0.0,
                  metrics.get("kvrelay_router_pending_reports") or 0.0, result.requests)
    points.append(final)
    stats = json.loads(await get_text(target.router + "/stats"))
    print(report(args, baseline, result, points, stats, router_cpu))
    for err in result.errors[:20]:
        print("  " + err, file=sys.stderr)
    over_cap = max(p.live_entries for p in points) > args.max_entries
    return 1 if result.errors or baseline.errors or over_cap else 0


def report(args: argparse.Namespace, baseline: LoadResult, result: LoadResult,
           points: list[Point], stats: dict[str, Any], router_cpu_s: float) -> str:
    ms = 1000.0
    mid = points[len(points) // 2]
    lines = [
        "",
        f"soak: {args.conversations} concurrent streaming conversations, "
        f"{result.wall_s:.0f} s, {args.turns_min}-{args.turns_max} turns each, "
        f"{args.max_tokens} tokens per turn; router --max-entries {args.max_entries} "
        f"--ttl-s {args.ttl_s:g} (expired_retention_s {args.expired_retention_s:g}); "
        f"{args.prefill} P + {args.decode} D fake engines ({args.latency_preset}); "
        f"cpus {os.cpu_count()}",
        f"requests: {result.requests} ({result.requests / max(result.wall_s, 1e-9):.0f}/s), "
        f"errors: {len(result.errors)}, conversations: {result.conversations}",
        f"router RSS MiB: start {points[0].rss_mib:.1f}, middle {mid.rss_mib:.1f}, "
        f"end {points[-1].rss_mib:.1f} (max {max(p.rss_mib for p in points):.1f})",
        f"live entries: max {max(p.live_entries for p in points):.0f} (cap "
        f"{args.max_entries}), end {points[-1].live_entries:.0f}; pending reports max "
        f"{max(p.pending_reports for p in points):.0f}",
        f"router CPU: {router_cpu_s * ms / max(1, len(result.samples)):.2f} ms/request",
        "",
        "| t s | RSS MiB | live entries | pending reports | requests |",
        "|---|---|---|---|---|",
    ]
    step = max(1, len(points) // 12)
    shown = points[::step] + ([points[-1]] if (len(points) - 1) % step else [])
    for p in shown:
        lines.append(f"| {p.t_s:.0f} | {p.rss_mib:.1f} | {p.live_entries:.0f} | "
                     f"{p.pending_reports:.0f} | {p.requests} |")
    lines += [
        "",
        "| streamed turns | requests | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("direct (baseline)", baseline), ("router", result)):
        lines.append(f"| {name} | {len(r.samples)} | {r.pct(0.5) * ms:.1f} | "
                     f"{r.pct(0.99) * ms:.1f} | {r.pct(0.5, 'e2e_s') * ms:.1f} | "
                     f"{r.pct(0.99, 'e2e_s') * ms:.1f} |")
    lines.append(
        f"| added by the router | | {(result.pct(0.5) - baseline.pct(0.5)) * ms:+.1f} | "
        f"{(result.pct(0.99) - baseline.pct(0.99)) * ms:+.1f} | "
        f"{(result.pct(0.5, 'e2e_s') - baseline.pct(0.5, 'e2e_s')) * ms:+.1f} | "
        f"{(result.pct(0.99, 'e2e_s') - baseline.pct(0.99, 'e2e_s')) * ms:+.1f} |")
    by_reason = stats.get("decisions", {}).get("by_reason", {})
    lines += ["", "router decisions: " + ", ".join(f"{k} {v}" for k, v in
                                                   sorted(by_reason.items()))]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=64, help="concurrent conversations")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--baseline-s", type=float, default=30.0,
                    help="direct-to-engine baseline before the soak")
    ap.add_argument("--turns-min", type=int, default=2)
    ap.add_argument("--turns-max", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-entries", type=int, default=32, help="the router's entry cap")
    ap.add_argument("--ttl-s", type=float, default=30.0, help="D's TTL (engines and router)")
    ap.add_argument("--expired-retention-s", type=float, default=5.0)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--latency-preset", choices=["fast", "cpu"], default="fast")
    ap.add_argument("--sample-s", type=float, default=5.0, help="RSS/entries sampling period")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from kvrelay.cluster.launcher import ServiceProcess, free_port_block

    n_engines = args.prefill + args.decode
    base = free_port_block(n_engines + 1, start=22000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n_engines)]
    target = Target(router=f"http://127.0.0.1:{base + n_engines}",
                    prefill=urls[:args.prefill], decode=urls[args.prefill:])
    with tempfile.TemporaryDirectory(prefix="kvrelay-soak-") as tmp:
        logs = Path(tmp)
        toml = logs / "router.toml"
        toml.write_text(f"expired_retention_s = {args.expired_retention_s}\n")
        cmd = [sys.executable, "-m", "kvrelay.cli", "route", "--config", str(toml),
               "--port", str(base + n_engines), "--block-size", "128",
               "--ttl-s", str(args.ttl_s), "--max-entries", str(args.max_entries),
               # zero-latency engines make every recompute look free: keep pulls going
               "--pull-cost-factor", "0.001", "--log-level", "warning"]
        for url in target.prefill:
            cmd += ["--prefill", url]
        for url in target.decode:
            cmd += ["--decode", url]
        engines = ServiceProcess(
            "fake-engines",
            [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill",
             str(args.prefill), "--decode", str(args.decode), "--base-port", str(base),
             "--report-delay-s", "0.05", "--latency-preset", args.latency_preset,
             "--ttl-s", str(args.ttl_s)],
            [f"{u}/health" for u in urls], logs / "engines.log", ready_timeout_s=120, env=env)
        router = ServiceProcess("router", cmd, [f"{target.router}/health"], logs / "router.log",
                                ready_timeout_s=120, env=env)
        with engines, router:
            assert router.process is not None
            return asyncio.run(soak(args, target, router.process.pid))

if __name__ == "__main__":
    sys.exit(main())
