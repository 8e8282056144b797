"""What the kvrelay router adds on top of calling P then D directly (a benchmark, not a test).

Starts ``kvrelay fake-engine --prefill 1 --decode 1`` (zero simulated latency, reports sent at
once, kvrelay's connector emulated on P and D), ``kvrelay route`` and the bare relay
(``kvrelay.bench.bare_relay``) in front of it, each in its own process, then runs
``--clients`` concurrent streaming conversations of ``--turns`` turns in four modes,
interleaved round by round:

* ``direct``: the client itself POSTs P (``max_tokens=1``, ``do_remote_decode``) and then
  streams from D with P's params: the P/D protocol with no router.
* ``bare``: the same turns through the leanest pass-through on the router's own HTTP stack
  (no state, no checks): the floor for a Python router.
* ``router``: the same turns through kvrelay with no conversation id and no session
  header: id-free lookup by message digests, the policy, a pull on turns 2..N (P's
  connector verifies it), byte pass-through streaming, and D's report.
* ``router+id``: the same with a conversation id (the lookup's scope is narrowed).
* ``redis``: the same turns as ``router`` through a second ``kvrelay route`` whose index is
  a ``redis-server`` the script starts (``--state redis://...``: the index shared by router
  replicas, with its Lua scripts and the release queue); its relay column is the router's
  CPU, ``redis CPU ms/req`` Redis's.
* ``responses`` / ``messages``: the same conversations through kvrelay on ``/v1/responses``
  (``store: false``, the whole ``input`` re-sent with D's ``output`` items) and on
  ``/v1/messages`` (the history re-sent with D's ``content``), id-free, streamed: the
  router's cost per turn for each API beside chat's.

* ``before``: with ``--before-python PATH`` (the interpreter of another checkout's venv, e.g.
  the commit before a change), that checkout's ``kvrelay route`` with the same flags, driven
  like ``router``, interleaved in the same rounds: before and after side by side.

(The router runs with ``--pull-cost-factor 0.001``: with zero-latency engines its learned
costs would otherwise find recomputing free and stop pulling.)

For each mode: requests/s, and p50/p99 of the time to the first content token (TTFT) and to
``[DONE]``; then the router's added latency (mode minus ``direct``) at p50 and p99. With zero
engine latency this is the router's own cost (plus one more HTTP hop). Numbers depend on the
machine; docs/perf.md has a run and the exact command.

    .venv/bin/python scripts/bench_router_overhead.py --clients 64 --turns 4 --rounds 3

Against vLLM 0.33's protocol (D's params on the final streamed chunk, so after a D's first
stream the router asks it for no report; the ``"kv_transfer_params":null`` 0.33 puts on every
token chunk is cut as bytes):

    .venv/bin/python scripts/bench_router_overhead.py --engine-arg=--vllm-version=0.33

Before and after a change (``git worktree add /tmp/before <commit>`` with its own venv):

    .venv/bin/python scripts/bench_router_overhead.py --modes direct,bare,before,router \
        --before-python /tmp/before/.venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvrelay.bench.rawhttp import Conn
from kvrelay.bench.soak import Sample, stream_turn
from kvrelay.cluster.launcher import ServiceProcess, free_port_block

USER = "Please describe, in detail, how a river carves a canyon over a long time. " * 4
FOLLOW_UP = "Go on, and be specific about the rocks involved."


@dataclass
class ModeResult:
    mode: str
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)

    def pct(self, attr: str, q: float) -> float:
        values = sorted(getattr(s, attr) for s in self.samples)
        if not values:
            return float("nan")
        return float(values[min(len(values) - 1, int(q * len(values)))])


AGENT_PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}
RELAY_OF = {"bare": "bare", "before": "before", "redis": "redis-router"}
"""The process whose CPU a mode's relay column counts (the router's for every other mode)."""


async def agent_turn(conn: Conn, api: str, history: list[Any], max_tokens: int
                     ) -> tuple[list[Any], Sample]:
    """One streamed Responses or Messages turn through the router; D's answer in the API's
    form (to re-send) and the timings."""
    if api == "responses":
        body: dict[str, Any] = {"model": "tiny", "input": history, "store": False,
                                "max_output_tokens": max_tokens, "stream": True}
    else:
        body = {"model": "tiny", "messages": history, "max_tokens": max_tokens,
                "stream": True}
    started = time.perf_counter()
    raw, ttft, headers = await conn.stream_raw(AGENT_PATHS[api], body, started, b"delta")
    sample = Sample(ttft, time.perf_counter() - started, headers.get("x-kvrelay-action", ""))
    events = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n")
              if b"\ndata: " in block]
    if api == "responses":
        final = next(e for e in events if e.get("type") == "response.completed")
        return final["response"]["output"], sample
    text = "".join(e["delta"].get("text", "") for e in events
                   if e.get("type") == "content_block_delta")
    if not any(e.get("type") == "message_stop" for e in events):
        raise RuntimeError("messages stream ended without message_stop")
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}], sample


async def agent_conversation(ports: dict[str, int], api: str, idx: int, turns: int,
                             max_tokens: int, out: ModeResult) -> None:
    conn = Conn("127.0.0.1", ports["router"])
    history: list[Any] = [{"role": "user", "content": f"[{idx}] " + USER}]
    try:
        for _ in range(turns):
            try:
                answer, sample = await agent_turn(conn, api, history, max_tokens)
            except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError,
                    StopIteration, KeyError) as exc:
                out.errors += 1
                print(f"  {api} client {idx}: {exc!r}", file=sys.stderr)
                return
            out.samples.append(sample)
            history += [*answer, {"role": "user", "content": FOLLOW_UP}]
    finally:
        conn.close()


async def conversation(ports: dict[str, int], mode: str, idx: int, rnd: int, turns: int,
                       max_tokens: int, out: ModeResult) -> None:
    if mode in AGENT_PATHS:
        await agent_conversation(ports, mode, idx, turns, max_tokens, out)
        return
    if mode == "direct":
        conns = {name: Conn("127.0.0.1", ports[name]) for name in ("p", "d")}
    else:
        conns = {"router": Conn("127.0.0.1", ports[mode])}  # before, redis: like router
    conversation_id = f"c{rnd}-{idx}" if mode == "router+id" else None
    messages = [{"role": "user", "content": f"[{idx}] " + USER}]
    try:
        for _ in range(turns):
            try:
                text, sample = await stream_turn(conns, "direct" if mode == "direct" else "router",
                                                 messages, conversation_id, max_tokens)
            except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError) as exc:
                out.errors += 1
                print(f"  {mode} client {idx}: {exc!r}", file=sys.stderr)
                return
            out.samples.append(sample)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": FOLLOW_UP}]
    finally:
        for conn in conns.values():
            conn.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_mode(mode: str, ports: dict[str, int], args: argparse.Namespace, rnd: int,
                   result: ModeResult, pids: dict[str, int]) -> None:
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    await asyncio.gather(*(
        conversation(ports, mode, i, rnd, args.turns, args.max_tokens, result)
        for i in range(args.clients)))
    result.wall_s += time.perf_counter() - started
    for name, pid in pids.items():
        result.cpu_s[name] = result.cpu_s.get(name, 0.0) + cpu_s(pid) - before[name]


async def bench(ports: dict[str, int], args: argparse.Namespace,
                pids: dict[str, int]) -> list[ModeResult]:
    modes = args.modes.split(",")
    results = {m: ModeResult(m) for m in modes}
    warm = ModeResult("warmup")
    small = argparse.Namespace(**{**vars(args), "clients": 4})
    for mode in modes:  # warm code paths
        await run_mode(mode, ports, small, -1, warm, pids)
    for rnd in range(args.rounds):  # interleave modes so background noise hits all alike
        for mode in modes:
            await run_mode(mode, ports, args, rnd, results[mode], pids)
    return [results[m] for m in modes]


def report(results: list[ModeResult]) -> str:
    ms = 1000.0
    lines = ["| mode | requests | errors | req/s | TTFT p50 ms | TTFT p99 ms | "
             "e2e p50 ms | e2e p99 ms | relay CPU ms/req | redis CPU ms/req | "
             "engines CPU ms/req |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        n = max(1, len(r.samples))
        rps = len(r.samples) / r.wall_s if r.wall_s else 0.0
        lines.append(
            f"| {r.mode} | {len(r.samples)} | {r.errors} | {rps:.0f} | "
            f"{r.pct('ttft_s', 0.5) * ms:.1f} | {r.pct('ttft_s', 0.99) * ms:.1f} | "
            f"{r.pct('e2e_s', 0.5) * ms:.1f} | {r.pct('e2e_s', 0.99) * ms:.1f} | "
            f"{r.cpu_s.get(RELAY_OF.get(r.mode, 'router'), 0.0) * ms / n:.2f} | "
            f"{r.cpu_s.get('redis', 0.0) * ms / n:.2f} | "
            f"{r.cpu_s.get('engines', 0.0) * ms / n:.2f} |")
    base = results[0]
    lines += ["", "| added vs direct | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |",
              "|---|---|---|---|---|"]
    for r in results[1:]:
        cells = [(r.pct(a, q) - base.pct(a, q)) * ms
                 for a, q in (("ttft_s", 0.5), ("ttft_s", 0.99), ("e2e_s", 0.5),
                              ("e2e_s", 0.99))]
        lines.append(f"| {r.mode} | " + " | ".join(f"{c:+.1f}" for c in cells) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def redis_server(port: int, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``redis-server`` on loopback ``port``, no persistence, killed on exit (``make setup``
    installs it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("mode `redis` needs redis-server (make setup installs it)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def redis_calls(port: int, turns: int) -> str:
    """Redis commands per turn the ``redis`` mode's router sent (warm-up included in both),
    from Redis's own ``INFO commandstats``."""
    import redis  # the `redis` extra, installed by make setup

    stats = redis.Redis(port=port).info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()
             if name not in ("cmdstat_info", "cmdstat_ping", "cmdstat_client",
                             "cmdstat_hello", "cmdstat_select", "cmdstat_script")}
    per = ", ".join(f"{k} {v / max(1, turns):.2f}" for k, v in sorted(calls.items()))
    return f"redis calls per turn ({turns} turns): {per}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64, help="concurrent conversations")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every mode")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                    help="extra `kvrelay fake-engine` argument (repeatable)")
    ap.add_argument("--modes", default="direct,bare,router,router+id,responses,messages",
                    help="comma-separated modes to run (direct first: the baseline)")
    ap.add_argument("--before-python", type=Path, default=None,
                    help="another checkout's venv python: its router is mode `before`")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if ("before" in modes) != (args.before_python is not None):
        ap.error("mode `before` and --before-python go together")

    base = free_port_block(10, start=21000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    urls = {"p": f"http://127.0.0.1:{base}", "d": f"http://127.0.0.1:{base + 1}",
            "router": f"http://127.0.0.1:{base + 2}", "bare": f"http://127.0.0.1:{base + 4}"}
    with tempfile.TemporaryDirectory(prefix="kvrelay-overhead-") as tmp:
        engines = ServiceProcess(
            "fake-engines",
            [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill", "1", "--decode",
             "1", "--base-port", str(base), "--report-delay-s", "0", "--latency-preset", "fast",
             *args.engine_arg],
            [urls["p"] + "/health", urls["d"] + "/health"], Path(tmp) / "engines.log",
            ready_timeout_s=120, env=env)
        def route(name: str, python: str, port: int, *extra: str) -> ServiceProcess:
            return ServiceProcess(
                name,
                [python, "-m", "kvrelay.cli", "route", "--prefill", urls["p"], "--decode",
                 urls["d"], "--port", str(port), "--internal-port", str(port + 1),
                 "--block-size", "128",
                 # zero-latency engines make every recompute look free: keep pulling
                 "--pull-cost-factor", "0.001", "--log-level", "warning", *extra],
                [f"http://127.0.0.1:{port}/health"], Path(tmp) / f"{name}.log",
                ready_timeout_s=120, env=env)

        router = route("router", sys.executable, base + 2)
        before = route("before", str(args.before_python), base + 5) if args.before_python \
            else None
        shared = route("redis-router", sys.executable, base + 7, "--state",
                       f"redis://127.0.0.1:{base + 9}/0") if "redis" in modes else None
        bare = ServiceProcess(
            "bare",
            [sys.executable, "-m", "kvrelay.bench.bare_relay", "--prefill", urls["p"],
             "--decode", urls["d"], "--port", str(base + 4)],
            [urls["bare"] + "/health"], Path(tmp) / "bare.log", ready_timeout_s=120, env=env)
        with contextlib.ExitStack() as stack:
            redis = stack.enter_context(redis_server(base + 9, Path(tmp))) if shared else None
            for service in (engines, router, bare, before, shared):
                if service is not None:
                    stack.enter_context(service)
            assert engines.process and router.process and bare.process
            print(f"clients {args.clients}, turns {args.turns}, rounds {args.rounds}, "
                  f"max_tokens {args.max_tokens}, cpus {os.cpu_count()}", flush=True)
            ports = {"p": base, "d": base + 1, "router": base + 2, "router+id": base + 2,
                     "responses": base + 2, "messages": base + 2, "bare": base + 4,
                     "before": base + 5, "redis": base + 7}
            pids = {"router": router.process.pid, "engines": engines.process.pid,
                    "bare": bare.process.pid}
            if before is not None and before.process:
                pids["before"] = before.process.pid
            if shared is not None and shared.process and redis is not None:
                pids["redis-router"] = shared.process.pid
                pids["redis"] = redis.pid
            results = asyncio.run(bench(ports, args, pids))
            print(report(results))
            routers = {"router": urls["router"]}
            if shared is not None:
                routers["redis-router"] = f"http://127.0.0.1:{base + 7}"
            for name, url in routers.items():
                stats = httpx.get(url + "/stats").json()["decisions"]
                by_reason = re.sub(r"[{}']", "", str(stats["by_reason"]))
                print(f"\n{name} decisions: {by_reason}")
            if shared is not None:
                print(redis_calls(base + 9, sum(stats["by_reason"].values())))
            return 0 if all(r.errors == 0 for r in results) else 1

if __name__ == "__main__":
    sys.exit(main())
