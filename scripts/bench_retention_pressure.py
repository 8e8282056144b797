"""Retention under memory pressure on the real cluster (issue #21, Acceptance 1).

A D whose KV cache holds 3,072 tokens (24 blocks of 128), six new single-turn conversations
one after the other (~1,500 prompt tokens each, none continued: abandoned agent sessions),
then a follow-up of the last one. Each retained turn holds ~12 of D's 24 blocks, so with
vLLM's stock retention the second conversation already waits for the first one's TTL.
Run three ways in one sitting, each on its own ``kvrelay up``:

* ``managed``: kvrelay's connector releases retained turns under pressure;
* ``stock``: ``--retention stock`` (vLLM's global TTL only);
* ``no-bidirectional``: no retention at all (the latency baseline).

Goal: with ``managed`` no request takes more than 2x its latency with ``no-bidirectional``,
and the last conversation's follow-up still pulls. A request that takes longer than the
client timeout (60 s) counts as stalled. Not a test (timings are the machine's); the e2e
test ``tests/e2e/test_retention_pressure_e2e.py`` asserts the behaviour.

    flock /tmp/kvrelay-vllm.lock .venv/bin/python scripts/bench_retention_pressure.py \\
        --json /tmp/retention-pressure.json

Each mode costs one cluster start (30-90 s); ``stock`` also waits out its stalls (up to
four client timeouts).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvrelay.bench.tokens import filler_words
from kvrelay.bench.trace_replay import REPLAY_FIXED_COSTS
from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.cluster.launcher import free_port_block

MODES = ("managed", "stock", "no-bidirectional")
MODE_FLAGS = {"managed": ["--retention", "managed"], "stock": ["--retention", "stock"],
              "no-bidirectional": ["--no-bidirectional"]}
CLUSTER_FLAGS = ["--max-model-len", "2048", "--ttl-s", "120",
                 "--decode-engine-arg=--num-gpu-blocks-override=24",
                 # The router learns that D runs kvrelay's connector from D's first answer
                 # (guard auto); until then its decode requests carry no retention URL, and a
                 # turn without one is never released early: the first conversation would
                 # pin half of D until the TTL. kvrelay up runs kvrelay's connector on every
                 # node, so the router is told.
                 "--router-arg=--guard=connector",
                 # Pull vs recompute from costs fixed so that a pull pays, not learned from
                 # this machine's timings: on the tiny model a recompute is as fast as a pull,
                 # and learned costs can make the follow-up recompute (``cost_model``) with
                 # its blocks still on D, which says nothing about retention.
                 f"--router-arg=--fixed-costs={REPLAY_FIXED_COSTS}"]


@dataclass
class Request:
    name: str
    seconds: float
    stalled: bool
    prompt_tokens: int = 0
    action: str = ""
    reason: str = ""
    reused_tokens: int = 0


@dataclass
class Run:
    mode: str
    requests: list[Request] = field(default_factory=list)
    pulled_tokens: float = 0.0
    """P's external-KV tokens counter over the follow-up (what P pulled from D)."""
    decode_log_releases: int = 0
    """Lines of D's log where kvrelay's connector released a retained request."""


def prompt(seed: int, num_tokens: int, words: Sequence[str]) -> list[dict[str, object]]:
    """A new agent conversation whose user message is ``num_tokens`` tokens of ``words``
    (``kvrelay.bench.tokens.filler_words``: each word one token), plus the template's."""
    rng = random.Random(seed)
    text = "".join(rng.choice(words) for _ in range(num_tokens))
    return [{"role": "system", "content": f"You are coding agent {seed}."},
            {"role": "user", "content": text}]


def chat(router: str, model: str, messages: list[dict[str, object]], name: str,
         timeout_s: float, max_tokens: int) -> tuple[Request, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0}
    start = time.monotonic()
    try:
        resp = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=timeout_s)
    except httpx.TimeoutException:
        return Request(name, time.monotonic() - start, stalled=True), ""
    seconds = time.monotonic() - start
    resp.raise_for_status()
    data = resp.json()
    return Request(
        name, seconds, stalled=False, prompt_tokens=int(data["usage"]["prompt_tokens"]),
        action=resp.headers.get("X-KVRelay-Action", ""),
        reason=resp.headers.get("X-KVRelay-Reason", ""),
        reused_tokens=int(resp.headers.get("X-KVRelay-Reused-Tokens", "0") or 0),
    ), str(data["choices"][0]["message"]["content"] or "")


