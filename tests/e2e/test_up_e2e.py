"""``kvrelay up`` as an operator meets it: a D killed mid-stream comes back by itself while the
rest keeps serving, and a bad vLLM flag fails the start with vLLM's own message.

Written against the router's HTTP interface only (``X-KVRelay-*`` headers, ``/stats``,
``/metrics``), so it holds for any router that keeps that contract.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil
import pytest

from kvrelay.client.prometheus import parse_prometheus
from kvrelay.client.sse import sse_data
from tests.e2e.conftest import ADMIN_KEY, RealCluster, p_external
from tests.ports import free_port_block

pytestmark = pytest.mark.e2e

RECOVERY_DEADLINE_S = 600
#: Reasons for which a turn recomputes because the D holding its KV went away. A router that
#: drops a dead node's entries at once says ``no_entry`` instead; then its
#: ``entries_dropped_total`` says why.
NODE_LOST = ("node_down", "engine_restarted")


def turn(cluster: RealCluster, messages: list[Any], conversation_id: str,
         max_tokens: int = 12) -> tuple[str, str, int, float, str]:
    """One non-streamed turn: (action, reason, reused tokens, tokens P pulled, answer)."""
    before = p_external(cluster)
    resp = httpx.post(f"{cluster.router_url}/v1/chat/completions", timeout=300, json={
        "model": cluster.model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "conversation_id": conversation_id})
    assert resp.status_code == 200, resp.text
    h = resp.headers
    return (h["x-kvrelay-action"], h["x-kvrelay-reason"], int(h["x-kvrelay-reused-tokens"]),
            p_external(cluster) - before, resp.json()["choices"][0]["message"]["content"])


def dropped_because_node_lost(cluster: RealCluster) -> float:
    metrics = parse_prometheus(httpx.get(f"{cluster.router_url}/metrics", timeout=30).text)
    return sum(v for k, v in metrics.items()
               if k.startswith("kvrelay_router_entries_dropped_total")
               and any(f'reason="{r}"' in k for r in NODE_LOST))


def decode_node(cluster: RealCluster) -> dict[str, Any]:
    """D as the router's admin view shows it (engine id included)."""
    nodes: list[dict[str, Any]] = httpx.get(
        f"{cluster.router_url}/admin/nodes", timeout=30,
        headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()["nodes"]
    return next(n for n in nodes if n["role"] == "decode")


def server_pid(port: int) -> int:
    """The vLLM API server listening on ``port`` (the leader of its process group)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and f"{port}" in cmd:
            return int(p.pid)
    raise AssertionError(f"no vLLM server on port {port}")


def conversation(seed: str) -> list[Any]:
    return [{"role": "system", "content": f"You are agent {seed}. " + "Plan carefully. " * 40},
            {"role": "user", "content": "Fix the failing test in the repository."}]


def test_killed_decode_node_restarts_and_conversations_recover(real_cluster: RealCluster):
    c = real_cluster
    port = int(c.decode_url.rsplit(":", 1)[1])
    a_id, b_id = f"a-{secrets.token_hex(4)}", f"b-{secrets.token_hex(4)}"
    a, b = conversation("A"), conversation("B")

    # A: one finished turn, its KV retained on D when D dies.
    a1 = turn(c, a, a_id)
    assert a1[0] == "recompute"
    engine_before = decode_node(c)["engine_id"]
    assert engine_before
    dropped_before = dropped_because_node_lost(c)

    # B: D dies (kill -9 of its whole process group) in the middle of B's stream.
    events: list[str] = []
    with httpx.stream("POST", f"{c.router_url}/v1/chat/completions", timeout=300, json={
            "model": c.model, "messages": b, "max_tokens": 4000, "temperature": 0,
            "stream": True, "conversation_id": b_id}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            payload = sse_data(line)
            if payload is None:
                continue
            events.append(payload)
            if len(events) == 5:
                os.killpg(os.getpgid(server_pid(port)), signal.SIGKILL)
    assert len(events) > 5, "the stream ended before D was killed"
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2]), events[-3:]
    assert not any(e != "[DONE]" and "error" in json.loads(e) for e in events[:-2])

    # D comes back by itself (kvrelay up restarts it) and the router routes to it again.
    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    while not (any(line.startswith("decode-0: back") for line in c.output)
               and decode_node(c)["up"]):
        assert time.monotonic() < deadline, "".join(c.output[-30:])
        time.sleep(1.0)
    said = "".join(c.output)
    assert "decode-0: exited with status -9; restarting in" in said
    assert "decode-0: restarting (attempt 1/" in said
    assert "prefill-0:" not in said and "router:" not in said, "only D was restarted"
    log = (c.run_dir / "decode-0.log").read_text()
    assert "--- kvrelay up: decode-0: restarting (attempt 1/" in log

    # A's next turn cannot use the dead engine's blocks: it recomputes, and P pulls nothing.
    a += [{"role": "assistant", "content": a1[4]}, {"role": "user", "content": "Next step."}]
    a2 = turn(c, a, a_id)
    assert a2[0] == "recompute" and a2[2] == 0 and a2[3] == 0, a2
    assert a2[1] in NODE_LOST or (
        a2[1] == "no_entry" and dropped_because_node_lost(c) > dropped_before), a2
    # B retries its failed turn: nothing was retained for it, it recomputes too.
    b2 = turn(c, b, b_id)
    assert b2[0] == "recompute" and b2[2] == 0 and b2[3] == 0, b2

    # The turns after pull again, from the new engine, which the router has learned.
    a += [{"role": "assistant", "content": a2[4]}, {"role": "user", "content": "Then?"}]
    b += [{"role": "assistant", "content": b2[4]}, {"role": "user", "content": "Then?"}]
    for messages, conv in ((a, a_id), (b, b_id)):
        action, reason, reused, pulled, _ = turn(c, messages, conv)
        assert (action, reason) == ("pull", "pull") and reused > 0 and pulled == reused
    engine_after = decode_node(c)["engine_id"]
    assert engine_after and engine_after != engine_before


def test_invalid_engine_arg_fails_startup_with_vllms_message(tmp_path):
    base_port = free_port_block(2, start=28300)
    side_port = free_port_block(2, start=25800)
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "up", "--no-router",
         "--base-port", str(base_port), "--side-channel-base-port", str(side_port),
         "--run-dir", str(tmp_path), "--decode-engine-arg=--no-such-flag=3"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: decode-0 exited with status 2 during startup: ")
    assert first.endswith("error: unrecognized arguments: --no-such-flag=3")
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"])
                 if f"--port {base_port}" in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
