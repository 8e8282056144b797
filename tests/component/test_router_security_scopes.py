"""Issue #23, findings 2 and 3: whose entries a request can reach, seen from outside.

* 3: vLLM's ``cache_salt`` and the end-user identifiers (``user``, ``safety_identifier``)
  narrow the scope: the same history under salt (or user) A, then B, never pulls A's entry,
  with or without a shared conversation id; A's own follow-up still pulls it, and
  ``cache_salt`` reaches P and D unchanged.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.component.router_process import Rig, fake_rig, openai_error_of

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
STORY = ("Write down the maintenance log of the lighthouse keeper, entry by entry, with the "
         "weather, the ships seen and the oil burnt, for the whole of the stormy autumn. ")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-scopes")) as started:
        yield started


async def first_turn(
    c: httpx.AsyncClient, content: str, fields: dict[str, Any],
) -> list[dict[str, Any]]:
    """Turn 1 of a conversation; returns its history with the answer appended."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    resp = await c.post(CHAT, json={"model": "tiny", "messages": messages, "max_tokens": 24,
                                    **fields})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvrelay-action"] != "pull"
    answer = resp.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}]


async def follow_up(
    c: httpx.AsyncClient, history: list[dict[str, Any]], fields: dict[str, Any],
) -> httpx.Response:
    resp = await c.post(CHAT, json={
        "model": "tiny", "max_tokens": 4, **fields,
        "messages": [*history, {"role": "user", "content": "And the next entry?"}]})
    assert resp.status_code == 200, resp.text
    return resp


def reuse(resp: httpx.Response) -> tuple[str, int]:
    return resp.headers["x-kvrelay-action"], int(resp.headers["x-kvrelay-reused-tokens"])


@pytest.mark.parametrize("field", ["cache_salt", "user", "safety_identifier"])
@pytest.mark.parametrize("conversation_id", [None, "shared-conversation"])
async def test_another_salt_or_user_never_reaches_the_entry(
    rig: Rig, field: str, conversation_id: str | None,
) -> None:
    ids = {} if conversation_id is None else {"conversation_id": f"{conversation_id}-{field}"}
    owner = {field: "A-secret-tenant-user", **ids}
    other = {field: "B-other-user", **ids}
    async with rig.router.client() as c:
        history = await first_turn(c, f"{STORY}[{field} {conversation_id}]", owner)
        crossed = await follow_up(c, history, other)
        unsalted = await follow_up(c, history, ids)
        own = await follow_up(c, history, owner)
    assert reuse(crossed) == ("recompute", 0), (
        f"the same history under another {field} reused the owner's entry: {reuse(crossed)}")
    assert reuse(unsalted) == ("recompute", 0), (
        f"the same history without {field} reused the owner's entry: {reuse(unsalted)}")
    action, reused = reuse(own)
    assert (action, reused > 0) == ("pull", True), (
        f"the owner's own follow-up did not pull its entry: {reuse(own)}")


async def test_cache_salt_reaches_p_and_d_unchanged(rig: Rig) -> None:
    salt = "salt-\u00e9-42"
    async with rig.router.client() as c:
        history = await first_turn(c, f"{STORY}[forwarded salt]", {"cache_salt": salt})
        await follow_up(c, history, {"cache_salt": salt})
    for engine in (rig.cluster.prefill[0], rig.cluster.decode[0]):
        bodies = [json.loads(r.body) for r in engine.received if r.path == CHAT]
        salted = [b for b in bodies if "forwarded salt" in json.dumps(b["messages"])]
        assert len(salted) == 2, f"{engine.name} got {len(salted)} of the two turns"
        assert all(b.get("cache_salt") == salt for b in salted), (
            f"{engine.name} got cache_salt {[b.get('cache_salt') for b in salted]}")


@pytest.mark.parametrize("field", ["cache_salt", "user", "safety_identifier"])
async def test_a_salt_or_user_that_is_not_a_string_is_a_400(rig: Rig, field: str) -> None:
    before = rig.generation_requests()
    async with rig.router.client() as c:
        resp = await c.post(CHAT, json={"model": "tiny", "max_tokens": 2, field: ["A"],
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400, resp.text
    assert openai_error_of(resp)["error"]["param"] == field
    assert rig.generation_requests() == before
