"""A real Prometheus (Debian's ``prometheus``) scraping a real router (shared state in a real
Redis) in front of fake P/D engines: after a short multi-turn run with an upstream error and a
Redis outage, every query of the dashboard returns data, so no panel refers to a metric, label
or PromQL function that does not exist. The same data renders into the dashboard PNG."""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay.cli import main
from kvrelay.cluster.cli import router_scrape_targets
from kvrelay.cluster.config import router_command
from kvrelay.cluster.launcher import ServiceProcess
from kvrelay.core.retention_sync import RETENTION_PATH, RetentionSync, encode
from kvrelay.deploy.dashboard_png import render_png
from kvrelay.deploy.panels import (
    RETAINED_TOKENS,
    TURN_DECISIONS,
    VLLM_PROMPT_TOKENS_BY_SOURCE,
    Query,
    all_queries,
)
from kvrelay.deploy.prometheus import (
    PrometheusClient,
    ScrapeTarget,
    find_prometheus,
    prometheus_service,
)
from kvrelay.router.config import derived_tag_key
from kvrelay.router.retention import sync_token
from tests.component.redis_server import RedisServer
from tests.costs import fixed_costs_flag
from tests.ports import free_port_block, free_ports

RATE_WINDOW = "2m"
SCRAPE_INTERVAL_S = 1.0
ROUNDS = 4
DATA_DEADLINE_S = 90.0
GATEWAY_HEADER = "x-gateway-conversation"
TAG_KEY = "monitoring-test-tag-key"
RETAINED_QUERY = f"max by (node) ({RETAINED_TOKENS})"


def prometheus_binary() -> str:
    found = find_prometheus()
    if found is None:
        pytest.fail("prometheus not found: install the Debian package prometheus "
                    "(`make setup` does when run as root)", pytrace=False)
    return found


class Rig:
    def __init__(self, router: str, internal: str, prefill: str, decode: str,
                 prometheus: str) -> None:
        self.router, self.internal, self.prefill, self.decode = router, internal, prefill, decode
        self.prometheus = PrometheusClient(prometheus)

    def sync(self, engine_id: str, round_: int) -> None:
        """A retention sync of D's (written here; an engine with kvrelay's retention sends its
        own) whose releases grow each round, so the retention panels have data."""
        body = encode(RetentionSync(
            engine_id=engine_id, block_size=128, bytes_per_block=1 << 20,
            num_blocks_total=256, num_blocks_free=200 - round_, retained_requests=round_ + 1,
            retained_blocks=round_ + 4, retained_tokens=(round_ + 4) * 128,
            releases_total={"pressure": round_, "router": 2 * round_, "expired": 0}))
        token = sync_token(derived_tag_key(TAG_KEY), "decode-0", self.decode)  # as D is told
        resp = httpx.post(f"{self.internal}{RETENTION_PATH}/{token}", content=body, timeout=10)
        assert resp.status_code == 200, resp.text

    def turn(self, messages: list[dict[str, str]], conversation_id: str,
             stream: bool) -> tuple[int, str]:
        # The history carries a made-up answer ("ok"), so only an id bound to one caller
        # (a gateway header) continues the conversation's entry (docs/security.md).
        body = {"model": "tiny", "messages": messages, "max_tokens": 8, "stream": stream}
        with httpx.stream("POST", f"{self.router}/v1/chat/completions", json=body,
                          headers={GATEWAY_HEADER: conversation_id}, timeout=60) as resp:
            resp.read()
            return resp.status_code, resp.headers.get("x-kvrelay-action", "")


def fake_engines(tmp_path: Path, base_start: int, side_start: int) -> tuple[ServiceProcess, int]:
    """One fake P and one fake D (fast latency, reports at once) on free ports from
    ``base_start`` (HTTP) and ``side_start`` (side channels); returns them and P's port."""
    base = free_port_block(2, start=base_start)
    side = free_port_block(2, start=side_start)
    return ServiceProcess(
        "fake-engines",
        [sys.executable, "-m", "kvrelay.cli", "fake-engine", "--prefill", "1", "--decode", "1",
         "--base-port", str(base), "--side-channel-base-port", str(side),
         "--latency-preset", "fast", "--report-delay-s", "0"],
        [f"http://127.0.0.1:{base}/health", f"http://127.0.0.1:{base + 1}/health"],
        tmp_path / "engines.log", ready_timeout_s=120), base


