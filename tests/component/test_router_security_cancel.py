"""Issue #12, defect 3: a non-streamed request whose client goes away is cancelled upstream.

D is held mid-generation (its first token waits on a ``HeldSleep`` step that is never
released); the client closes its connection. The router must free its in-flight slot
(``kvrelay_router_in_flight`` back to 0) and cancel D's request, which the fake D records
as aborted while it is still held: nothing was generated for nobody.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.raw_http import RawConnection, request_bytes
from tests.component.router_process import HeldSleep, eventually, run_router, until

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "max_tokens": 50,
        "messages": [{"role": "user", "content": "Write fifty words about slow rivers."}]}


async def test_abandoned_non_streamed_request_is_cancelled_on_d(tmp_path: Path) -> None:
    sleep = HeldSleep()
    async with FakeCluster(1, 1, engine_config(report_delay_s=0.0), sleep=sleep) as cluster, \
            run_router(cluster, tmp_path) as router:
        d = cluster.decode[0]
        d.faults.slow_stream_s = 0.01  # every token is a step of ``sleep``
        sleep.hold()
        conn = await RawConnection.open(router.host, router.port)
        try:
            await conn.send(request_bytes("POST", CHAT, [("Content-Type", "application/json")],
                                          json.dumps(BODY).encode()))
            await until(lambda: bool(d.records) and sleep.held == 1,
                        "D generating the request, held on its first token")
            record = d.records[-1]
            busy = await router.metrics()
            assert busy.value("kvrelay_router_in_flight") == 1.0, busy.find(
                "kvrelay_router_in_flight")
        finally:
            conn.close()  # the client gives up

        async def in_flight() -> float | None:
            return (await router.metrics()).value("kvrelay_router_in_flight")

        try:
            await eventually(in_flight, lambda v: v == 0.0,
                             "the in-flight slot freed after the client left")
        except AssertionError as exc:
            raise AssertionError(
                f"kvrelay_router_in_flight stayed at {await in_flight()} after the client "
                f"disconnected, and D is still generating for it (finish_reason "
                f"{record.finish_reason!r}): {exc}") from None
        await until(lambda: record.finish_reason is not None,
                    "D's request finished after the client left")
        assert record.finish_reason == "abort", record.finish_reason
        assert record.output_token_ids == []  # D was cancelled while still held
        assert sleep.held == 0 and d.held() == []
        sleep.release()
        await asyncio.sleep(0)
