"""``python -m kvrelay.cli route`` as a subprocess in front of in-process fake engines:
``serve()`` with its lifespan (health loop), reports over loopback to the internal listener,
the prefix guard in the engines' connector, clean exit on SIGINT."""

from __future__ import annotations

import asyncio
import signal
import sys

import httpx

from kvrelay.client.sse import sse_events
from kvrelay.fakevllm import FakeCluster
from tests.component.router_fake import ENGINE_CONFIG
from tests.component.router_rig import stream_text
from tests.costs import fixed_costs_flag
from tests.ports import free_ports

FIRST = "What is the capital of France, and why? " * 8


async def wait_healthy(url: str, proc: asyncio.subprocess.Process) -> None:
    async with httpx.AsyncClient(trust_env=False) as c:
        for _ in range(300):
            if proc.returncode is not None:
                raise AssertionError(f"router exited with {proc.returncode}")
            try:
                if (await c.get(url + "/health", timeout=1.0)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("router never became healthy")


async def test_route_subprocess_serves_pulls_and_stops_on_sigint() -> None:
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster:
        port, internal = free_ports(2)
        url = f"http://127.0.0.1:{port}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay.cli", "route",
            "--prefill", cluster.prefill_urls[0], "--decode", cluster.decode_urls[0],
            "--port", str(port), "--internal-port", str(internal), "--block-size", "128",
            "--health-interval-s", "0.2", "--log-level", "warning",
            "--fixed-costs", fixed_costs_flag(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await wait_healthy(url, proc)
            messages = [{"role": "user", "content": FIRST}]
            async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as c:
                for follow_up in ("Tell me more.", "And Germany?"):
                    resp = await c.post("/v1/chat/completions", json={
                        "messages": messages, "max_tokens": 12, "stream": True,
                        "conversation_id": "cli"})
                    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
                    await cluster.drain_reports()
                    text = stream_text(sse_events(resp.text))
                    messages += [{"role": "assistant", "content": text},
                                 {"role": "user", "content": follow_up}]
                for _ in range(100):  # the report reached the router subprocess
                    if (await c.get("/stats")).json()["pending_reports"] == 0:
                        break
                    await asyncio.sleep(0.02)
                resp = await c.post("/v1/chat/completions", json={
                    "messages": messages, "max_tokens": 12, "conversation_id": "cli"})
                assert resp.status_code == 200
                stats = (await c.get("/stats")).json()
                assert [d["reason"] for d in stats["decisions"]["recent"]] == [
                    "no_entry", "pull", "pull"]
                # kvrelay's connector on both nodes: P proved the pulls (verified_tokens
                # from P), the router had no token ids (exact: false; no /tokenize)
                assert stats["guard"] == {"mode": "auto", "nodes": {
                    "prefill-0": "connector", "decode-0": "connector"}}
                assert [d["exact"] for d in stats["decisions"]["recent"]] == [False] * 3
                assert all(d["verified_tokens"] > 0 for d in stats["decisions"]["recent"][1:])
                metrics = (await c.get("/metrics")).text
                assert 'kvrelay_router_node_up{node="decode-0",role="decode"} 1.0' in metrics
                if ENGINE_CONFIG.vllm_version == "0.32":
                    assert 'kvrelay_router_reports_total{outcome="matched"} 2.0' in metrics
                else:  # 0.33: D's stream carries its params, so only turn 1 (before the
                    # router saw one such stream) asked for a report; it races the stream's
                    # final event (D knows its engine from the start: the report may win)
                    reports = [line for line in metrics.splitlines()
                               if line.startswith("kvrelay_router_reports_total{")]
                    assert reports in (
                        ['kvrelay_router_reports_total{outcome="late"} 1.0'],
                        ['kvrelay_router_reports_total{outcome="matched"} 1.0'])
                # D's reports go to the internal listener only
                assert (await c.post("/internal/kv-report", json={})).status_code == 404
                internal_health = await c.get(f"http://127.0.0.1:{internal}/health")
                assert internal_health.json() == {"status": "ok"}
            cluster.decode[0].faults.unhealthy = True  # the health loop notices by itself
            async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as c:
                for _ in range(200):
                    stats = (await c.get("/stats")).json()
                    if not stats["nodes"][1]["up"]:
                        break
                    await asyncio.sleep(0.05)
                assert stats["nodes"][1]["up"] is False
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
        log = out.decode(errors="replace")
        assert proc.returncode == 0, log[-2000:]
        assert (f"kvrelay router on {url} (reports on http://127.0.0.1:{internal}"
                "/internal/kv-report, prefix guard auto)") in log
