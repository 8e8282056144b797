"""The in-memory Responses store (TTL, size bound, tenants), the router-minted ids, and a
turn's ``KeptResponse`` (the fields it patches, what it keeps)."""

from __future__ import annotations

import json
import re
from typing import Any

from kvrelay.fakevllm import ManualClock
from kvrelay.router.response_keeper import KeptResponse
from kvrelay.router.response_store import (
    InMemoryResponseStore,
    StoredResponse,
    new_response_id,
)

ITEM = StoredResponse(b'[{"role":"user","content":"hi"}]', b'{"output":[]}')  # 45 bytes


def test_ids_are_resp_and_128_random_bits() -> None:
    ids = {new_response_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"resp_[0-9a-f]{32}", i) for i in ids)


async def test_memory_store_expires_bounds_and_separates_tenants() -> None:
    clock = ManualClock()
    evicted: list[str] = []
    store = InMemoryResponseStore(ttl_s=10.0, max_bytes=100, clock=clock,
                                  on_evict=evicted.append)
    assert await store.put("a", "r1", ITEM)
    clock.advance(5.0)
    assert await store.put("a", "r2", ITEM)
    assert await store.get("a", "r1") == ITEM and await store.get("b", "r1") is None
    assert store.num_bytes == 2 * ITEM.num_bytes
    assert await store.put("a", "r3", ITEM)  # 135 > 100: the oldest (r1) goes
    assert evicted == ["capacity"]
    assert await store.get("a", "r1") is None and await store.get("a", "r2") == ITEM
    clock.advance(9.0)  # r2 and r3 are 9 s old
    assert await store.get("a", "r3") == ITEM
    clock.advance(1.0)
    assert await store.get("a", "r2") is None and await store.get("a", "r3") is None
    assert evicted == ["capacity", "expired", "expired"]
    assert not await store.put("a", "big", StoredResponse(b"x" * 101, b""))
    assert await store.put("a", "r4", ITEM)
    assert not await store.delete("b", "r4")
    assert await store.delete("a", "r4") and not await store.delete("a", "r4")
    assert len(store) == 0 and store.num_bytes == 0


async def test_a_tenant_past_its_share_evicts_only_its_own_oldest() -> None:
    """One tenant's traffic cannot push another's responses out (``max_bytes_per_tenant``):
    past its share its own oldest go; the global bound still evicts the oldest of all."""
    clock = ManualClock()
    evicted: list[str] = []
    store = InMemoryResponseStore(ttl_s=10.0, max_bytes=200, max_bytes_per_tenant=100,
                                  clock=clock, on_evict=evicted.append)
    assert await store.put("a", "a1", ITEM)
    for i in range(6):  # b floods: 6 x 45 bytes, its share is 100
        clock.advance(0.1)
        assert await store.put("b", f"b{i}", ITEM)
    assert await store.get("a", "a1") == ITEM  # a's response stays
    assert [await store.get("b", f"b{i}") is not None for i in range(6)] == [False] * 4 + [True] * 2
    assert evicted == ["capacity"] * 4
    assert not await store.put("b", "big", StoredResponse(b"x" * 101, b""))  # over a share
    assert await store.put("a", "a2", ITEM) and await store.put("c", "c1", ITEM)
    # 5 x 45 = 225 > 200: the oldest of all (a1) goes, and nothing of a tenant's share leaks
    assert await store.get("a", "a1") is None and len(store) == 4
    assert store.num_bytes == 4 * ITEM.num_bytes
    for tenant, rid in (("a", "a2"), ("b", "b4"), ("b", "b5"), ("c", "c1")):
        assert await store.delete(tenant, rid)
    assert len(store) == 0 and store.num_bytes == 0
    assert await store.put("b", "b6", ITEM) and await store.put("b", "b7", ITEM)  # share again


async def test_a_put_again_replaces_and_restarts_the_ttl() -> None:
    clock = ManualClock()
    store = InMemoryResponseStore(ttl_s=10.0, max_bytes=1000, clock=clock)
    await store.put("a", "r1", ITEM)
    clock.advance(8.0)
    other = StoredResponse(b"[]", b'{"output":[1]}')
    await store.put("a", "r1", other)
    clock.advance(8.0)
    assert await store.get("a", "r1") == other
    assert store.num_bytes == other.num_bytes


class _Inner:
    """A stand-in for an adapter's scanner: passes events through, ends on the final one."""

    def __init__(self) -> None:
        self.done = False
        self.error: object = None
        self.params: object = None
        self.params_seen = False
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []

    def feed(self, events: bytes) -> bytes:
        if b"response.completed" in events:
            self.done = True
        return events

    def answer(self) -> tuple[str, list[Any]]:
        return "", []


def event(kind: str, response: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps(
        {"type": kind, "response": response}).encode() + b"\n\n"


async def test_kept_response_patches_every_snapshot_and_keeps_the_final() -> None:
    store = InMemoryResponseStore(ttl_s=10.0, max_bytes=10_000, clock=ManualClock())
    items = [{"role": "user", "content": "hi"}]
    kept = KeptResponse(store=store, tenant="a", response_id="resp_new", previous_id="resp_old",
                        input_items=items)
    scan = kept.scanner(_Inner())  # type: ignore[arg-type]
    d = {"id": "resp_d", "store": False, "previous_response_id": None}
    delta = b'event: response.output_text.delta\ndata: {"delta":"\\"store\\":false"}\n\n'
    out = scan.feed(event("response.created", {**d, "status": "in_progress"}) + delta)
    assert delta in out and not scan.done
    final = {**d, "status": "completed", "output": [{"type": "message"}]}
    out += scan.feed(event("response.completed", final))
    assert scan.done
    snapshots = [json.loads(b.partition(b"data: ")[2])["response"]
                 for b in out.split(b"\n\n") if b.startswith(b"event: response.c")]
    assert [(s["id"], s["store"], s["previous_response_id"]) for s in snapshots] == \
        [("resp_new", True, "resp_old")] * 2
    assert await kept.commit()
    stored = await store.get("a", "resp_new")
    assert stored is not None
    assert json.loads(stored.input_json) == items
    assert json.loads(stored.response_json) == snapshots[1]


async def test_not_kept_unless_stored_and_finished() -> None:
    store = InMemoryResponseStore(ttl_s=10.0, max_bytes=10_000, clock=ManualClock())
    shown = KeptResponse(store=None, tenant="a", response_id=None, previous_id="resp_old",
                         input_items=[])
    body: dict[str, Any] = {"id": "resp_d", "status": "completed"}
    shown.patch(body, final=True)
    assert body == {"id": "resp_d", "status": "completed", "store": False,
                    "previous_response_id": "resp_old"}
    assert not await shown.commit()
    failed = KeptResponse(store=store, tenant="a", response_id="resp_x", previous_id=None,
                          input_items=[])
    failed.patch({"status": "failed"}, final=True)
    assert not await failed.commit() and len(store) == 0
    unfinished = KeptResponse(store=store, tenant="a", response_id="resp_y", previous_id=None,
                              input_items=[])
    unfinished.patch({"status": "in_progress"}, final=False)
    assert not await unfinished.commit() and len(store) == 0
