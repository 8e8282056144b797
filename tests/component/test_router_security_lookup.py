"""Issue #23, finding 4: a completions lookup's work does not grow with the entries a scope
holds, seen from outside.

Every completions prompt under 1 KiB in a scope shares one anchor (block 0), and the router
used to hash every entry there on each lookup (3.4 us per entry, ~350 ms at 100,000). The
router counts the digests its completions lookups compute
(``kvrelay_router_text_lookup_digests_total`` over ``kvrelay_router_text_lookups_total``):
the same prompt costs the same digests with 3 entries in its scope as with 100 more, and a
follow-up among them still finds (and pulls) its own entry. A count, not a clock: it holds
on any machine, however loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from tests.component.router_process import Metrics, Rig, RouterProcess, eventually, fake_rig

pytestmark = pytest.mark.asyncio(loop_scope="module")
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)
COMPLETIONS = "/v1/completions"
PULL_ALWAYS_PAYS = ("--pull-cost-factor", "1e-6")
METRICS_KEY = "MK"
"""The lookup digests follow prompt lengths, so only a keyed scrape shows them (finding 8)."""
LOOKUPS = "kvrelay_router_text_lookups_total"
DIGESTS = "kvrelay_router_text_lookup_digests_total"
LOG = ("the keeper's log: wind from the west, two ships seen, the lamp trimmed at dusk and "
       "the oil measured at dawn; ") * 3
"""~335 bytes, ~120 tokens: a turn holds more than the recompute threshold, in under 1 KiB."""
QUESTION = "Q: what did the keeper see on the night of the great storm? " * 6 + "A:"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-lookup"), *PULL_ALWAYS_PAYS,
                        "--metrics-key", METRICS_KEY) as started:
        yield started


async def scrape(router: RouterProcess) -> Metrics:
    return await router.metrics(METRICS_KEY)


async def settled(router: RouterProcess) -> None:
    await eventually(lambda: scrape(router),
                     lambda m: m.total("kvrelay_router_pending_reports") == 0,
                     "every pending report settled")


async def complete(c: httpx.AsyncClient, prompt: str) -> httpx.Response:
    resp = await c.post(COMPLETIONS, json={"model": "tiny", "prompt": prompt,
                                           "max_tokens": 8})
    assert resp.status_code == 200, resp.text
    return resp


def lookup_work(metrics: Metrics) -> tuple[float, float]:
    lookups, digests = metrics.value(LOOKUPS), metrics.value(DIGESTS)
    assert lookups is not None and digests is not None, (
        f"the router exports no completions lookup work ({LOOKUPS}, {DIGESTS})")
    return lookups, digests


async def digests_per_lookup(router: RouterProcess, c: httpx.AsyncClient, prompt: str,
                             times: int = 3) -> float:
    """Digests one completions lookup of ``prompt`` computes (over ``times`` sends)."""
    lookups0, digests0 = lookup_work(await scrape(router))
    for _ in range(times):
        await complete(c, prompt)
    lookups1, digests1 = lookup_work(await scrape(router))
    assert lookups1 - lookups0 == times
    return (digests1 - digests0) / times


async def fill(c: httpx.AsyncClient, first: int, count: int) -> None:
    """``count`` more conversations' first turns in the scope, each a prompt under 1 KiB."""
    for batch in range(first, first + count, 8):
        await asyncio.gather(*(complete(c, f"[{i:04d}] {LOG}")
                               for i in range(batch, min(first + count, batch + 8))))


async def test_a_completions_lookup_costs_the_same_with_3_or_103_entries_in_the_scope(
    rig: Rig,
) -> None:
    router = rig.router
    async with router.client(limits=NO_KEEPALIVE) as c:
        mine = await complete(c, f"[mine] {LOG}")
        # under 1 KiB (one anchor), above the recompute threshold (64 by default) in tokens
        assert len(f"[0000] {LOG}".encode()) < 1024 and mine.json()["usage"]["prompt_tokens"] > 64
        await fill(c, 0, 2)
        await settled(router)
        few = await digests_per_lookup(router, c, QUESTION)
        await fill(c, 2, 100)
        await settled(router)
        live = (await scrape(router)).value("kvrelay_router_live_entries")
        assert live is not None and live >= 100, f"only {live} entries were kept"
        many = await digests_per_lookup(router, c, QUESTION)
        follow = await complete(c, f"[mine] {LOG}{mine.json()['choices'][0]['text']} And?")
    assert many == few, (
        f"a completions lookup computed {few} digests with 3 entries in its scope and "
        f"{many} with {live}: its work grows with the entries")
    assert 0 < few <= 256
    assert follow.headers["x-kvrelay-action"] == "pull", (
        f"a follow-up among {live} entries did not find its own: "
        f"{follow.headers['x-kvrelay-action']} ({follow.headers.get('x-kvrelay-reason')})")
