"""Issue #12, defect 5: ``/health`` answers from the last known state of the nodes.

Only the background loop (here ``--health-interval-s 3600``: one round, at start-up) and
real request failures change a node's state. So 100 calls of ``/health`` probe no engine,
and two concurrent calls during a blip of D's own ``/health`` (503 while they run) neither
mark D down nor drop the entries it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.component.router_process import Rig, fake_rig

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
FIRST = "Describe the water cycle from ocean to cloud to river and back. " * 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-health")) as started:
        yield started


async def test_health_calls_probe_no_engine(rig: Rig) -> None:
    engines = rig.cluster.engines
    before = [e.num_health_requests for e in engines]
    async with rig.router.client() as c:
        statuses = {(await c.get("/health")).status_code for _ in range(100)}
    probes = {e.name: e.num_health_requests - b for e, b in zip(engines, before, strict=True)}
    # The background loop's start-up round may land in this window: at most 1 per engine.
    assert all(n <= 1 for n in probes.values()), (
        f"100 GET /health made the router probe the engines: {probes}")
    assert statuses == {200}, statuses


async def test_concurrent_health_calls_during_a_blip_keep_d_and_its_entries(rig: Rig) -> None:
    d = rig.cluster.decode[0]
    messages = [{"role": "user", "content": FIRST}]
    body = {"model": "tiny", "max_tokens": 8, "conversation_id": "blip"}
    async with rig.router.client() as c:
        first = await c.post(CHAT, json={**body, "messages": messages})
        assert first.status_code == 200, first.text
        d.faults.unhealthy = True  # D's /health answers 503 while both calls run
        try:
            during = await asyncio.gather(c.get("/health"), c.get("/health"))
        finally:
            d.faults.unhealthy = False
        after = await rig.router.metrics()
        messages += [{"role": "assistant",
                      "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Go on."}]
        second = await c.post(CHAT, json={**body, "messages": messages})
    up = after.value("kvrelay_router_node_up", node="decode-0")
    dropped = after.total("kvrelay_router_entries_dropped_total", reason="node_down")
    assert up == 1.0 and dropped == 0, (
        f"two /health calls during a blip of D's health check marked D down "
        f"(node_up {up}) and dropped {dropped:g} entries")
    assert second.status_code == 200, second.text
    assert second.headers.get("x-kvrelay-action") == "pull", (
        f"the next turn lost its entry: {second.headers.get('x-kvrelay-reason')}")
    assert [r.status_code for r in during] == [200, 200], [r.text for r in during]
