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

``run_load`` (the client side) is also used by ``tests/component/test_router_soak.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

USER = "Describe, step by step, how a river delta forms and changes over the centuries. " * 3
FOLLOW_UPS = ["Go on.", "Be more specific about the sediments.", "What about floods?",
              "Compare it with an estuary.", "Summarize in two lines."]


# -- a minimal keep-alive HTTP/1.1 client (cheap on CPU; the load must not be the bottleneck)


class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self, path: str, body: dict[str, Any]) -> asyncio.StreamReader:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.writer.write(head.encode() + data)
        assert self.reader is not None
        return self.reader

    @staticmethod
    async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return int(lines[0].split()[1]), headers

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding") == "chunked":
            out = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    return out
                out += chunk[:-2]
        return await reader.readexactly(int(headers.get("content-length", "0")))

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        reader = await self._send(path, body)
        status, headers = await self._head(reader)
        data = await self._body(reader, headers)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        return json.loads(data)

    async def stream(
        self, path: str, body: dict[str, Any], started: float
    ) -> tuple[str, float, dict[str, str]]:
        """POST and read an SSE response: the reply text, the first token's time, the
        headers. ``RuntimeError`` on a non-200 status, an error event or no ``[DONE]``."""
        reader = await self._send(path, body)
        status, headers = await self._head(reader)
        if status != 200:
            data = await self._body(reader, headers)
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"not a chunked stream: {headers}")
        parts: list[str] = []
        ttft = 0.0
        buf = b""
        done = False
        error: str | None = None
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event == b"data: [DONE]":
                    done = True
                    continue
                if not event.startswith(b"data: {"):
                    continue
                obj = json.loads(event[6:])
                if obj.get("error") is not None:
                    error = json.dumps(obj["error"])[:200]
                for choice in obj.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if not ttft:
                            ttft = time.perf_counter() - started
                        parts.append(content)
        if error is not None:
            raise RuntimeError(f"error event: {error}")
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return "".join(parts), ttft, headers

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


# -- the load ------------------------------------------------------------------------------


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float
    action: str = ""


@dataclass
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    conversations: int = 0
    wall_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.samples) + len(self.errors)

    def pct(self, q: float, attr: str = "ttft_s") -> float:
        values = sorted(getattr(s, attr) for s in self.samples)
        if not values:
            return float("nan")
        return float(values[min(len(values) - 1, int(q * len(values)))])


@dataclass
class Target:
    """Where the load goes: ``router`` (URL) or, in ``direct`` mode, P and D URLs."""

    router: str | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)


async def _turn(conns: dict[str, Conn], mode: str, messages: list[dict[str, str]],
                conv_id: str, max_tokens: int) -> tuple[str, Sample]:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                            "stream": True}
    path = "/v1/chat/completions"
    started = time.perf_counter()
    if mode == "direct":
        p_body = {**body, "stream": False, "max_tokens": 1,
                  "kv_transfer_params": {"do_remote_decode": True}}
        p = await conns["p"].post_json(path, p_body)
        d_body = {**body, "kv_transfer_params": p["kv_transfer_params"]}
        text, ttft, headers = await conns["d"].stream(path, d_body, started)
    else:
        body["conversation_id"] = conv_id
        text, ttft, headers = await conns["router"].stream(path, body, started)
    action = headers.get("x-kvrelay-action", "")
    return text, Sample(ttft, time.perf_counter() - started, action)


async def _client(idx: int, target: Target, mode: str, result: LoadResult, *,
                  stop: Callable[[int], bool], turns: tuple[int, int], max_tokens: int,
                  seed: int, tag: str) -> None:
    rng = random.Random(f"{seed}:{idx}")
    conns: dict[str, Conn] = {}
    if mode == "direct":
        conns["p"] = Conn(*_host_port(target.prefill[idx % len(target.prefill)]))
        conns["d"] = Conn(*_host_port(target.decode[idx % len(target.decode)]))
    else:
        assert target.router is not None
        conns["router"] = Conn(*_host_port(target.router))
    n = 0
    try:
        while not stop(n):
            conv_id = f"{tag}-{idx}-{n}"
            n += 1
            result.conversations += 1
            messages = [{"role": "user", "content": f"[{conv_id}] {USER}"}]
            for _ in range(rng.randint(*turns)):
                try:
                    text, sample = await _turn(conns, mode, messages, conv_id, max_tokens)
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                        RuntimeError, ValueError, KeyError) as exc:
                    result.errors.append(f"{mode} client {idx} {conv_id}: {exc!r}")
                    for c in conns.values():
                        c.close()
                    break
                result.samples.append(sample)
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
    finally:
        for c in conns.values():
            c.close()


