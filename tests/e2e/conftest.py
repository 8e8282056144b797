"""One real local vLLM P/D cluster per test session, started with ``kvrelay up``.

Started with ``--monitoring``, so a Prometheus scrapes it all session. Starting it through the
CLI makes the whole session an end-to-end test of ``kvrelay up``:
teardown sends SIGINT and fails the session if the command does not exit 0 or leaves any
server process behind.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.client.sse import chunk_content, line_chunks
from kvrelay.cluster.config import ClusterConfig, block_size_of, router_command
from kvrelay.cluster.launcher import ServiceProcess
from tests.costs import PULL_PAYS, fixed_costs_flag
from tests.ports import free_port_block

STARTUP_TIMEOUT_S = 900
CPU_BLOCK_SIZE = block_size_of(ClusterConfig())
ADMIN_KEY = "e2e-admin-key"
"""The session router's admin key (``/admin/nodes`` shows engine ids)."""
TTL_S = 60
"""D's ``decoder_kv_blocks_ttl`` in the session cluster: short enough for a test to wait it
out (tests/e2e/test_contract.py), long enough for the router's pull window (TTL minus its
safety margins) to cover several turns."""


#: The vocabulary of the e2e agent conversations (``words``).
WORDS = "open read edit run test fail pass fix log trace diff merge lint type".split()