@pytest.fixture
def rig(tmp_path: Path, redis_server: RedisServer) -> Iterator[Rig]:
    binary = prometheus_binary()
    engines, base = fake_engines(tmp_path, 31000, 33000)
    prefill, decode = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    router_port, internal_port, prometheus_port = free_ports(3)
    router_url = f"http://127.0.0.1:{router_port}"
    router = ServiceProcess(
        "router",
        router_command([prefill], [decode], host="127.0.0.1", port=router_port, ttl_s=480,
                       block_size=128, internal_port=internal_port,
                       extra=["--state", redis_server.url, "--health-interval-s", "1",
                              "--state-timeout-ms", "500", "--fixed-costs", fixed_costs_flag(),
                              "--gateway-id-header", GATEWAY_HEADER, "--tag-key", TAG_KEY]),
        [f"{router_url}/health"], tmp_path / "router.log", url=router_url)
    # the router's target as `kvrelay up --monitoring` picks it (its internal listener: an
    # open public /metrics leaves out the request-size series, docs/security.md)
    targets = [ScrapeTarget("prefill", prefill), ScrapeTarget("decode", decode),
               *router_scrape_targets(router)]
    prometheus = prometheus_service(binary, targets, tmp_path / "prometheus", "127.0.0.1",
                                    prometheus_port, interval_s=SCRAPE_INTERVAL_S)
    with engines, router, prometheus:
        assert prometheus.url is not None
        yield Rig(router_url, f"http://127.0.0.1:{internal_port}", prefill, decode,
                  prometheus.url)
    shutil.rmtree(tmp_path / "prometheus", ignore_errors=True)


def drain(rig: Rig, pending: dict[str, Query], must: str | None = None) -> None:
    """Drop from ``pending`` every query that returns data; poll until ``must`` (an expr)
    has data or the deadline passes."""
    deadline = time.monotonic() + DATA_DEADLINE_S
    while pending and time.monotonic() < deadline:
        for expr, query in list(pending.items()):
            samples = rig.prometheus.query(query.for_prometheus(RATE_WINDOW))
            if finite([s.value for s in samples]):
                del pending[expr]
        if must is not None and must not in pending:
            return
        time.sleep(1.0)


def run_traffic(rig: Rig, redis_server: RedisServer, pending: dict[str, Query]) -> None:
    """Multi-turn conversations, streamed and not (pulls and recomputes), one D failure and
    one Redis outage. Spread over several scrapes: ``rate()`` sees a counter grow only between
    two samples, and a series is born at its first value."""
    deadline = time.monotonic() + DATA_DEADLINE_S
    while len([s for s in rig.prometheus.query("up") if s.value == 1.0]) < 3:
        assert time.monotonic() < deadline, "Prometheus never scraped all three targets"
        time.sleep(0.5)
    conversations: list[list[dict[str, str]]] = []
    engine_id = httpx.get(f"{rig.decode}/fake/info", timeout=10).json()["engine_id"]
    for round_ in range(ROUNDS):
        # Each round starts a conversation (a recompute) and continues the others (pulls).
        conversations.append([
            {"role": "system", "content": f"You are agent {round_}. " + "Think. " * 60},
            {"role": "user", "content": "Start."}])
        for c, messages in enumerate(conversations):
            status, _ = rig.turn(messages, f"conv-{c}", stream=c != round_ - 1)
            assert status == 200
            messages += [{"role": "assistant", "content": "ok"},
                         {"role": "user", "content": f"Round {round_}."}]
        rig.sync(engine_id, round_)  # (the router knows D's engine id from its answers now)
        time.sleep(SCRAPE_INTERVAL_S * 1.5)
    # The router's retained-tokens gauge is read from Redis, which the outage below empties
    # (the series then goes stale): its panel is checked while the entries are live.
    drain(rig, pending, must=RETAINED_QUERY)
    httpx.post(f"{rig.decode}/fake/faults", json={"error_status": 500, "error_count": 1},
               timeout=10).raise_for_status()
    rig.turn([{"role": "user", "content": "Fail once. " * 40}], "conv-fault", stream=True)
    redis_server.stop()
    status, action = rig.turn([{"role": "user", "content": "No Redis. " * 40}],
                              "conv-0", stream=False)
    assert (status, action) == (200, "recompute")
    redis_server.start()


