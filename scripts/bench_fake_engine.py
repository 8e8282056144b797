"""Capacity of the fake vLLM engine: short requests per second that one process serves.

Starts ``kvrelay fake-engine --prefill 1 --decode 0`` in a subprocess pinned to one core
(``--core``), then drives it from this process (pinned to another core when there is one)
with a minimal keep-alive HTTP/1.1 client over ``--connections`` connections, so the client
costs as little as possible. Reports requests/s and latency percentiles. Not a test: numbers
depend on the machine (target: >= 500 short requests/s on one core).

    .venv/bin/python scripts/bench_fake_engine.py --requests 5000 --connections 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvrelay.cluster.launcher import free_port


def request_bytes(port: int, kind: str, i: int) -> bytes:
    if kind == "chat":
        path = "/v1/chat/completions"
        body = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": f"hello number {i % 50}"}]}
    else:
        path = "/v1/completions"
        body = {"model": "tiny", "max_tokens": 4, "prompt": f"hello number {i % 50}"}
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    await reader.readexactly(length)
    return status


async def drive(port: int, kind: str, total: int, connections: int) -> list[float]:
    latencies: list[float] = []
    counter = iter(range(total))
    failures = 0

    async def worker() -> None:
        nonlocal failures
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in counter:
                started = time.perf_counter()
                writer.write(request_bytes(port, kind, i))
                if await read_response(reader) != 200:
                    failures += 1
                latencies.append(time.perf_counter() - started)
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    if failures:
        print(f"warning: {failures} non-200 responses", file=sys.stderr)
    return latencies


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"fake engine exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("fake engine did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--kind", choices=["chat", "completions"], default="chat")
    parser.add_argument("--core", type=int, default=0, help="core the server is pinned to")
    args = parser.parse_args()

    port = free_port()
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill", "1", "--decode",
           "0", "--base-port", str(port)]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    proc = subprocess.Popen(
        cmd, cwd=root, stdout=subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, {args.core})) if cores else None,
    )
    try:
        wait_ready(port, proc)
        others = [c for c in cores if c != args.core]
        if others:
            os.sched_setaffinity(0, set(others))
        asyncio.run(drive(port, args.kind, args.warmup, args.connections))
        started = time.perf_counter()
        latencies = asyncio.run(drive(port, args.kind, args.requests, args.connections))
        elapsed = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    latencies.sort()
    pct = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3  # noqa: E731
    print(f"{args.kind}: {len(latencies)} requests in {elapsed:.2f} s = "
          f"{len(latencies) / elapsed:.0f} req/s on one server core; latency ms "
          f"p50 {pct(0.5):.2f} p99 {pct(0.99):.2f} mean {statistics.mean(latencies) * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
