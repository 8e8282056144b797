"""``run_showcase`` (what ``kvrelay demo`` shows) against two real routers on one cluster of
fake engines: one reusing, one that never pulls. Timings are never asserted; what is checked
is the comparison's structure: both warmed, pairs alternated, identical histories and
answers, and the decisions each router took."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvrelay.bench.showcase import ShowcaseResult, pair_order, run_showcase
from kvrelay.fakevllm import FakeCluster
from kvrelay.fakevllm.server import HttpServer
from kvrelay.router.app import RouterApp, create_app
from kvrelay.router.config import RouterConfig
from tests.component.router_fake import ENGINE_CONFIG
from tests.costs import fixed
from tests.ports import free_ports

NEVER_PULL = {"pull_cost_factor": 1e9}


@contextlib.asynccontextmanager
async def two_routers(cluster: FakeCluster) -> AsyncIterator[tuple[str, str]]:
    """A reusing router and one that never pulls, both in front of ``cluster``."""
    servers: list[HttpServer] = []
    apps: list[RouterApp] = []
    urls: list[str] = []
    try:
        for extra in ({}, NEVER_PULL):
            port, internal = free_ports(2)
            settings: dict[str, Any] = {"port": port, "internal_port": internal,
                                        "health_interval_s": 3600.0, "report_wait_s": 5.0,
                                        "block_size": ENGINE_CONFIG.block_size,
                                        **fixed(), **extra}
            config = RouterConfig.from_urls(cluster.prefill_urls, cluster.decode_urls,
                                            **settings)
            app = create_app(config)
            apps.append(app)
            for served, at in ((app.public, port), (app.internal, config.listen_internal_port)):
                server = HttpServer(served, "127.0.0.1", at)
                await server.start()
                servers.append(server)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls[0], urls[1]
    finally:
        for server in servers:
            await server.stop()
        for app in apps:
            await app.ctx.upstream.aclose()


@pytest.mark.parametrize("recompute_first", [False, True])
async def test_showcase_compares_alternated_pairs(recompute_first: bool) -> None:
    async with FakeCluster(1, 1, ENGINE_CONFIG) as cluster, \
            two_routers(cluster) as (reuse_url, baseline_url):
        result: ShowcaseResult = await asyncio.to_thread(
            run_showcase, reuse_url, baseline_url, "tiny", pairs=2, turns=3,
            system_words=60, tool_words=20, answer_tokens=8,
            recompute_first=recompute_first)
        p = cluster.prefill[0]
        # warm-up (2 turns per router) + 2 pairs x 2 routers x 3 turns reached P
        assert len(p.records) == 2 * 2 + 2 * 2 * 3
    assert [pair.first for pair in result.pairs] == pair_order(2, recompute_first)
    for pair in result.pairs:
        assert [t.reason for t in pair.reuse] == ["no_entry", "pull", "pull"]
        assert [t.reason for t in pair.baseline] == ["no_entry", "cost_model", "cost_model"]
        assert all(t.reused_tokens > 0 for t in pair.reuse[1:])
        assert all(t.reused_tokens == 0 for t in pair.baseline)
        assert [t.prompt_tokens for t in pair.reuse] == [t.prompt_tokens for t in pair.baseline]
        assert pair.same_output
    assert result.pairs[0].reuse[0].text != result.pairs[1].reuse[0].text  # own text per pair
    summary = result.summary()
    assert "pulled on 4 of 4 follow-ups" in summary and "Answers identical: yes" in summary
    assert "median of 2 pairs" in summary
    table = result.table().splitlines()
    assert len(table) == 2 + 3 and "pull (pull) x2" in table[3]
    assert len(result.pairs_table().splitlines()) == 2 + 2
