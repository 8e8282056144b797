"""Draw docs/dashboard.png from a real local cluster: `kvrelay up --monitoring` with the
router's state in a local Redis, agent-style conversations through the router, one D killed
(kill -9 of its process group; `kvrelay up` restarts it) and one Redis outage, then the
dashboard's panels from Prometheus. Heavy: run it under the shared lock.

    flock /tmp/kvrelay-heavy.lock .venv/bin/python scripts/monitoring_demo.py --minutes 8
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from kvrelay.cluster.launcher import free_port, free_port_block
from kvrelay.deploy.dashboard_png import render_png
from kvrelay.deploy.prometheus import PrometheusClient

WORDS = "open read edit run test fail pass fix log trace diff merge lint type build".split()


def start_up(run_dir: Path, redis_url: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    base, side = free_port_block(2, start=38100), free_port_block(2, start=35600)
    cmd = [sys.executable, "-m", "kvrelay.cli", "up", "--monitoring",
           "--base-port", str(base), "--side-channel-base-port", str(side),
           "--router-port", str(free_port()), "--prometheus-port", str(free_port()),
           "--run-dir", str(run_dir), f"--router-arg=--state={redis_url}",
           "--router-arg=--health-interval-s=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print("  up|", line, end="", flush=True)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    urls: dict[str, str] = {}
    while "model" not in urls:
        line = lines.get(timeout=900)
        if m := re.match(r"\s*(prefill-0|decode-0|router|prometheus)\s+(http://\S+)", line):
            urls[m.group(1)] = m.group(2)
        if m := re.match(r"model (\S+); Ctrl-C to stop", line):
            urls["model"] = m.group(1)
        if proc.poll() is not None:
            raise SystemExit("kvrelay up exited")
    return proc, urls


def converse(router: str, model: str, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        conversation = f"demo-{seed}-{rng.randrange(10**6)}"
        messages = [{"role": "system", "content": "You are a coding agent. "
                     + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(150, 600)))},
                    {"role": "user", "content": "Fix the build."}]
        for _ in range(rng.randrange(3, 8)):
            if stop.is_set():
                return
            try:
                with httpx.stream("POST", f"{router}/v1/chat/completions", timeout=120, json={
                        "model": model, "messages": messages, "max_tokens": 24,
                        "stream": True, "conversation_id": conversation}) as resp:
                    resp.read()
            except httpx.HTTPError:
                pass
            messages += [{"role": "assistant", "content": "done " * 6},
                         {"role": "user", "content": "Tool output: "
                          + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 120)))}]
            stop.wait(rng.uniform(0.5, 3.0))


def kill_decode(port: int) -> None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and str(port) in cmd:
            os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            print(f"killed D (pid {p.pid})", flush=True)
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = ap.parse_args()
    redis_binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    work = Path(tempfile.mkdtemp(prefix="kvrelay-monitoring-demo-"))
    redis_port = free_port()
    redis_cmd = [redis_binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(work)]
    redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)
    up, urls = start_up(work / "cluster", f"redis://127.0.0.1:{redis_port}/0")
    started = time.time()
    stop = threading.Event()
    clients = [threading.Thread(target=converse, args=(urls["router"], urls["model"], i, stop))
               for i in range(args.clients)]
    for c in clients:
        c.start()
    total_s = args.minutes * 60
    try:
        time.sleep(total_s * 0.3)
        kill_decode(int(urls["decode-0"].rsplit(":", 1)[1]))
        time.sleep(total_s * 0.3)
        redis.kill()
        redis.wait()
        print("redis stopped", flush=True)
        time.sleep(min(30.0, total_s * 0.1))
        redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)
        print("redis started", flush=True)
        time.sleep(max(0.0, started + total_s - time.time()))
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=150)
    time.sleep(6)  # one more scrape
    render_png(PrometheusClient(urls["prometheus"]), args.out, started, time.time(),
               max(2.0, total_s / 300), "1m",
               title=f"kvrelay up --monitoring: 1 P + 1 D ({urls['model']}, CPU), "
                     f"{args.clients} agent clients, D killed at {total_s * 0.3 / 60:.1f} min, "
                     f"Redis down at {total_s * 0.6 / 60:.1f} min")
    print(f"wrote {args.out}", flush=True)
    up.send_signal(signal.SIGINT)
    up.wait(timeout=120)
    redis.kill()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
