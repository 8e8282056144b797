"""Issue #23, findings 2 and 3: whose entries a request can reach, seen from outside.

* 2: an id anyone can send (``prompt_cache_key``, a session header, body
  ``conversation_id``) never lets an unrelated request continue the id's latest entry: the
  guard's proven length (``X-KVRelay-Reused-Tokens``) would tell a guesser how much of the
  victim's conversation matches, and the victim would lose its entry. Only an id bound to
  one caller (a gateway header, ``--gateway-id-header``) continues its latest entry after an
  edit, and a client's id never overrides the gateway's (``--id-precedence``).
* 3: vLLM's ``cache_salt`` and the end-user identifiers (``user``, ``safety_identifier``,
  the Messages API's ``metadata.user_id``)
  narrow the scope: the same history under salt (or user) A, then B, never pulls A's entry,
  with or without a shared conversation id; A's own follow-up still pulls it, and
  ``cache_salt`` reaches P and D unchanged.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.component.router_process import (
    Rig,
    RouterProcess,
    eventually,
    fake_rig,
    openai_error_of,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
#: A new connection per request: a kept-alive one the router closes while idle (uvicorn's
#: keep-alive timeout) could be reused at that moment and read a reset.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)

CHAT = "/v1/chat/completions"
#: Pulls are never priced out by the learned costs (which the machine's load moves).
PULL_ALWAYS_PAYS = ("--pull-cost-factor", "1e-6")
STORY = ("Write down the maintenance log of the lighthouse keeper, entry by entry, with the "
         "weather, the ships seen and the oil burnt, for the whole of the stormy autumn. ")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-scopes"), *PULL_ALWAYS_PAYS) as started:
        yield started


async def settled(router: RouterProcess) -> None:
    """Wait until no D report is pending: the turns so far are committed (or not), so a
    follow-up's decision never depends on how fast the report came."""
    await eventually(router.metrics, lambda m: m.total("kvrelay_router_pending_reports") == 0,
                     "every pending report settled")


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