async def run_load(target: Target, *, mode: str = "router", clients: int,
                   duration_s: float | None = None, conversations_per_client: int | None = None,
                   turns: tuple[int, int] = (2, 6), max_tokens: int = 16, seed: int = 0,
                   tag: str = "soak", result: LoadResult | None = None) -> LoadResult:
    """``clients`` concurrent clients, each running conversation after conversation (a new
    conversation id each) until ``duration_s`` is over or it ran
    ``conversations_per_client`` of them."""
    result = result if result is not None else LoadResult()
    started = time.perf_counter()
    deadline = started + duration_s if duration_s is not None else None

    def stop(done: int) -> bool:
        if conversations_per_client is not None and done >= conversations_per_client:
            return True
        return deadline is not None and time.perf_counter() >= deadline

    await asyncio.gather(*(
        _client(i, target, mode, result, stop=stop, turns=turns, max_tokens=max_tokens,
                seed=seed, tag=tag)
        for i in range(clients)))
    result.wall_s = time.perf_counter() - started
    return result


def parse_metric(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in Prometheus exposition text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


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


async def _get(url: str) -> str:
    parts = urlsplit(url)
    host, port, path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Connection: close\r\n\r\n".encode())
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.strip() or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return body.decode()


async def sample_loop(router: str, pid: int, points: list[Point], result: LoadResult,
                      interval_s: float, stop: asyncio.Event) -> None:
    started = time.perf_counter()
    while True:
        try:
            text = await _get(router + "/metrics")
            points.append(Point(
                time.perf_counter() - started, rss_mib(pid),
                parse_metric(text, "kvrelay_router_live_entries") or 0.0,
                parse_metric(text, "kvrelay_router_pending_reports") or 0.0,
                result.requests))
        except OSError as exc:
            print(f"  sample failed: {exc!r}", file=sys.stderr)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except TimeoutError:
            pass


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not become healthy")


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
    text = await _get(target.router + "/metrics")
    final = Point(result.wall_s + 1.0, rss_mib(router_pid),
                  parse_metric(text, "kvrelay_router_live_entries") or 0.0,
                  parse_metric(text, "kvrelay_router_pending_reports") or 0.0, result.requests)
    points.append(final)
    stats = json.loads(await _get(target.router + "/stats"))
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

    from kvrelay.cluster.launcher import free_port_block

    n_engines = args.prefill + args.decode
    base = free_port_block(n_engines + 1, start=22000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    engines = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill", str(args.prefill),
         "--decode", str(args.decode), "--base-port", str(base), "--report-delay-s", "0.05",
         "--latency-preset", args.latency_preset, "--ttl-s", str(args.ttl_s)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n_engines)]
    target = Target(router=f"http://127.0.0.1:{base + n_engines}",
                    prefill=urls[:args.prefill], decode=urls[args.prefill:])
    router = None
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as toml:
        toml.write(f"expired_retention_s = {args.expired_retention_s}\n")
    try:
        for url in urls:
            wait_healthy(url, engines)
        cmd = [sys.executable, "-m", "kvrelay.cli", "route", "--config", toml.name,
               "--port", str(base + n_engines), "--block-size", "128",
               "--ttl-s", str(args.ttl_s), "--max-entries", str(args.max_entries),
               # zero-latency engines make every recompute look free: keep pulls going
               "--pull-cost-factor", "0.001", "--log-level", "warning"]
        for url in target.prefill:
            cmd += ["--prefill", url]
        for url in target.decode:
            cmd += ["--decode", url]
        router = subprocess.Popen(cmd, env=env)
        assert target.router is not None
        wait_healthy(target.router, router)
        return asyncio.run(soak(args, target, router.pid))
    finally:
        for proc in (router, engines):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        os.unlink(toml.name)


if __name__ == "__main__":
    sys.exit(main())
