"""A short soak (``kvrelay.bench.soak``, the load of ``scripts/soak.py``, in-process):
concurrent streaming multi-turn conversations that churn through new conversation ids, with
a small entry cap and entries expiring on the shared ManualClock. No errors, and the entry
count never exceeds the cap. No wall-clock assertions; the router process's RSS is printed,
not asserted."""

from __future__ import annotations

import resource
from typing import Any

import pytest

from kvrelay.bench.rawhttp import get_text
from kvrelay.bench.soak import Target, run_load
from kvrelay.client.prometheus import parse_prometheus
from kvrelay.core.conversation import ConversationEntry
from kvrelay.router.index import EntryRef
from tests.component.router_fake import routed

CAP = 4


async def test_short_soak_has_no_errors_and_respects_the_entry_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with routed(num_prefill=2, num_decode=2, max_entries=CAP,
                      expired_retention_s=5.0, report_wait_s=2.0) as r:
        index = r.ctx.index
        peak = [0]
        put = index.put

        async def counting_put(ref: EntryRef, entry: ConversationEntry, *, tenant: str,
                               opened_at_s: float | None = None) -> bool:
            kept = await put(ref, entry, tenant=tenant, opened_at_s=opened_at_s)
            peak[0] = max(peak[0], len(index))
            return kept

        monkeypatch.setattr(index, "put", counting_put)
        target = Target(router=r.url, prefill=r.cluster.prefill_urls,
                             decode=r.cluster.decode_urls)
        results: list[Any] = []
        for phase in range(2):
            # 8 conversations at a time, 2 after another per client, 3 turns each
            results.append(await run_load(
                target, clients=8, conversations_per_client=2, turns=(3, 3), max_tokens=8,
                tag=f"phase{phase}"))
            await r.settle()
            assert len(index) <= CAP
            # every entry expires and is purged (TTL 480 s - 10 s margin, then 5 s retention)
            r.clock.advance(480.0 + 6.0 + 10.0)
            assert await r.find({"messages": [{"role": "user", "content": "x"}]}) is None
            assert len(index) == 0  # the lookup swept
        for result in results:
            assert result.errors == []
            assert len(result.samples) == 8 * 2 * 3 and result.conversations == 16
        assert 0 < peak[0] <= CAP
        metrics = await get_text(r.url + "/metrics")
        assert parse_prometheus(metrics).get("kvrelay_router_live_entries") == 0.0
        stats = await r.stats()
        by_reason = stats["decisions"]["by_reason"]
        # churn past the cap: some conversations lost their entry (LRU) and recomputed,
        # others pulled
        assert by_reason.get("pull", 0) > 0 and by_reason.get("no_entry", 0) >= 32
        assert r.ctx.metrics.dropped.labels("capacity")._value.get() > 0
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"short soak: {sum(x.requests for x in results)} requests, peak entries "
              f"{peak[0]} (cap {CAP}), test process max RSS {rss_mib:.0f} MiB")

