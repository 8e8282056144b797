"""Issue #23, findings 6 and 8: what ``/stats`` and ``/metrics`` tell whom.

* 6: the conversation tags ``/stats`` shows are keyed: nobody can confirm a guessed session
  id or first message offline. Two routers without a shared key tag one conversation
  differently (a public hash would agree, and match the guess); routers sharing
  ``--tag-key`` agree, as replicas must.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.component.router_process import RouterProcess, eventually, fake_rig

pytestmark = pytest.mark.asyncio(loop_scope="module")

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
    async with router.client() as c:
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