def words(n: int, rng: random.Random) -> str:
    """``n`` words of agent-like text drawn by ``rng`` (a seeded conversation repeats)."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class RealCluster:
    prefill_url: str
    decode_url: str
    router_url: str
    model: str
    run_dir: Path
    ttl_s: float
    #: The Prometheus ``kvrelay up --monitoring`` started beside the cluster.
    prometheus_url: str
    #: Every line ``kvrelay up`` has printed so far (appended to while the session runs).
    output: list[str] = field(default_factory=list)


def _reader(stream: object, lines: queue.Queue[str], output: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        output.append(line)
        lines.put(line)


@dataclass(frozen=True)
class UpSession:
    """A running ``kvrelay up``: the URLs it printed (``prefill-0``, ``decode-0``, ``router``,
    ``prometheus``, by name), its served model and every line of its output so far."""

    urls: dict[str, str]
    model: str
    output: list[str]


@contextlib.contextmanager
def kvrelay_up(args: list[str], ports: list[int]) -> Iterator[UpSession]:
    """``kvrelay up ARGS`` until the block ends: ready once it prints its model line; then
    SIGINT, and the test fails if the command does not exit 0 or a server process on one of
    ``ports`` (``--port N`` or ``127.0.0.1:N`` in its command line) outlives it."""
    cmd = [sys.executable, "-m", "kvrelay.cli", "up", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []
    threading.Thread(target=_reader, args=(proc.stdout, lines, output), daemon=True).start()
    seen: list[str] = []
    urls: dict[str, str] = {}
    model = ""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + 60
    while not model:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("kvrelay up did not start:\n" + "".join(seen[-60:]))
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(line)
        if m := re.match(r"\s*(prefill-0|decode-0|router|prometheus)\s+(http://\S+)", line):
            urls[m.group(1)] = m.group(2)
        if m := re.match(r"model (\S+); Ctrl-C to stop", line):
            model = m.group(1)
    yield UpSession(urls, model, output)

    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("kvrelay up did not stop within 120 s of SIGINT")
    leftovers = [
        p.pid for p in psutil.process_iter(["cmdline"])
        if any(f"--port {port}" in " ".join(p.info["cmdline"] or []) for port in ports)
        or any(f"127.0.0.1:{port}" in a for a in (p.info["cmdline"] or []) for port in ports)
    ]
    tail = "".join(output[-40:])
    assert rc == 0, f"kvrelay up exited with {rc}:\n{tail}"
    assert leftovers == [], f"server processes left after kvrelay up stopped: {leftovers}"


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    run_dir = tmp_path_factory.mktemp("cluster")
    base_port = free_port_block(2, start=18100)
    side_port = free_port_block(2, start=15600)
    router_port = free_port_block(2, start=18000)  # and its internal listener, port + 1
    prometheus_port = free_port_block(1, start=19090)
    args = ["--prefill", "1", "--decode", "1",
            "--base-port", str(base_port), "--side-channel-base-port", str(side_port),
            "--run-dir", str(run_dir), "--startup-timeout-s", str(STARTUP_TIMEOUT_S),
            "--router-port", str(router_port), "--ttl-s", str(TTL_S),
            "--monitoring", "--prometheus-port", str(prometheus_port),
            f"--router-arg=--admin-key={ADMIN_KEY}",
            f"--router-arg=--fixed-costs={FIXED_COSTS}",
            f"--router-arg=--gateway-id-header={GATEWAY_HEADER}"]
    with kvrelay_up(args, [base_port, base_port + 1, router_port, prometheus_port]) as up:
        yield RealCluster(up.urls["prefill-0"], up.urls["decode-0"], up.urls["router"],
                          up.model, run_dir, TTL_S, up.urls["prometheus"], up.output)


GATEWAY_HEADER = "x-gateway-conversation"
"""The session routers trust this header as a gateway's (``--gateway-id-header``): an id sent
in it is bound to one caller, so an edited history continues its conversation's latest entry
(a body ``conversation_id`` only narrows the scope: ``router.request``)."""

FIXED_COSTS = fixed_costs_flag(PULL_PAYS)
"""The tiny model prefills a 1k-token prompt in milliseconds, so costs learned from this
machine's timings may rightly prefer recomputing, more so while it is busy; these tests check
what a pull does (the cost model has its own unit and component tests), so their routers get
fixed costs under which every pull pays, never learned (``tests.costs``)."""


def start_extra_router(cluster: RealCluster, port: int, log_path: Path,
                       extra: list[str]) -> ServiceProcess:
    """Another ``kvrelay route`` in front of the session cluster's engines (as ``kvrelay up``
    starts its own, plus ``extra`` flags); the caller stops it."""
    cmd = router_command([cluster.prefill_url], [cluster.decode_url], host="127.0.0.1",
                         port=port, ttl_s=cluster.ttl_s, block_size=CPU_BLOCK_SIZE,
                         extra=["--fixed-costs", FIXED_COSTS, "--gateway-id-header", GATEWAY_HEADER,
                                *extra])
    url = f"http://127.0.0.1:{port}"
    return ServiceProcess(log_path.stem, cmd, [f"{url}/health"], log_path, url=url).start()


def chat(url: str, body: dict[str, object], headers: dict[str, str] | None = None
         ) -> tuple[str, httpx.Headers, dict[str, int]]:
    """POST ``body`` (with ``headers``) to ``url``'s chat endpoint, streamed when
    ``body["stream"]``: the answer's text, the response headers and the usage (the usage
    chunk's when streamed; ``{}`` if the stream had none). No ``kv_transfer_params`` (nor
    prompt ids) may reach the client."""
    endpoint = f"{url}/v1/chat/completions"
    if not body.get("stream"):
        resp = httpx.post(endpoint, json=body, headers=headers, timeout=300)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert "kv_transfer_params" not in data and "prompt_token_ids" not in data
        return data["choices"][0]["message"]["content"] or "", resp.headers, data["usage"]
    parts: list[str] = []
    usage: dict[str, int] = {}
    with httpx.stream("POST", endpoint, json=body, headers=headers, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in line_chunks(resp.iter_lines()):
            assert "kv_transfer_params" not in chunk
            parts.append(chunk_content(chunk))
            usage = chunk.get("usage") or usage
        return "".join(parts), resp.headers, usage


def p_external(cluster: RealCluster) -> float:
    """P's external-KV token counter (tokens it pulled) now."""
    return external_kv_tokens(parse_prometheus(
        httpx.get(f"{cluster.prefill_url}/metrics", timeout=30).text))
