"""Do maximal request bodies stall other clients? (A benchmark, not a test; issue #23.)

Starts ``kvrelay fake-engine --prefill 1 --decode 1`` and ``kvrelay route`` in front of it,
each in its own process, then measures another client's latency twice for ``--seconds``:

* ``quiet``: the probe alone;
* ``bodies``: the same, while ``--senders`` clients (from a process of their own) each send
  maximal chat bodies back to back: ``--messages`` messages (default 10 000, the default
  ``max_messages``) filling ``--body-mib`` (default just under the 8 MiB ``max_body_bytes``),
  ``max_tokens`` 1, not streamed.

The probe is ``GET /metrics`` (the router alone; the issue's measure: 6.7 s before the fix)
and a short streamed chat (its TTFT also includes the engines, which render the big bodies
too). It prints p50/p99 of both and the ratio of the p99s; numbers depend on the machine:

    flock /tmp/kvrelay-heavy.lock .venv/bin/python scripts/bench_large_bodies.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.rawhttp import Conn
from kvrelay.bench.soak import USER, stream_turn
from kvrelay.cluster.launcher import ServiceProcess, free_port_block


@dataclass
class Phase:
    name: str
    metrics_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def big_body(messages: int, body_bytes: int) -> bytes:
    """A chat body of ``messages`` messages, about ``body_bytes`` long."""
    overhead = len(json.dumps({"role": "user", "content": ""})) + 2
    text = "w" * max(1, body_bytes // messages - overhead)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i in range(messages - 1)] + [{"role": "user", "content": text}]
    return json.dumps({"model": "tiny", "max_tokens": 1, "stream": False,
                       "messages": msgs}).encode()


async def probe(port: int, stop_at: float, phase: Phase) -> None:
    """``GET /metrics`` every 50 ms and, side by side, short streamed chats back to back,
    until ``stop_at``."""
    loop = asyncio.get_running_loop()

    async def metrics() -> None:
        while loop.time() < stop_at:
            started = time.perf_counter()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: probe\r\n"
                             b"Connection: close\r\n\r\n")
                await reader.read()  # until the router closes it
                writer.close()
                phase.metrics_s.append(time.perf_counter() - started)
            except OSError as exc:
                phase.errors.append(repr(exc))
            await asyncio.sleep(0.05)

    async def chats() -> None:
        n = 0
        while loop.time() < stop_at:
            conn = {"router": Conn("127.0.0.1", port)}
            try:
                _, sample = await stream_turn(
                    conn, "router", [{"role": "user", "content": f"[probe {n}] " + USER}],
                    None, 8)
                phase.ttft_s.append(sample.ttft_s)
            except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError) as exc:
                phase.errors.append(repr(exc))
            finally:
                conn["router"].close()
            n += 1

    await asyncio.gather(metrics(), chats())


async def send_bodies(port: int, stop_at: float, body: bytes, stats: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bodies\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    while loop.time() < stop_at:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            await writer.drain()
            answer = await reader.read()
            writer.close()
            status = answer.split(b" ", 2)[1].decode("latin-1") if answer else "none"
            stats[f"HTTP {status}"] = stats.get(f"HTTP {status}", 0) + 1
        except OSError as exc:
            stats[type(exc).__name__] = stats.get(type(exc).__name__, 0) + 1


def senders(port: int, seconds: float, count: int, body: bytes,
            out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """The body senders, in a process of their own; puts their answers on ``out``."""

    async def run() -> dict[str, int]:
        stats: dict[str, int] = {}
        stop_at = asyncio.get_running_loop().time() + seconds
        await asyncio.gather(*(send_bodies(port, stop_at, body, stats) for _ in range(count)))
        return stats

    out.put(asyncio.run(run()))


def report(quiet: Phase, loaded: Phase, args: argparse.Namespace, body_bytes: int) -> str:
    ms = 1000.0
    lines = ["| phase | /metrics probes | errors | /metrics p50 ms | /metrics p99 ms "
             "| chat TTFT p50 ms | chat TTFT p99 ms |", "|---|---|---|---|---|---|---|"]
    for p in (quiet, loaded):
        lines.append(
            f"| {p.name} | {len(p.metrics_s)} | {len(p.errors)} | "
            f"{p.pct(p.metrics_s, 0.5) * ms:.1f} | {p.pct(p.metrics_s, 0.99) * ms:.1f} | "
            f"{p.pct(p.ttft_s, 0.5) * ms:.1f} | {p.pct(p.ttft_s, 0.99) * ms:.1f} |")
    lines += [
        "",
        f"bodies: {args.senders} senders of {args.messages} messages, "
        f"{body_bytes / (1024 * 1024):.2f} MiB each; answers {dict(sorted(loaded.sent.items()))}",
        f"/metrics p99 bodies / quiet = "
        f"{quiet.pct(loaded.metrics_s, 0.99) / quiet.pct(quiet.metrics_s, 0.99):.2f}; "
        f"chat TTFT p99 bodies / quiet = "
        f"{quiet.pct(loaded.ttft_s, 0.99) / quiet.pct(quiet.ttft_s, 0.99):.2f}",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--senders", type=int, default=4, help="clients sending big bodies")
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--body-mib", type=float, default=7.9)
    ap.add_argument("--latency-preset", default="fast", choices=["fast", "cpu"],
                    help="the fake engines' simulated latency (default fast)")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for kvrelay route (repeat)")
    args = ap.parse_args()

    body = big_body(args.messages, int(args.body_mib * 1024 * 1024))
    base = free_port_block(3, start=23100)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p_url, d_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    router_port = base + 2
    with tempfile.TemporaryDirectory(prefix="kvrelay-bodies-") as tmp:
        engines = ServiceProcess(
            "fake-engines",
            [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill", "1", "--decode",
             "1", "--base-port", str(base), "--latency-preset", args.latency_preset],
            [p_url + "/health", d_url + "/health"], Path(tmp) / "engines.log",
            ready_timeout_s=120, env=env)
        router = ServiceProcess(
            "router",
            [sys.executable, "-m", "kvrelay.cli", "route", "--prefill", p_url, "--decode", d_url,
             "--port", str(router_port), "--block-size", "128", "--log-level", "warning",
             *args.router_arg],
            [f"http://127.0.0.1:{router_port}/health"], Path(tmp) / "router.log",
            ready_timeout_s=120, env=env)
        with engines, router:
            print(f"senders {args.senders}, {args.messages} messages, {len(body)} bytes, "
                  f"{args.seconds:g} s per phase, latency {args.latency_preset}, "
                  f"cpus {os.cpu_count()}", flush=True)
            quiet = Phase("quiet")
            asyncio.run(probe(router_port, time.monotonic() + args.seconds, quiet))
            loaded = Phase("bodies")
            ctx = multiprocessing.get_context("spawn")
            out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
            proc = ctx.Process(target=senders, args=(router_port, args.seconds, args.senders,
                                                     body, out))
            proc.start()
            asyncio.run(probe(router_port, time.monotonic() + args.seconds, loaded))
            loaded.sent = out.get(timeout=args.seconds + 300)
            proc.join(timeout=30)
            print(report(quiet, loaded, args, len(body)))
            return 0 if router.alive() else 1


if __name__ == "__main__":
    sys.exit(main())
