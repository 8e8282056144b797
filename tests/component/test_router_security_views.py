"""Issue #23, findings 6 and 8: what ``/stats`` and ``/metrics`` tell whom.

* 6: the conversation tags ``/stats`` shows are keyed: nobody can confirm a guessed session
  id or first message offline. Two routers without a shared key tag one conversation
  differently (a public hash would agree, and match the guess); routers sharing
  ``--tag-key`` agree, as replicas must.
* 8: a tenant's ``/stats`` counts only its own turns (decisions, pending reports; not the
  index's size); the admin key sees every tenant's. An unauthenticated ``/metrics`` has no
  request-size series (``prompt_tokens_total``, ``retained_tokens``); ``--metrics-key``
  locks it (the key gets everything), ``--metrics-listener internal`` moves it to the
  internal listener.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.router_process import (
    RouterProcess,
    eventually,
    fake_rig,
    openai_error_of,
    run_router,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
#: A new connection per request: a kept-alive one the router closes while idle (uvicorn's
#: keep-alive timeout) could be reused at that moment and read a reset.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)

CHAT = "/v1/chat/completions"
SESSION = "session-0042"  # the kind of id an attacker guesses
TAG_KEY = "a-deployment-wide-secret-of-32-bytes"


def unkeyed_guess(*parts: bytes) -> str:
    """The tag of a guess computed offline, as an unkeyed hash of its parts would be."""
    h = hashlib.blake2b(digest_size=8, person=b"kvrelay-convkey")
    for raw in parts:
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.hexdigest()


async def tags_of_one_conversation(router: RouterProcess) -> tuple[str, str]:
    """The ``/stats`` keys of one turn under ``SESSION`` and one id-free turn."""
    async with router.client(limits=NO_KEEPALIVE) as c:
        for headers in ({"x-conversation-id": SESSION}, {}):
            resp = await c.post(CHAT, headers=headers, json={
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "My PIN is 4829."}]})
            assert resp.status_code == 200, resp.text

        async def recent() -> list[dict[str, Any]]:
            stats: dict[str, Any] = (await c.get("/stats")).json()
            return list(stats["decisions"]["recent"])

        turns = await eventually(recent, lambda r: len(r) == 2, "both turns in /stats")
    return turns[0]["key"], turns[1]["key"]


async def test_conversation_tags_are_keyed(tmp_path: Path) -> None:
    async with fake_rig(tmp_path / "a") as a:
        with_id, id_free = await tags_of_one_conversation(a.router)
    assert with_id != unkeyed_guess(b"default", SESSION.encode()), (
        "the tag of a guessed session id can be confirmed offline")
    async with fake_rig(tmp_path / "b") as b:
        other = await tags_of_one_conversation(b.router)
    assert other != (with_id, id_free), (
        "two routers without a shared key tag a conversation alike: the tag is a public "
        "function of the id and the first message, so a guess can be confirmed")


async def test_routers_sharing_a_tag_key_agree(tmp_path: Path) -> None:
    tags = []
    for name in ("a", "b"):
        async with fake_rig(tmp_path / name, "--tag-key", TAG_KEY) as rig:
            tags.append(await tags_of_one_conversation(rig.router))
    assert tags[0] == tags[1]
    assert tags[0][0] != unkeyed_guess(b"default", SESSION.encode())


async def test_a_short_tag_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exited with 2"):
        async with fake_rig(tmp_path, "--tag-key", "short"):
            pass


KEYS = ("--api-key", "alice:KA", "--api-key", "bob:KB", "--admin-key", "ADM")
ALICE, BOB = {"authorization": "Bearer KA"}, {"authorization": "Bearer KB"}
ADMIN = {"authorization": "Bearer ADM"}
SIZES = ("kvrelay_router_prompt_tokens_total", "kvrelay_router_retained_tokens",
         # D's own retention numbers (what it holds and has free move with each request's
         # size) and the completions lookup work (digests grow with the prompt's length)
         "kvrelay_router_d_retained_tokens", "kvrelay_router_d_retained_blocks",
         "kvrelay_router_d_retained_bytes", "kvrelay_router_d_free_blocks",
         "kvrelay_router_text_lookup_digests_total")


async def test_a_tenant_sees_only_its_own_counts(tmp_path: Path) -> None:
    async with fake_rig(tmp_path, *KEYS) as rig, rig.router.client(limits=NO_KEEPALIVE) as c:
        for i in range(2):
            resp = await c.post(CHAT, headers=ALICE, json={
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": f"Alice's question {i}."}]})
            assert resp.status_code == 200, resp.text

        async def stats(headers: dict[str, str]) -> dict[str, Any]:
            resp = await c.get("/stats", headers=headers)
            assert resp.status_code == 200, resp.text
            body: dict[str, Any] = resp.json()
            return body

        admin = await eventually(lambda: stats(ADMIN),
                                 lambda s: sum(s["decisions"]["by_action"].values()) == 2,
                                 "alice's two turns counted")
        bob, alice = await stats(BOB), await stats(ALICE)
    assert sum(bob["decisions"]["by_action"].values()) == 0, (
        f"bob's /stats counts alice's turns: {bob['decisions']['by_action']}")
    assert not any(bob["decisions"][a] for a in ("pull", "recompute", "direct")), bob
    assert "conversations" not in bob, f"bob sees the index's size: {bob['conversations']}"
    assert bob["pending_reports"] == 0
    assert bob["decisions"]["recent"] == []
    assert sum(alice["decisions"]["by_action"].values()) == 2
    assert admin["conversations"]["live"] >= 1


async def test_metrics_without_a_key_show_no_request_sizes(tmp_path: Path) -> None:
    async with fake_rig(tmp_path, *KEYS) as rig:
        async with rig.router.client(limits=NO_KEEPALIVE) as c:
            resp = await c.post(CHAT, headers=ALICE, json={
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "How long is my prompt?"}]})
            assert resp.status_code == 200, resp.text
        open_view = await rig.router.metrics()
        admin_view = await rig.router.metrics("ADM")
    shown = [name for name in SIZES if open_view.find(name)]
    assert not shown, f"an unauthenticated /metrics shows request sizes: {shown}"
    assert open_view.value("kvrelay_router_node_up", node="decode-0") == 1.0
    assert admin_view.find("kvrelay_router_prompt_tokens_total"), "the admin key gets them"


async def test_a_metrics_key_locks_metrics(tmp_path: Path) -> None:
    async with fake_rig(tmp_path, "--metrics-key", "MK") as rig, \
            rig.router.client(limits=NO_KEEPALIVE) as c:
        resp = await c.post(CHAT, json={"model": "tiny", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text
        answers = {who: await c.get("/metrics", headers=headers) for who, headers in (
            ("no key", {}), ("wrong key", {"authorization": "Bearer no"}),
            ("metrics key", {"authorization": "Bearer MK"}))}
    got = {who: resp.status_code for who, resp in answers.items()}
    assert got == {"no key": 401, "wrong key": 401, "metrics key": 200}, got
    openai_error_of(answers["no key"])
    assert "kvrelay_router_prompt_tokens_total" in answers["metrics key"].text


async def test_metrics_on_the_internal_listener_only(tmp_path: Path) -> None:
    async with FakeCluster(1, 1, engine_config(report_delay_s=0.0)) as cluster, \
            run_router(cluster, tmp_path, "--metrics-listener", "internal",
                       internal=True) as router, router.client(limits=NO_KEEPALIVE) as c:
        public = await c.get("/metrics")
        internal = await c.get(f"{router.internal_url}/metrics")
    assert public.status_code == 404, public.text
    openai_error_of(public)
    assert internal.status_code == 200, internal.text
    assert "kvrelay_router_node_up" in internal.text
