"""Two router replicas sharing a real Redis in front of the real local cluster: a
conversation whose turns alternate between the replicas pulls on every turn after the first,
and P pulls exactly what the replicas report as reused."""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.cluster.launcher import ServiceProcess
from tests.component.redis_server import RedisServer, redis_binary
from tests.e2e.conftest import RealCluster, start_extra_router
from tests.ports import free_port_block

pytestmark = pytest.mark.e2e

WORDS = "plan call tool read file write patch run check review".split()


@pytest.fixture
def replicas(real_cluster: RealCluster, tmp_path: Path) -> Iterator[list[str]]:
    redis = RedisServer(redis_binary(), tmp_path)
    redis.start()
    routers: list[ServiceProcess] = []
    try:
        port = free_port_block(4, start=18300)  # each router and its internal listener
        for i in range(2):
            routers.append(start_extra_router(
                real_cluster, port + 2 * i, tmp_path / f"replica-{i}.log",
                ["--state", redis.url, "--state-timeout-ms", "1000"]))
        yield [r.url or "" for r in routers]
    finally:
        for r in routers:
            r.stop()
        redis.stop()


def test_turns_alternating_between_replicas_pull_every_time(real_cluster: RealCluster,
                                                            replicas: list[str]):
    rng = random.Random(11)
    conversation = f"replicas-{secrets.token_hex(4)}"
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Agent. " + " ".join(rng.choice(WORDS) for _ in range(120))},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))}]
    seen: list[tuple[int, str, str, int, float]] = []
    with httpx.Client(timeout=300, trust_env=False) as http:
        def pulled_so_far() -> float:
            return external_kv_tokens(parse_prometheus(
                http.get(f"{real_cluster.prefill_url}/metrics").text))

        for turn in range(6):
            replica = turn % 2
            before = pulled_so_far()
            resp = http.post(f"{replicas[replica]}/v1/chat/completions", json={
                "model": real_cluster.model, "messages": messages, "max_tokens": 12,
                "temperature": 0, "conversation_id": conversation})
            assert resp.status_code == 200, resp.text
            seen.append((replica, resp.headers["x-kvrelay-action"],
                         resp.headers["x-kvrelay-reason"],
                         int(resp.headers["x-kvrelay-reused-tokens"]),
                         pulled_so_far() - before))
            messages = [*messages,
                        {"role": "assistant", "content": resp.json()["choices"][0]["message"][
                            "content"]},
                        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(8))}]
    assert [s[1:3] for s in seen] == [("recompute", "no_entry")] + [("pull", "pull")] * 5, seen
    assert all(s[3] > 0 and s[3] == s[4] for s in seen[1:]), seen
    assert seen[0][3] == 0 and seen[0][4] == 0, seen
