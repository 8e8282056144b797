"""Issue #12, defect 2: what the router tells whom.

* A client-fault 4xx from an engine (its message quotes the request: ``The model `X` does
  not exist``, the context-length message with the request's token counts) goes back to
  that client only: it marks and annotates no node, so neither ``/health``, nor another
  tenant, nor any unauthenticated endpoint ever shows it.
* ``/health`` without a key is liveness only: ``{"status": "ok"|"degraded"|"unavailable"}``,
  200 when at least one P and one D are up, else 503; no nodes, ids, URLs or errors.
* Node details (ids, up, engine ids, last error kind) are ``GET /admin/nodes``, admin key only
  (401 without or with a wrong key, 403 with a tenant's key).
* Errors sent to clients name no internal node id, node URL or port, and no exception repr:
  a D that dies mid-stream gives an SSE error event and ``[DONE]``; an unreachable P a 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvrelay.client.sse import chunk_error, line_chunks
from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.router_process import (
    HeldSleep,
    Rig,
    RouterProcess,
    eventually,
    fake_rig,
    is_openai_error,
    openai_error_of,
    run_router,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
ADMIN = "ADM-key"
ARGS = ("--api-key", "alice:KA", "--api-key", "bob:KB", "--admin-key", ADMIN)
ALICE = {"authorization": "Bearer KA"}
BOB = {"authorization": "Bearer KB"}
CONFIG = engine_config(report_delay_s=0.0)
MESSAGES = [{"role": "user", "content": "Tell me about rivers and the rocks they carve."}]
#: Exception reprs and library names that must never reach a client.
REPRS = ("RemoteProtocolError", "Error(", "Exception", "Traceback", "httpx", "httpcore",
         "aiohttp")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-leaks"), *ARGS, config=CONFIG) as started:
        yield started


def internals(cluster: FakeCluster) -> list[str]:
    """Strings that name a node: ids, URLs, host:port of the HTTP and side-channel
    listeners, the bare ports, and the loopback address they all use."""
    out = ["127.0.0.1", "localhost"]
    for e in cluster.engines:
        out += [e.name, e.url, f"{e.host}:{e.port}", f":{e.port}",
                f"{e.side_channel_host}:{e.side_channel_port}"]
    return out


def leaked(text: str, cluster: FakeCluster) -> list[str]:
    return [s for s in (*internals(cluster), *REPRS) if s in text]


async def unauthenticated_views(router: RouterProcess) -> dict[str, str]:
    """Everything a caller without a key can read, by endpoint."""
    views: dict[str, str] = {}
    async with router.client() as c:
        for path in ("/health", "/metrics", "/stats", "/admin/nodes", "/v1/models"):
            resp = await c.get(path)
            views[f"GET {path} (no key)"] = f"{resp.status_code} {resp.text}"
        resp = await c.get("/admin/nodes", headers={"authorization": "Bearer wrong"})
        views["GET /admin/nodes (wrong key)"] = f"{resp.status_code} {resp.text}"
    return views


async def test_an_engine_client_fault_quoting_the_request_leaks_nowhere(rig: Rig) -> None:
    secrets: dict[str, dict[str, Any]] = {
        "SECRET-xyz": {"model": "SECRET-xyz"}, "987654": {"max_tokens": 987654}}
    async with rig.router.client() as c:
        for fields in secrets.values():
            for conversation in (None, "leak-conv"):
                body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, **fields}
                if conversation is not None:
                    body["conversation_id"] = conversation
                resp = await c.post(CHAT, json=body, headers=ALICE)
                assert 400 <= resp.status_code < 500, resp.text
        views = await unauthenticated_views(rig.router)
        resp = await c.get("/stats", headers=BOB)
        views["GET /stats (bob)"] = f"{resp.status_code} {resp.text}"
        resp = await c.get("/admin/nodes", headers={"authorization": f"Bearer {ADMIN}"})
        views["GET /admin/nodes (admin: client faults annotate no node)"] = (
            f"{resp.status_code} {resp.text}")
    shown = {where: [m for m in secrets if m in text] for where, text in views.items()}
    shown = {where: found for where, found in shown.items() if found}
    assert not shown, "alice's request text shown to others: " + "; ".join(
        f"{where} shows {found}" for where, found in shown.items())
    metrics = await rig.router.metrics()
    assert metrics.value("kvrelay_router_node_up", node="prefill-0") == 1.0


async def test_health_without_a_key_is_liveness_only(rig: Rig) -> None:
    async with rig.router.client() as c:
        turn = await c.post(CHAT, headers=ALICE, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "conversation_id": "h"})
        assert turn.status_code == 200, turn.text
        resp = await c.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body == {"status": "ok"}, (
        f"/health without a key shows more than liveness: {resp.text[:500]}")


async def test_node_details_need_the_admin_key(rig: Rig) -> None:
    async with rig.router.client() as c:
        turn = await c.post(CHAT, headers=ALICE, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "conversation_id": "n"})
        assert turn.status_code == 200, turn.text
        answers = {
            "no key": await c.get("/admin/nodes"),
            "wrong key": await c.get("/admin/nodes", headers={"authorization": "Bearer no"}),
            "alice's key": await c.get("/admin/nodes", headers=ALICE),
            "admin key": await c.get("/admin/nodes",
                                     headers={"authorization": f"Bearer {ADMIN}"}),
        }
    got = {who: resp.status_code for who, resp in answers.items()}
    assert got == {"no key": 401, "wrong key": 401, "alice's key": 403, "admin key": 200}, got
    for who in ("no key", "wrong key", "alice's key"):
        openai_error_of(answers[who])
    details = answers["admin key"].text
    expected = ["prefill-0", "decode-0", *(e.engine_id for e in rig.cluster.engines)]
    missing = [s for s in expected if s not in details]
    assert not missing, f"/admin/nodes lacks {missing}: {details[:500]}"


async def test_health_is_503_unavailable_once_no_decode_node_is_up(tmp_path: Path) -> None:
    async with FakeCluster(1, 1, CONFIG) as cluster, \
            run_router(cluster, tmp_path, *ARGS) as router, router.client() as c:
        await cluster.decode[0].crash()
        failed = await c.post(CHAT, headers=ALICE, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4})
        assert failed.status_code in (502, 503), failed.text  # D refused the connection
        resp = await eventually(lambda: c.get("/health"), lambda r: r.status_code == 503,
                                "/health says 503 once the only D is down")
        assert resp.json() == {"status": "unavailable"}, (
            f"/health without a key shows more than liveness: {resp.text[:500]}")


async def test_a_decode_node_dying_mid_stream_is_an_error_event_without_internals(
    tmp_path: Path,
) -> None:
    sleep = HeldSleep()
    async with FakeCluster(1, 1, CONFIG, sleep=sleep) as cluster, \
            run_router(cluster, tmp_path, *ARGS) as router, router.client() as c:
        d = cluster.decode[0]
        d.faults.slow_stream_s = 0.01  # every token is a step of ``sleep``
        sleep.hold()
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": True}
        async with c.stream("POST", CHAT, json=body, headers=ALICE) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")  # the role chunk; D now holds token 1
            await until(lambda: sleep.held == 1, "D holding the stream at its first token")
            await d.crash()
            rest = [line async for line in lines if line]
    errors = [chunk for chunk in line_chunks(rest) if chunk_error(chunk) is not None]
    assert errors, f"no SSE error event after D died: {rest}"
    text = "\n".join(rest)
    assert not leaked(text, cluster), (
        f"the error event names {leaked(text, cluster)}: {text[:500]}")
    assert rest[-1] == "data: [DONE]", rest
    assert isinstance(errors[0]["error"].get("message"), str)


async def test_an_unreachable_prefill_node_is_a_503_without_internals(tmp_path: Path) -> None:
    async with FakeCluster(1, 1, CONFIG) as cluster, \
            run_router(cluster, tmp_path, *ARGS) as router, router.client() as c:
        await cluster.prefill[0].crash()
        answers = [await c.post(CHAT, headers=ALICE, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4}) for _ in range(2)]
    for resp in answers:
        assert resp.status_code == 503, resp.text
        assert is_openai_error(resp.json(), 503), resp.text
        found = leaked(resp.json()["error"]["message"], cluster)
        assert not found, f"the 503 names {found}: {resp.text}"