def finite(values: list[float]) -> bool:
    return any(math.isfinite(v) for v in values)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(rig, redis_server,
                                                                    tmp_path):
    started = time.time()
    pending = {q.expr: q for _, q in all_queries()}
    assert RETAINED_QUERY in pending
    run_traffic(rig, redis_server, pending)
    exported = httpx.get(f"{rig.internal}/metrics", timeout=10).text
    assert RETAINED_TOKENS in exported
    drain(rig, pending)
    assert not pending, "dashboard queries without data:\n" + "\n".join(
        f"{expr}\n  -> {rig.prometheus.query(q.for_prometheus(RATE_WINDOW))}"
        for expr, q in pending.items())

    # The P/D panels show both roles; the decisions panel both actions.
    components = {s.labels.get("component") for s in rig.prometheus.query(
        f"sum by (component) (rate({VLLM_PROMPT_TOKENS_BY_SOURCE}[{RATE_WINDOW}]))")}
    assert components == {"prefill", "decode"}
    actions = {s.labels["action"] for s in rig.prometheus.query(
        f"sum by (action) ({TURN_DECISIONS})")}
    assert {"pull", "recompute"} <= actions

    out = tmp_path / "dashboard.png"
    render_png(rig.prometheus, out, started - 30, time.time(), 2.0, RATE_WINDOW)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_prometheus_config_scrapes_a_key_locked_public_metrics(tmp_path):
    """``kvrelay deploy prometheus-config --router PUBLIC --router-metrics-key-file F``
    against a router whose public /metrics needs ``--metrics-key``: the real Prometheus it
    configures scrapes the router (with the key) and gets the request-size series."""
    binary = prometheus_binary()
    engines, base = fake_engines(tmp_path, 35000, 37000)
    router_port, internal_port, prometheus_port = free_ports(3)
    router_url = f"http://127.0.0.1:{router_port}"
    router = ServiceProcess(
        "router",
        router_command([f"http://127.0.0.1:{base}"], [f"http://127.0.0.1:{base + 1}"],
                       host="127.0.0.1", port=router_port, ttl_s=480, block_size=128,
                       internal_port=internal_port,
                       extra=["--metrics-key", "prom-secret", "--fixed-costs",
                              fixed_costs_flag()]),
        [f"{router_url}/health"], tmp_path / "router.log", url=router_url)
    key_file = tmp_path / "router-metrics.key"
    key_file.write_text("prom-secret\n")
    config = tmp_path / "prometheus.yml"
    assert main(["deploy", "prometheus-config", "--router", router_url,
                 "--router-metrics-key-file", str(key_file), "--interval-s", "1",
                 "-o", str(config)]) == 0
    prometheus_url = f"http://127.0.0.1:{prometheus_port}"
    prometheus = ServiceProcess(
        "prometheus",
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prometheus_port}"],
        [f"{prometheus_url}/-/ready"], tmp_path / "prometheus.log", url=prometheus_url)
    with engines, router, prometheus:
        assert httpx.get(f"{router_url}/metrics", timeout=10).status_code == 401, \
            "the public /metrics is locked (else this test proves nothing)"
        resp = httpx.post(f"{router_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Count to three."}]})
        assert resp.status_code == 200, resp.text
        client = PrometheusClient(prometheus_url)
        deadline = time.monotonic() + DATA_DEADLINE_S
        while not client.query('kvrelay_router_prompt_tokens_total{component="router"}'):
            assert time.monotonic() < deadline, (
                f"Prometheus never got the router's size series: up = "
                f"{[(s.labels, s.value) for s in client.query('up')]}")
            time.sleep(0.5)
    shutil.rmtree(tmp_path / "data", ignore_errors=True)
