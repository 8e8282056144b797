"""Does a header flood slow other clients down? (A benchmark, not a test; issue #12.)

Starts ``kvrelay fake-engine --prefill 1 --decode 1`` and ``kvrelay route`` in front of it,
each in its own process, then measures the time to first token (TTFT) of ``--clients``
clients streaming multi-turn conversations through the router, twice for ``--seconds``:

* ``quiet``: the clients alone;
* ``flood``: the same, while ``--flood-connections`` connections (from a process of their
  own) each send ``GET /health`` with one oversized header, in 64 KiB pieces, and open a new
  connection whenever the router answers or closes one (a router without a header limit
  gets the header ended after ``--flood-header-mib``).

With ``--pipelined`` (issue #23) each flooding connection first sends a streamed chat of
``--flood-chat-tokens`` tokens and, at once behind it on the same connection, the endless
header; it keeps sending until the router closes the connection (or the header reaches
``--flood-header-mib``), then reconnects. After the flood a ``chats`` phase, the control,
runs the same number of connections sending the same chats with nothing behind them, and
as many of them as the flood phase started (each flood chat is cut and reopened, so the
flood starts many more chats than connections): paced evenly over the phase, each read
until its first token and then closed by the client, as a cut one ends early. It tells
what the header costs from what the chats cost.

It prints TTFT p50/p99 of every phase side by side with the CPU seconds the router and the
fake engines' processes used in it (and the router's per measured turn), what the flood sent
and got back, and the acceptance check of issue #12: the flood phase's TTFT p99 within 2x of
the quiet phase's. ``--profile-router PATH`` runs the router under cProfile (slower: for
where its time goes, not for the figures) and prints its top functions. Run it holding the
heavy lock; numbers depend on the machine:

    flock /tmp/kvrelay-heavy.lock .venv/bin/python scripts/bench_header_flood.py
    flock /tmp/kvrelay-heavy.lock .venv/bin/python scripts/bench_header_flood.py --pipelined
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench.rawhttp import Conn
from kvrelay.bench.soak import FOLLOW_UPS, USER, Sample, stream_turn
from kvrelay.cluster.launcher import ServiceProcess, free_port_block

PIECE = b"f" * (64 * 1024)
FLOOD_HEAD = b"GET /health HTTP/1.1\r\nHost: flood\r\nX-Flood: "


def chat_request(max_tokens: int, close: bool = False) -> bytes:
    """A streamed chat request, head and body, for the pipelined flood (``close``: the
    control's, which the router closes once answered)."""
    body = json.dumps({"model": "tiny", "max_tokens": max_tokens, "stream": True,
                       "messages": [{"role": "user", "content": "[flood] " + USER}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: flood\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    name: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    flood: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds each process (``router``, ``engines``) used during the phase."""

    def pct(self, q: float) -> float:
        values = sorted(s.ttft_s for s in self.samples)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


async def client(port: int, idx: int, stop_at: float, turns: int, max_tokens: int,
                 phase: Phase) -> None:
    """Conversations of ``turns`` streamed turns, new ones until ``stop_at``."""
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < stop_at:
        conn = {"router": Conn("127.0.0.1", port)}
        messages = [{"role": "user", "content": f"[{phase.name} {idx}.{n}] " + USER}]
        try:
            for t in range(turns):
                if loop.time() >= stop_at:
                    break
                try:
                    text, sample = await stream_turn(conn, "router", messages,
                                                     f"{phase.name}-{idx}-{n}", max_tokens)
                except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError) as exc:
                    phase.errors.append(repr(exc))
                    break
                phase.samples.append(sample)
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
        finally:
            conn["router"].close()
        n += 1


async def clients(port: int, args: argparse.Namespace, phase: Phase) -> None:
    stop_at = asyncio.get_running_loop().time() + args.seconds
    await asyncio.gather(*(client(port, i, stop_at, args.turns, args.max_tokens, phase)
                           for i in range(args.clients)))


async def pipelined_connection(port: int, stop_at: float, header_bytes: int, chat_tokens: int,
                               stats: dict[str, int]) -> None:
    """One flooding client of ``--pipelined``: a streamed chat and, behind it at once, an
    endless header, until the router closes the connection; again on new connections."""
    loop = asyncio.get_running_loop()

    def count(key: str, n: int = 1) -> None:
        stats[key] = stats.get(key, 0) + n

    async def read_all(reader: asyncio.StreamReader) -> bytes:
        out = bytearray()
        while chunk := await reader.read(65536):
            out += chunk
        return bytes(out)

    while loop.time() < stop_at:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            count("connect_errors")
            await asyncio.sleep(0.01)
            continue
        count("connections")
        answers = asyncio.ensure_future(read_all(reader))
        sent = 0
        try:
            writer.write(chat_request(chat_tokens, close=not header_bytes)
                         + (FLOOD_HEAD if header_bytes else b""))
            while loop.time() < stop_at and not answers.done() and sent < header_bytes:
                writer.write(PIECE)
                await writer.drain()
                sent += len(PIECE)
            if not answers.done():
                if header_bytes:
                    count("open_at_the_end" if sent < header_bytes else "header_ended")
                if header_bytes and sent >= header_bytes:
                    writer.write(b"\r\n\r\n")
                await asyncio.wait_for(asyncio.shield(answers), max(0.1, stop_at - loop.time()))
        except TimeoutError:
            count("unanswered_at_the_end")
        except OSError:
            count("closed_by_router")
        finally:
            count("bytes", sent)
            if answers.done() and not answers.cancelled() and answers.exception() is None:
                got = answers.result()
                count("chat_streams_ended" if b"data: [DONE]" in got else "chat_streams_cut")
                count("HTTP 431", got.count(b"HTTP/1.1 431"))
            answers.cancel()
            writer.close()


async def control_connection(port: int, started_at: float, stop_at: float, chat_tokens: int,
                             chats: int, stats: dict[str, int]) -> None:
    """One connection of the ``chats`` control: the flood's chats without the header, as
    many over the phase as the flood started (``chats``, paced evenly across all control
    connections), each read until its first token and then closed, as a cut one ends
    early."""
    loop = asyncio.get_running_loop()
    every_s = (stop_at - started_at) / max(1, chats)

    def count(key: str, n: int = 1) -> None:
        stats[key] = stats.get(key, 0) + n

    while loop.time() < stop_at and stats.get("connections", 0) < chats:
        slot_at = started_at + stats.get("connections", 0) * every_s
        if slot_at > loop.time():
            await asyncio.sleep(slot_at - loop.time())
            continue
        count("connections")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            count("connect_errors")
            continue
        try:
            writer.write(chat_request(chat_tokens))
            got = b""
            while b"\ndata: " not in got:  # the first event's line, after a chunk size
                chunk = await asyncio.wait_for(reader.read(65536),
                                               max(0.1, stop_at - loop.time()))
                if not chunk:
                    break
                got += chunk
            count("first_tokens" if b"data: " in got else "no_first_token")
        except TimeoutError:
            count("unanswered_at_the_end")
        except OSError:
            count("closed_by_router")
        finally:
            writer.close()


async def flood_connection(port: int, stop_at: float, header_bytes: int,
                           stats: dict[str, int]) -> None:
    """One flooding client: a header of up to ``header_bytes`` (then ended, to see what the
    router answers), again and again on new connections."""
    loop = asyncio.get_running_loop()

    def count(key: str, n: int = 1) -> None:
        stats[key] = stats.get(key, 0) + n

    while loop.time() < stop_at:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            count("connect_errors")
            await asyncio.sleep(0.01)
            continue
        count("connections")
        answer = asyncio.ensure_future(reader.readline())
        sent = 0
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: flood\r\nX-Flood: ")
            while loop.time() < stop_at and not answer.done() and sent < header_bytes:
                writer.write(PIECE)
                await writer.drain()
                sent += len(PIECE)
            if not answer.done() and sent >= header_bytes:
                writer.write(b"\r\n\r\n")
                await asyncio.wait_for(asyncio.shield(answer), max(0.1, stop_at - loop.time()))
        except TimeoutError:
            count("unanswered_at_the_end")
        except OSError:
            count("closed_by_router" if not answer.done() else "closed_after_answer")
        finally:
            count("bytes", sent)
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                line = answer.result().split(b" ")
                count(f"HTTP {line[1].decode('latin-1') if len(line) > 1 else 'none'}")
            answer.cancel()
            writer.close()


def flood(port: int, seconds: float, connections: int, header_bytes: int, chat_tokens: int,
          chats: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """The flood, in a process of its own; puts its stats on ``out``. ``chat_tokens`` > 0:
    the pipelined flood, or with ``header_bytes`` 0 its control (``chats`` chats)."""

    async def run() -> dict[str, int]:
        stats: dict[str, int] = {}
        started_at = asyncio.get_running_loop().time()
        stop_at = started_at + seconds
        if chat_tokens > 0 and not header_bytes:
            await asyncio.gather(*(
                control_connection(port, started_at, stop_at, chat_tokens, chats, stats)
                for _ in range(connections)))
        elif chat_tokens > 0:
            await asyncio.gather(*(
                pipelined_connection(port, stop_at, header_bytes, chat_tokens, stats)
                for _ in range(connections)))
        else:
            await asyncio.gather(*(flood_connection(port, stop_at, header_bytes, stats)
                                   for _ in range(connections)))
        return stats

    out.put(asyncio.run(run()))


def report(quiet: Phase, flooded: Phase, args: argparse.Namespace,
           control: Phase | None = None) -> str:
    ms = 1000.0
    lines = ["| phase | turns | errors | TTFT p50 ms | TTFT p99 ms | router CPU s | "
             "router CPU ms / turn | engines CPU s |", "|---|---|---|---|---|---|---|---|"]
    for p in (quiet, *([control] if control else []), flooded):
        router_s = p.cpu.get("router", float("nan"))
        lines.append(f"| {p.name} | {len(p.samples)} | {len(p.errors)} | "
                     f"{p.pct(0.5) * ms:.1f} | {p.pct(0.99) * ms:.1f} | {router_s:.2f} | "
                     f"{router_s / max(1, len(p.samples)) * ms:.1f} | "
                     f"{p.cpu.get('engines', float('nan')):.2f} |")
    ratio = flooded.pct(0.99) / quiet.pct(0.99)
    sent = flooded.flood.get("bytes", 0) / (1024 * 1024)
    answers = {k: v for k, v in sorted(flooded.flood.items()) if k != "bytes"}
    verdict = "PASS" if ratio <= 2.0 and not flooded.errors else "FAIL"
    lines += [
        "",
        f"flood{' (pipelined behind a stream)' if args.pipelined else ''}: "
        f"{args.flood_connections} connections for {args.seconds:g} s sent "
        f"{sent:.0f} MiB of header; {answers}",
        f"TTFT p99 flood / quiet = {ratio:.2f} (issue #12 acceptance: <= 2.0) -> {verdict}",
    ]
    if control is not None:
        lines.append(f"TTFT p99 flood / chats = {flooded.pct(0.99) / control.pct(0.99):.2f} "
                     f"(the same chats without the header: what the header itself costs); "
                     f"chats: {dict(sorted(control.flood.items()))}")
    return "\n".join(lines)


@dataclass
class Pids:
    """The processes whose CPU each phase counts."""

    router: int
    engines: int

    def cpu(self) -> dict[str, float]:
        return {"router": cpu_s(self.router), "engines": cpu_s(self.engines)}


def measured(pids: Pids, phase: Phase, run: Callable[[], None]) -> None:
    """Run ``run()`` (a phase) and record each process's CPU seconds during it."""
    before = pids.cpu()
    run()
    after = pids.cpu()
    phase.cpu = {name: after[name] - before[name] for name in before}


def run_phase(port: int, args: argparse.Namespace, phase: Phase, header_bytes: int,
              chat_tokens: int, pids: Pids, chats: int = 0) -> None:
    """The clients while the flood (from a process of its own) runs; ``header_bytes`` 0
    with ``chat_tokens``: the pipelined flood's chats alone (``chats`` of them), the
    control."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    flooder = ctx.Process(target=flood, args=(port, args.seconds, args.flood_connections,
                                              header_bytes, chat_tokens, chats, out))
    flooder.start()
    started = time.monotonic()
    measured(pids, phase, lambda: asyncio.run(clients(port, args, phase)))
    phase.flood = out.get(timeout=args.seconds + 120)
    flooder.join(timeout=30)
    print(f"({phase.name} phase took {time.monotonic() - started:.1f} s)")


def print_profile(path: Path, top: int = 30) -> None:
    """The router's top functions by own time, then by cumulative time."""
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--clients", type=int, default=4, help="streaming clients")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--flood-connections", type=int, default=20)
    ap.add_argument("--flood-header-mib", type=float, default=64.0,
                    help="a flooding connection that got no answer ends its header after "
                         "this much (default 64 MiB), then starts again")
    ap.add_argument("--pipelined", action="store_true",
                    help="each flooding connection sends a streamed chat first and the "
                         "endless header behind it, at once (issue #23)")
    ap.add_argument("--flood-chat-tokens", type=int, default=256,
                    help="tokens of each pipelined flood's chat (default 256)")
    ap.add_argument("--latency-preset", default="cpu", choices=["fast", "cpu"],
                    help="the fake engines' simulated latency (default cpu)")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for kvrelay route (repeat)")
    ap.add_argument("--profile-router", type=Path, metavar="PATH",
                    help="run the router under cProfile, write its stats to PATH and print "
                         "its top functions (slower: not for the figures)")
    args = ap.parse_args()

    base = free_port_block(3, start=23000)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p_url, d_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    router_port = base + 2
    with tempfile.TemporaryDirectory(prefix="kvrelay-flood-") as tmp:
        engines = ServiceProcess(
            "fake-engines",
            [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill", "1", "--decode",
             "1", "--base-port", str(base), "--latency-preset", args.latency_preset],
            [p_url + "/health", d_url + "/health"], Path(tmp) / "engines.log",
            ready_timeout_s=120, env=env)
        router = ServiceProcess(
            "router",
            [sys.executable,
             *(["-m", "cProfile", "-o", str(args.profile_router)] if args.profile_router
               else []),
             "-m", "kvrelay.cli", "route", "--prefill", p_url, "--decode", d_url,
             "--port", str(router_port), "--block-size", "128", "--log-level", "warning",
             *args.router_arg],
            [f"http://127.0.0.1:{router_port}/health"], Path(tmp) / "router.log",
            ready_timeout_s=120, env=env)
        with engines, router:
            print(f"clients {args.clients}, turns {args.turns}, max_tokens {args.max_tokens}, "
                  f"{args.seconds:g} s per phase, flood {args.flood_connections} connections, "
                  f"latency {args.latency_preset}, cpus {os.cpu_count()}", flush=True)
            warm = Phase("warmup")
            asyncio.run(clients(router_port, argparse.Namespace(
                **{**vars(args), "seconds": min(2.0, args.seconds)}), warm))
            assert router.process is not None and engines.process is not None
            pids = Pids(router.process.pid, engines.process.pid)
            quiet = Phase("quiet")
            measured(pids, quiet, lambda: asyncio.run(clients(router_port, args, quiet)))
            header_bytes = int(args.flood_header_mib * 1024 * 1024)
            chat_tokens = args.flood_chat_tokens if args.pipelined else 0
            flooded = Phase("flood")
            run_phase(router_port, args, flooded, header_bytes, chat_tokens, pids)
            control = None
            if args.pipelined:
                control = Phase("chats")
                run_phase(router_port, args, control, 0, chat_tokens, pids,
                          chats=flooded.flood.get("connections", 0))
            print(report(quiet, flooded, args, control))
            alive = router.alive()
            if not alive:
                print("the router died during the flood", file=sys.stderr)
        if args.profile_router:
            print_profile(args.profile_router)
        return 0 if alive and not quiet.errors else 1


if __name__ == "__main__":
    sys.exit(main())
