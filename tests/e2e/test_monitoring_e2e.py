"""``kvrelay up --monitoring`` on the real cluster: its Prometheus scrapes the router and the
real vLLM P and D, and the dashboard's P/D panels (written against vLLM's metric names, which
the fake engine copies) return data from real vLLM."""

from __future__ import annotations

import math
import secrets
import time

import httpx
import pytest

from kvrelay.deploy.panels import PANELS, VLLM_KV_CACHE_USAGE, VLLM_PROMPT_TOKENS_BY_SOURCE
from kvrelay.deploy.prometheus import PrometheusClient
from tests.e2e.conftest import RealCluster

pytestmark = pytest.mark.e2e

DEADLINE_S = 120.0


def test_prometheus_scrapes_router_and_real_engines(real_cluster: RealCluster):
    conversation = f"mon-{secrets.token_hex(4)}"
    messages: list[dict[str, str]] = [{"role": "user", "content": "Observe. " * 60}]
    for _ in range(2):
        resp = httpx.post(f"{real_cluster.router_url}/v1/chat/completions", timeout=300, json={
            "model": real_cluster.model, "messages": messages, "max_tokens": 8,
            "conversation_id": conversation})
        assert resp.status_code == 200
        messages += [{"role": "assistant", "content": resp.json()["choices"][0]["message"]
                      ["content"]}, {"role": "user", "content": "More."}]
    prometheus = PrometheusClient(real_cluster.prometheus_url)
    engine_queries = [q for p in PANELS for q in p.queries
                      if VLLM_PROMPT_TOKENS_BY_SOURCE in q.expr or VLLM_KV_CACHE_USAGE in q.expr]
    assert len(engine_queries) == 2
    deadline = time.monotonic() + DEADLINE_S
    while True:
        up = {s.labels["component"]: s.value for s in prometheus.query("up")}
        answers = [prometheus.query(q.for_prometheus("5m")) for q in engine_queries]
        components = [{s.labels.get("component") for s in a
                       if math.isfinite(s.value)} for a in answers]
        if up == {"router": 1.0, "prefill": 1.0, "decode": 1.0} and all(
                c == {"prefill", "decode"} for c in components):
            break
        assert time.monotonic() < deadline, (up, components)
        time.sleep(2.0)
    sources = {s.labels.get("source") for s in prometheus.query(
        f"sum by (source) ({VLLM_PROMPT_TOKENS_BY_SOURCE}{{component=\"prefill\"}})")}
    assert "external_kv_transfer" in sources, "P's pull of turn 2 shows in vLLM's metrics"
