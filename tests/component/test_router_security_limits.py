"""Issue #12, defect 11: the in-flight cap is checked after auth, and shared per tenant.

* With ``--max-in-flight 4`` and tenants alice and bob, a request without a valid key gets
  401, never 429, even while alice's four streams take every slot; and 50 such requests
  that are slow to send their body take no slot: alice is still served while they are
  open, and every one of them gets 401.
* With ``--max-in-flight-per-tenant 2`` as well, alice's third concurrent request gets 429
  while bob's first is still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.raw_http import RawConnection, RawResponse, request_bytes
from tests.component.router_process import (
    PATIENCE_S,
    HeldSleep,
    RouterProcess,
    eventually,
    run_router,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
KEYS = ("--api-key", "alice:KA", "--api-key", "bob:KB")
CONFIG = engine_config(report_delay_s=0.0)
BODY = {"model": "tiny", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Name three rivers."}]}


async def hold_streams(stack: contextlib.AsyncExitStack, router: RouterProcess,
                       headers: dict[str, str], count: int) -> list[AsyncIterator[str]]:
    """Open ``count`` streams and read their first line (D then holds them at their first
    token); they stay open until ``stack`` closes (keep the returned iterators: dropping one
    closes its stream)."""
    out = []
    for _ in range(count):
        client = await stack.enter_async_context(router.client())
        resp = await stack.enter_async_context(client.stream(
            "POST", CHAT, json={**BODY, "stream": True}, headers=headers))
        assert resp.status_code == 200, resp.status_code
        lines = resp.aiter_lines()
        assert (await anext(lines)).startswith("data: {")
        out.append(lines)
    return out


async def test_unauthenticated_requests_get_401_never_429_and_take_no_slot(
    tmp_path: Path,
) -> None:
    raw = json.dumps(BODY).encode()
    sleep = HeldSleep()
    no_key = {"content-type": "application/json"}
    wrong_key = {**no_key, "authorization": "Bearer not-a-key"}
    async with FakeCluster(1, 1, CONFIG, sleep=sleep) as cluster, \
            run_router(cluster, tmp_path, "--max-in-flight", "4", *KEYS) as router:
        cluster.decode[0].faults.slow_stream_s = 0.01  # every token is a step of ``sleep``
        sleep.hold(4)
        async with contextlib.AsyncExitStack() as stack:
            held = await hold_streams(stack, router, {"authorization": "Bearer KA"}, 4)
            await until(lambda: sleep.held == 4, "alice's four streams held by D")
            async with router.client() as c:
                beyond = [await c.post(CHAT, json=BODY, headers=h)
                          for h in (no_key, wrong_key, no_key, wrong_key)]
            sleep.release()
            assert len(held) == 4
        statuses = [r.status_code for r in beyond]
        assert statuses == [401] * 4, (
            f"unauthenticated requests while the 4 slots were taken got {statuses}")
        await eventually(router.metrics, lambda m: m.value("kvrelay_router_in_flight") == 0,
                         "alice's streams ended")

        conns: list[RawConnection] = []
        answers: list[asyncio.Task[RawResponse]] = []
        try:
            for i in range(50):
                conn = await RawConnection.open(router.host, router.port)
                auth = [] if i % 2 else [("Authorization", "Bearer not-a-key")]
                # the head and the first byte of the body; the rest comes later, if ever
                await conn.send(request_bytes(
                    "POST", CHAT, [("Content-Type", "application/json"), *auth],
                    raw[:1], content_length=len(raw)))
                conns.append(conn)
                answers.append(asyncio.create_task(conn.wait_status()))
            async with router.client() as c:
                alice = await c.post(CHAT, json=BODY, headers={"authorization": "Bearer KA"})
            assert alice.status_code == 200, (
                f"alice got {alice.status_code} while 50 unauthenticated requests were open: "
                f"{alice.text}")
            for conn, answer in zip(conns, answers, strict=True):
                if not answer.done():  # the router waits for the body before answering
                    await conn.send(raw[1:])
            got = await asyncio.wait_for(asyncio.gather(*answers), PATIENCE_S)
        finally:
            for conn in conns:
                conn.abort()
            for answer in answers:
                answer.cancel()
    statuses = sorted(r.status for r in got)
    assert set(statuses) == {401}, f"unauthenticated requests got {statuses}"


async def test_a_tenant_cannot_take_more_than_its_share(tmp_path: Path) -> None:
    sleep = HeldSleep()
    async with FakeCluster(1, 1, CONFIG, sleep=sleep) as cluster, \
            run_router(cluster, tmp_path, "--max-in-flight", "4", *KEYS,
                       new_flags=["--max-in-flight-per-tenant", "2"]) as router, \
            contextlib.AsyncExitStack() as stack:
        cluster.decode[0].faults.slow_stream_s = 0.01  # every token is a step of ``sleep``
        sleep.hold(2)  # alice's two streams stop at their first token; later steps pass
        alice = {"authorization": "Bearer KA"}
        held = await hold_streams(stack, router, alice, 2)  # kept: a dropped one would close
        await until(lambda: sleep.held == 2, "alice's two streams held by D")
        async with router.client() as c:
            third = await c.post(CHAT, json=BODY, headers=alice)
            bob = await c.post(CHAT, json=BODY, headers={"authorization": "Bearer KB"})
        sleep.release()
        assert len(held) == 2
    assert third.status_code == 429, (
        f"alice's third concurrent request got {third.status_code} (share 2 of 4"
        + (f"; the router does not take {router.dropped_flags}" if router.dropped_flags else "")
        + f"): {third.text[:200]}")
    assert third.json()["error"]["code"] == 429
    assert bob.status_code == 200, f"bob got {bob.status_code}: {bob.text}"