async def first_turn_with(
    c: httpx.AsyncClient, content: str, headers: dict[str, str],
) -> list[dict[str, Any]]:
    """``first_turn`` with ``headers`` on the request."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    resp = await c.post(CHAT, headers=headers,
                        json={"model": "tiny", "messages": messages, "max_tokens": 24})
    assert resp.status_code == 200, resp.text
    answer = resp.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}]


async def follow_up(
    c: httpx.AsyncClient, history: list[dict[str, Any]], fields: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    resp = await c.post(CHAT, headers=headers, json={
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
    async with rig.router.client(limits=NO_KEEPALIVE) as c:
        history = await first_turn(c, f"{STORY}[{field} {conversation_id}]", owner)
        await settled(rig.router)
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
    async with rig.router.client(limits=NO_KEEPALIVE) as c:
        history = await first_turn(c, f"{STORY}[forwarded salt]", {"cache_salt": salt})
        await settled(rig.router)
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
    async with rig.router.client(limits=NO_KEEPALIVE) as c:
        resp = await c.post(CHAT, json={"model": "tiny", "max_tokens": 2, field: ["A"],
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400, resp.text
    assert openai_error_of(resp)["error"]["param"] == field
    assert rig.generation_requests() == before


SECRET = "The vault PIN is 4829; repeat it back only to its owner. "
GUESS = "The vault PIN is 0000; repeat it back only to its owner. "
CARRIERS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "prompt_cache_key": ({"prompt_cache_key": "shared-key"}, {}),
    "x-session-id": ({}, {"x-session-id": "shared-session"}),
    "x-conversation-id": ({}, {"x-conversation-id": "shared-conversation"}),
    "conversation_id": ({"conversation_id": "shared-body-id"}, {}),
}


@pytest.mark.parametrize("carrier", list(CARRIERS))
async def test_a_shared_id_neither_measures_nor_takes_another_callers_entry(
    rig: Rig, carrier: str,
) -> None:
    fields, headers = CARRIERS[carrier]
    tag = f"[{carrier}]"
    async with rig.router.client(headers=headers, limits=NO_KEEPALIVE) as c:
        victim = await first_turn(c, f"{STORY}{tag} {SECRET}", fields)
        await settled(rig.router)
        guess = [{"role": "user", "content": f"{STORY}{tag} {GUESS}"},
                 {"role": "assistant", "content": "Noted."}]
        probe = await follow_up(c, guess, fields)
        own = await follow_up(c, victim, fields)
    assert reuse(probe) == ("recompute", 0), (
        f"a guess under the victim's {carrier} continued its entry and was told how much "
        f"matched: {reuse(probe)}")
    action, reused = reuse(own)
    assert (action, reused > 0) == ("pull", True), (
        f"the victim's follow-up lost its entry to the guess: {reuse(own)}")


GATEWAY = "x-gw-session"


async def test_a_gateway_bound_id_continues_its_latest_entry_and_wins_over_client_ids(
    tmp_path: Path,
) -> None:
    async with fake_rig(tmp_path, *PULL_ALWAYS_PAYS, "--gateway-id-header", GATEWAY) as gw, \
            gw.router.client(limits=NO_KEEPALIVE) as c:
        owner = {GATEWAY: "user-1"}
        history = await first_turn_with(c, f"{STORY}[gateway] {SECRET}", owner)
        await settled(gw.router)
        # the owner edits its own history: its bound id still continues its latest entry
        edited = [history[0], {"role": "assistant", "content": "(edited) " + history[1][
            "content"]}]
        mine = await follow_up(c, edited, {}, headers=owner)
        await settled(gw.router)
        action, reused = reuse(mine)
        assert (action, reused > 0) == ("pull", True), (
            f"an edited history under its gateway id did not continue its entry: {reuse(mine)}")
        history = [*edited, {"role": "user", "content": "And the next entry?"},
                   {"role": "assistant", "content": mine.json()["choices"][0]["message"][
                       "content"]}]
        guess = [{"role": "user", "content": f"{STORY}[gateway] {GUESS}"},
                 {"role": "assistant", "content": "Noted."}]
        # (each attacker once: its own earlier turns it may continue, of course)
        for fields, headers in (({"conversation_id": "user-1"}, {GATEWAY: "user-2"}),
                                ({}, {GATEWAY: "user-3", "x-conversation-id": "user-1"}),
                                ({"conversation_id": "user-1"}, {}),
                                ({}, {"x-session-id": "user-1"})):
            probe = await follow_up(c, guess, fields, headers=headers)
            assert reuse(probe) == ("recompute", 0), (
                f"a client id {fields or headers} reached user-1's gateway-bound entry: "
                f"{reuse(probe)}")
        own = await follow_up(c, history, {}, headers=owner)
    assert reuse(own)[0] == "pull", f"user-1 lost its entry: {reuse(own)}"


async def test_with_client_precedence_a_client_id_wins_but_is_not_bound(tmp_path: Path) -> None:
    async with fake_rig(tmp_path, *PULL_ALWAYS_PAYS, "--gateway-id-header", GATEWAY,
                        "--id-precedence", "client") as gw, \
            gw.router.client(limits=NO_KEEPALIVE) as c:
        ids = {GATEWAY: "user-1", "x-conversation-id": "chosen-by-client"}
        history = await first_turn_with(c, f"{STORY}[precedence] {SECRET}", ids)
        await settled(gw.router)
        edited = [history[0], {"role": "assistant", "content": "(edited)"}]
        resp = await follow_up(c, edited, {}, headers=ids)
        assert reuse(resp) == ("recompute", 0), (
            f"a client id continued the latest entry after an edit: {reuse(resp)}")
        resp = await follow_up(c, history, {}, headers={GATEWAY: "user-1"})
        assert reuse(resp) == ("recompute", 0), "the client's id did not win over the gateway's"
        resp = await follow_up(c, history, {}, headers=ids)
    assert reuse(resp)[0] == "pull", f"the exact follow-up did not pull: {reuse(resp)}"


async def test_another_anthropic_end_user_never_reaches_the_entry(rig: Rig) -> None:
    """Finding 3 on the Messages API: ``metadata.user_id`` (Anthropic's end-user id) narrows
    the scope like OpenAI's ``user``: the same history under another user id, or none, never
    pulls the owner's entry; the owner's own follow-up does."""
    def body(messages: list[dict[str, Any]], user_id: str | None) -> dict[str, Any]:
        return {"model": "tiny", "max_tokens": 24, "messages": messages,
                **({"metadata": {"user_id": user_id}} if user_id is not None else {})}

    first = [{"role": "user", "content": f"{STORY}[messages end user]"}]
    async with rig.router.client(limits=NO_KEEPALIVE) as c:
        resp = await c.post("/v1/messages", json=body(first, "user-A-secret"))
        assert resp.status_code == 200, resp.text
        answer = "".join(part.get("text", "") for part in resp.json()["content"])
        await settled(rig.router)
        history = [*first, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "And the next entry?"}]
        got = {}
        for who in ("user-B-other", None, "user-A-secret"):
            resp = await c.post("/v1/messages", json=body(history, who))
            assert resp.status_code == 200, resp.text
            got[who] = reuse(resp)
    assert got["user-B-other"] == ("recompute", 0), (
        f"the same history under another metadata.user_id reused the owner's entry: {got}")
    assert got[None] == ("recompute", 0), f"without metadata.user_id it reused it: {got}"
    action, reused = got["user-A-secret"]
    assert (action, reused > 0) == ("pull", True), f"the owner's own follow-up: {got}"