@dataclass(frozen=True)
class Cluster:
    router: str
    prefill: str
    decode: str
    model: str
    run_dir: Path


@contextmanager
def cluster(mode: str, run_dir: Path, extra: Sequence[str] = (),
            startup_timeout_s: float = 900) -> Iterator[Cluster]:
    """``kvrelay up`` for ``mode``; stopped with SIGINT on exit."""
    base = free_port_block(2, start=18300)
    side = free_port_block(2, start=15800)
    router_port = free_port_block(2, start=18400)
    cmd = [sys.executable, "-m", "kvrelay.cli", "up", "--prefill", "1", "--decode", "1",
           "--base-port", str(base), "--side-channel-base-port", str(side),
           "--router-port", str(router_port), "--run-dir", str(run_dir),
           "--startup-timeout-s", str(startup_timeout_s), *CLUSTER_FLAGS,
           *MODE_FLAGS[mode], *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    urls: dict[str, str] = {}
    model = ""
    deadline = time.monotonic() + startup_timeout_s + 60
    try:
        while not model:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("kvrelay up did not start:\n" + "".join(output[-60:]))
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if m := re.match(r"\s*(prefill-0|decode-0|router)\s+(http://\S+)", line):
                urls[m.group(1)] = m.group(2)
            if m := re.match(r"model (\S+); Ctrl-C to stop", line):
                model = m.group(1)
        yield Cluster(urls.get("router", ""), urls["prefill-0"], urls["decode-0"], model,
                      run_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def p_pulled_tokens(prefill_url: str) -> float:
    return external_kv_tokens(parse_prometheus(
        httpx.get(f"{prefill_url}/metrics", timeout=30).text))


def scenario(c: Cluster, mode: str, *, conversations: int, prompt_tokens: int,
             timeout_s: float, max_tokens: int) -> Run:
    """Six new conversations one after another, then a follow-up of the last one."""
    run = Run(mode)
    words = filler_words(c.model)
    last: tuple[list[dict[str, object]], str] | None = None
    for i in range(conversations):
        messages = prompt(seed=1000 + i, num_tokens=prompt_tokens, words=words)
        request, answer = chat(c.router, c.model, messages, f"conversation {i + 1}",
                               timeout_s, max_tokens)
        run.requests.append(request)
        last = (messages, answer)
    assert last is not None
    messages, answer = last
    follow_up: list[dict[str, object]] = [
        *messages, {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now run the tests."}]
    before = p_pulled_tokens(c.prefill)
    request, _ = chat(c.router, c.model, follow_up, "follow-up", timeout_s, max_tokens)
    run.requests.append(request)
    run.pulled_tokens = p_pulled_tokens(c.prefill) - before
    run.decode_log_releases = sum(
        "kvrelay: released retained request" in line
        for line in (c.run_dir / "decode-0.log").read_text(errors="replace").splitlines())
    return run


def summary(runs: list[Run]) -> str:
    base = {r.name: r.seconds for run in runs if run.mode == "no-bidirectional"
            for r in run.requests}
    out = []
    for run in runs:
        out.append(f"{run.mode}: pulled {run.pulled_tokens:.0f} tokens on the follow-up; "
                   f"{run.decode_log_releases} releases in D's log")
        for r in run.requests:
            ratio = f" ({r.seconds / base[r.name]:.1f}x)" if base.get(r.name) else ""
            out.append(f"  {r.name:15s} {'STALLED' if r.stalled else 'ok':7s} "
                       f"{r.seconds:7.2f} s{ratio}  {r.prompt_tokens:5d} prompt tokens  "
                       f"{r.action}/{r.reason} reused {r.reused_tokens}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=1450,
                        help="user message length (about 1,500 prompt tokens with the template)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="client timeout")
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/kvrelay-retention-bench"))
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = parser.parse_args(argv)
    runs: list[Run] = []
    for mode in args.modes:
        run_dir = args.run_dir / mode
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"== {mode}: starting kvrelay up ...", file=sys.stderr, flush=True)
        with cluster(mode, run_dir) as c:
            runs.append(scenario(c, mode, conversations=args.conversations,
                                 prompt_tokens=args.prompt_tokens, timeout_s=args.timeout_s,
                                 max_tokens=args.max_tokens))
        print(summary(runs[-1:]), file=sys.stderr, flush=True)
    print(summary(runs))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(run) for run in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
