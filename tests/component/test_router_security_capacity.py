"""Issue #12, defect 10: capacity errors are explicit, and retention pressure is visible.

* D answering 503 (its KV cache full, say) is a 503 for the client, with ``Retry-After`` and
  an OpenAI error body, counted in ``kvrelay_router_upstream_errors_total``.
* ``kvrelay_router_retained_tokens{node="decode-0"}`` is the number of tokens D retains for
  the router's live entries: after a few committed turns it equals what the fake D holds
  (every D request here belongs to a conversation, so D holds exactly the live entries).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvrelay.client.sse import chunk_content, line_chunks
from tests.component.router_process import (
    Metrics,
    Rig,
    eventually,
    fake_rig,
    openai_error_of,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
METRICS_KEY = "MK-capacity"
"""The retention gauge is a request-size series: only an authenticated scrape gets it."""
FIRST = "Tell me how sand becomes sandstone, and how long that takes. " * 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-capacity"),
                        "--metrics-key", METRICS_KEY) as started:
        yield started


async def test_d_answering_503_is_a_503_with_retry_after(rig: Rig) -> None:
    d = rig.cluster.decode[0]
    before = await rig.router.metrics(METRICS_KEY)
    d.faults.error_status = 503
    try:
        async with rig.router.client() as c:
            resp = await c.post(CHAT, json={
                "model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Is there room?"}]})
    finally:
        d.faults.clear()
    after = await rig.router.metrics(METRICS_KEY)
    assert resp.status_code == 503, (
        f"D's 503 reached the client as HTTP {resp.status_code}: {resp.text}")
    assert resp.headers.get("retry-after"), f"no Retry-After: {dict(resp.headers)}"
    openai_error_of(resp)
    name = "kvrelay_router_upstream_errors_total"
    assert after.total(name, node="decode-0") == before.total(name, node="decode-0") + 1, (
        after.find(name))


async def test_retained_tokens_gauge_equals_what_d_holds_for_live_entries(rig: Rig) -> None:
    d = rig.cluster.decode[0]
    async with rig.router.client() as c:
        for conversation, turns in (("gauge-a", 2), ("gauge-b", 1)):
            messages = [{"role": "user", "content": f"[{conversation}] {FIRST}"}]
            for _ in range(turns):
                async with c.stream("POST", CHAT, json={
                        "model": "tiny", "max_tokens": 12, "stream": True,
                        "messages": messages, "conversation_id": conversation}) as resp:
                    lines = [line async for line in resp.aiter_lines() if line]
                assert lines[-1] == "data: [DONE]", lines[-3:]
                text = "".join(chunk_content(chunk) for chunk in line_chunks(lines))
                await rig.cluster.drain_reports()
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": "More, please."}]

    def settled(m: Metrics) -> bool:
        return (m.value("kvrelay_router_pending_reports") in (None, 0.0)
                and m.value("kvrelay_router_live_entries") == 2.0)

    metrics = await eventually(lambda: rig.router.metrics(METRICS_KEY), settled,
                               "both conversations' entries live")
    held = sum(h.num_tokens for h in d.held())
    assert len(d.held()) == 2 and held > 0, d.held()
    gauge = metrics.value("kvrelay_router_retained_tokens", node="decode-0")
    assert gauge is not None, (
        "no kvrelay_router_retained_tokens{node=\"decode-0\"} in /metrics: "
        + ", ".join(sorted({n for n, _, _ in metrics.samples})))
    assert gauge == held, f"retained_tokens says {gauge:g}, D holds {held} tokens"
