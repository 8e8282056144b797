"""InMemoryIndex: lookups by digests (continuations, ambiguity, no stealing), single-use
claims, drops, LRU caps per tenant and in total, TTL purge, retained tokens."""

from __future__ import annotations

import asyncio

from msgspec.structs import replace

from kvrelay.core.conversation import ConversationEntry
from kvrelay.core.identity import TEXT_BLOCK_BYTES, TEXT_FINE_BYTES, scope_of
from kvrelay.router.index import (
    MAX_TEXT_BLOCKS,
    MAX_TEXT_DIGESTS,
    ConversationIndex,
    EvictReason,
    InMemoryIndex,
)
from tests.unit.index_entries import (
    BLOCKS,
    assistant,
    chat,
    entry,
    stored_at,
    text,
    text_stored_at,
    user,
)

SYSTEM = user("You are a careful agent. " * 20)
FIRST = user("Fix the failing test in repo X.")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_follow_up_finds_the_entry_of_the_turn_it_continues() -> None:
    index = InMemoryIndex()
    assert isinstance(index, ConversationIndex)
    turn1 = chat(SYSTEM, FIRST)
    e = entry()
    await index.put(stored_at(turn1, "I will look."), e, tenant="t")
    follow = chat(SYSTEM, FIRST, assistant("I will look."), user("Go on."))
    found = await index.lookup(follow)
    assert found is not None and found.entry == e
    assert found.ref == stored_at(turn1, "I will look.")
    assert found.probe.covered_bytes < follow.prompt_bytes
    tool_turn = chat(SYSTEM, FIRST, assistant("I will look."), user("tool output"), user("x"))
    assert await index.lookup(tool_turn) is not None


async def test_the_answer_must_be_the_one_d_gave() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    await index.put(stored_at(turn1, "I will look."), entry(), tenant="t")
    assert await index.lookup(chat(SYSTEM, FIRST, assistant("Something else."), user("?"))) \
        is None
    same_up_to_space = chat(SYSTEM, FIRST, assistant("  I will look.\n"), user("Go on."))
    assert await index.lookup(same_up_to_space) is not None


async def test_many_conversations_sharing_a_prefix_each_find_their_own() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    entries = {f"answer {i}": entry(turn=i + 1) for i in range(8)}
    for answer, e in entries.items():
        await index.put(stored_at(turn1, answer), e, tenant="t")
    for answer, e in entries.items():
        found = await index.lookup(chat(SYSTEM, FIRST, assistant(answer), user("next")))
        assert found is not None and found.entry == e


async def test_a_request_sharing_only_a_prefix_never_finds_the_entry() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    await index.put(stored_at(turn1, "I will look."), entry(), tenant="t")
    assert await index.lookup(chat(SYSTEM, user("Another task."))) is None
    assert await index.lookup(chat(SYSTEM, FIRST)) is None  # the same request again
    assert await index.lookup(chat(SYSTEM, user("Another task."), assistant("I will look."),
                                   user("Go on."))) is None


async def test_the_longest_continued_turn_wins() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    turn2 = chat(SYSTEM, FIRST, assistant("a1"), user("u2"))
    older, newer = entry(turn=1), entry(turn=2)
    await index.put(stored_at(turn1, "a1"), older, tenant="t")
    await index.put(stored_at(turn2, "a2"), newer, tenant="t")
    found = await index.lookup(chat(SYSTEM, FIRST, assistant("a1"), user("u2"),
                                    assistant("a2"), user("u3")))
    assert found is not None and found.entry == newer
    retried = await index.lookup(chat(SYSTEM, FIRST, assistant("a1"), user("u2 edited")))
    assert retried is not None and retried.entry == older


async def test_scopes_are_separate() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST, scope=scope_of("t", "conv-1"))
    await index.put(stored_at(turn1, "a"), entry(), tenant="t")
    follow = [SYSTEM, FIRST, assistant("a"), user("b")]
    assert await index.lookup(chat(*follow, scope=scope_of("t", "conv-1"))) is not None
    assert await index.lookup(chat(*follow, scope=scope_of("t", "conv-2"))) is None
    assert await index.lookup(chat(*follow, scope=scope_of("t", None))) is None
    assert await index.lookup(chat(*follow, scope=scope_of("u", "conv-1"))) is None
    assert await index.drop_scope(scope_of("t", "conv-1")) == 1
    assert len(index) == 0


async def test_completions_continue_by_text() -> None:
    index = InMemoryIndex()
    prompt = "Once upon a time " * 200
    turn1 = text(prompt)
    e = entry()
    await index.put(text_stored_at(turn1, " there was a river."), e, tenant="t")
    found = await index.lookup(text(prompt + " there was a river." + " And then?"))
    assert found is not None and found.entry == e
    assert await index.lookup(text(prompt + " there was a mountain." + " And then?")) is None
    assert await index.lookup(text(prompt + " there was a river.")) is None  # nothing new
    assert await index.lookup(text(prompt[:-5] + "XXXXX there was a river. More")) is None


async def test_claim_is_single_use_even_when_racing() -> None:
    index = InMemoryIndex()
    ref, e = stored_at(chat(SYSTEM, FIRST), "a"), entry()
    await index.put(ref, e, tenant="t")
    results = await asyncio.gather(*(index.claim(ref, e) for _ in range(10)))
    assert results.count(e) == 1 and results.count(None) == 9
    assert len(index) == 0
    await index.put(ref, e, tenant="t")
    other = replace(e, blocks=replace(e.blocks, request_id="other"))
    await index.put(ref, other, tenant="t")  # interchangeable: both are kept
    assert len(index) == 2
    assert await index.claim(ref, e) == e  # the one asked for while it is there
    assert await index.claim(ref, e) == other  # then the other one of the ref
    assert await index.claim(ref, e) is None
    await index.put(ref, e, tenant="t")
    await index.put(ref, replace(e, expires_at_s=e.expires_at_s + 9), tenant="t")
    assert len(index) == 1  # the same D request stored again replaces it


async def test_identical_entries_are_all_kept_and_each_claimed_once() -> None:
    """Eight identical conversations finishing together store eight entries at one ref:
    eight claims of what each looked up (the same newest entry) take one each."""
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    ref = stored_at(turn1, "a")
    stored = [replace(entry(), blocks=replace(entry().blocks, request_id=f"r{i}"))
              for i in range(8)]
    for e in stored:
        await index.put(ref, e, tenant="t")
    await index.put(ref, stored[3], tenant="t")  # the same entry again: replaced, not added
    assert len(index) == 8
    follow = chat(SYSTEM, FIRST, assistant("a"), user("b"))
    seen = [await index.lookup(follow) for _ in range(8)]
    assert all(f is not None and f.entry == stored[3] for f in seen)  # the newest
    claimed = await asyncio.gather(*(index.claim(ref, f.entry) for f in seen if f))
    assert sorted(c.request_id for c in claimed if c) == sorted(e.request_id for e in stored)
    assert await index.lookup(follow) is None and len(index) == 0


async def test_a_ref_keeps_at_most_max_per_ref_the_oldest_pushed_out_and_released() -> None:
    evicted: list[EvictReason] = []
    index = InMemoryIndex(max_per_ref=2, on_evict=lambda e, why: evicted.append(why))
    ref = stored_at(chat(SYSTEM, FIRST), "a")
    stored = [replace(entry(), blocks=replace(entry().blocks, request_id=f"r{i}"))
              for i in range(3)]
    for e in stored:
        await index.put(ref, e, tenant="t")
    assert len(index) == 2 and evicted == ["overflow"]
    assert await index.take_releases("d0", BLOCKS.engine_id) == ("r0",)
    assert await index.take_releases("d0", BLOCKS.engine_id) == ()


async def test_drops() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    await index.put(stored_at(turn1, "1"), entry("d0"), tenant="t")
    await index.put(stored_at(turn1, "2"), entry("d0", engine="new"), tenant="t")
    await index.put(stored_at(turn1, "3"), entry("d1"), tenant="t")
    assert await index.drop(stored_at(turn1, "3"), entry("d1", now=1.0)) is False
    assert await index.drop_engine("d0", BLOCKS.engine_id) == 1
    assert await index.drop_node("d0") == 1
    assert len(index) == 1
    assert await index.drop(stored_at(turn1, "3")) is True and len(index) == 0


async def test_caps_evict_the_least_recently_used_per_tenant_and_in_total() -> None:
    evicted: list[EvictReason] = []
    index = InMemoryIndex(3, max_per_tenant=2, on_evict=lambda e, why: evicted.append(why))
    turn1 = chat(SYSTEM, FIRST)
    await index.put(stored_at(turn1, "a1"), entry(), tenant="a")
    await index.put(stored_at(turn1, "a2"), entry(), tenant="a")
    await index.lookup(chat(SYSTEM, FIRST, assistant("a1"), user("x")))  # a2 is now LRU
    await index.put(stored_at(turn1, "a3"), entry(), tenant="a")
    assert await index.lookup(chat(SYSTEM, FIRST, assistant("a2"), user("x"))) is None
    assert await index.lookup(chat(SYSTEM, FIRST, assistant("a1"), user("x"))) is not None
    await index.put(stored_at(turn1, "b1"), entry(), tenant="b")
    await index.put(stored_at(turn1, "b2"), entry(), tenant="b")
    assert len(index) == 3
    assert evicted == ["capacity", "capacity"]


async def test_expired_entries_stay_visible_then_are_purged() -> None:
    clock = Clock()
    evicted: list[EvictReason] = []
    index = InMemoryIndex(clock=clock, expired_retention_s=60, sweep_interval_s=1,
                          on_evict=lambda e, why: evicted.append(why))
    e = entry(now=clock.now)  # expires at 100 + 470
    await index.put(stored_at(chat(SYSTEM, FIRST), "a"), e, tenant="t")
    follow = chat(SYSTEM, FIRST, assistant("a"), user("b"))
    clock.now = e.expires_at_s + 30  # expired, still visible: the policy says "expired"
    assert index.retained_tokens(clock.now) == {}
    found = await index.lookup(follow)
    assert found is not None and found.entry == e
    clock.now = e.expires_at_s + 61
    assert await index.lookup(follow) is None
    assert evicted == ["expired"]


async def test_retained_tokens_count_live_entries_per_node() -> None:
    index = InMemoryIndex()
    turn1 = chat(SYSTEM, FIRST)
    await index.put(stored_at(turn1, "1"), entry("d0"), tenant="t")
    await index.put(stored_at(turn1, "2"), entry("d0"), tenant="t")
    await index.put(stored_at(turn1, "3"), entry("d1"), tenant="t")
    assert index.retained_tokens(101.0) == {"d0": 2 * 2056, "d1": 2056}
    await index.claim(stored_at(turn1, "1"), entry("d0"))
    assert index.retained_tokens(101.0) == {"d0": 2056, "d1": 2056}


STORY = "Once upon a time, in a lighthouse by the sea, the keeper wrote: "


async def text_lookup_digests(index: InMemoryIndex, counts: list[int], prompt: str) -> int:
    """How many digests one completions lookup of ``prompt`` computed."""
    before = len(counts)
    await index.lookup(text(prompt))
    assert len(counts) == before + 1
    return counts[-1]


async def test_completions_lookup_work_is_the_same_with_10_or_10_000_entries_in_a_block() -> None:
    """Issue #23, finding 4: every prompt under 1 KiB shares block 0's anchor; a lookup
    used to hash every entry there. Now it computes the same digests however many."""
    work: list[int] = []
    for num_entries in (10, 10_000):
        counts: list[int] = []
        index = InMemoryIndex(on_text_digests=counts.append)
        other = entry()
        for i in range(num_entries):  # other conversations in the scope, all in block 0
            await index.put(text_stored_at(text(f"{i:05d} {STORY}"), f" entry {i}."),
                            replace(other, turn=i + 1), tenant="t")
        mine = entry(node="d1")
        await index.put(text_stored_at(text(STORY), " calm sea."), mine, tenant="t")
        found = await index.lookup(text(STORY + " calm sea. Next day:"))
        assert found is not None and found.entry == mine
        assert found.probe is not None \
            and found.probe.covered_bytes == len(STORY + " calm sea.")
        work.append(counts[-1])
    assert work[0] == work[1] <= MAX_TEXT_DIGESTS


async def test_a_completions_lookup_stops_at_its_budget() -> None:
    """Entries in every block of a long prompt, none of which it carries: the lookup looks
    into ``MAX_TEXT_BLOCKS`` blocks, longest first, then stops; in one block holding an end
    at every offset under the request's fine digests, it stops at ``MAX_TEXT_DIGESTS``."""
    counts: list[int] = []
    index = InMemoryIndex(on_text_digests=counts.append)
    prompt = "".join(f"line {i:06d} of the log\n" for i in range(2500))  # 60 blocks
    blocks = len(prompt) // TEXT_BLOCK_BYTES
    for j in range(blocks):
        head = prompt[: j * TEXT_BLOCK_BYTES + 100]
        await index.put(text_stored_at(text(head), " (edited)"), entry(turn=j + 1), tenant="t")
    assert await index.lookup(text(prompt)) is None
    fines_per_block = TEXT_BLOCK_BYTES // TEXT_FINE_BYTES
    assert counts[-1] == MAX_TEXT_BLOCKS * (fines_per_block + 1)

    counts.clear()
    index = InMemoryIndex(on_text_digests=counts.append)
    for end in range(1, TEXT_BLOCK_BYTES):  # entries ending at every offset of block 0
        await index.put(text_stored_at(text(prompt[:end]), "#"), entry(), tenant="t")
    assert await index.lookup(text(prompt)) is None  # carries none ("#" is not next)
    assert counts[-1] == MAX_TEXT_DIGESTS


async def test_completions_prefer_the_longest_end_then_the_newest() -> None:
    index = InMemoryIndex()
    short, long_, newer = entry(node="d0"), entry(node="d1"), entry(node="d2")
    await index.put(text_stored_at(text(STORY), " a"), short, tenant="t")
    await index.put(text_stored_at(text(STORY), " a storm came."), long_, tenant="t")
    found = await index.lookup(text(STORY + " a storm came. And then?"))
    assert found is not None and found.entry == long_
    await index.put(text_stored_at(text(STORY + " a"), " storm came."), newer, tenant="t")
    found = await index.lookup(text(STORY + " a storm came. And then?"))
    assert found is not None and found.entry == newer  # the same text: one ref, newest
    assert await index.drop(found.ref) and len(index) == 1
    found = await index.lookup(text(STORY + " a storm came. And then?"))
    assert found is not None and found.entry == short


async def test_completions_ends_leave_with_their_entries() -> None:
    index = InMemoryIndex()
    refs = [text_stored_at(text(f"{i} {STORY}" * 30), f" answer {i}.") for i in range(3)]
    for ref in refs:
        await index.put(ref, entry(), tenant="t")
        await index.put(ref, entry(node="d1"), tenant="t")
    assert await index.claim(refs[0], entry()) is not None
    for ref in refs:
        await index.drop(ref)
    assert len(index) == 0 and index._ends == {}


def flagged(request: str, expires_at_s: float = 130.0) -> ConversationEntry:
    e = entry()
    return replace(e, blocks=replace(e.blocks, request_id=request), expires_at_s=expires_at_s,
                   release_at_expiry=True)


async def test_purging_a_flagged_entry_orders_its_release_once() -> None:
    """Purged ``expired_retention_s`` after expiry: one already ordered at expiry orders
    nothing more; one no sync ordered yet is ordered by the purge, once."""
    clock = Clock()
    evicted: list[EvictReason] = []
    index = InMemoryIndex(clock=clock, expired_retention_s=60, sweep_interval_s=1,
                          on_evict=lambda e, why: evicted.append(why))
    turn1 = chat(SYSTEM, FIRST)
    await index.put(stored_at(turn1, "a"), flagged("a"), tenant="t")
    clock.now = 131.0
    assert await index.take_releases("d0", BLOCKS.engine_id) == ("a",)
    await index.put(stored_at(turn1, "b"), flagged("b", expires_at_s=140.0), tenant="t")
    clock.now = 201.0  # past a's and b's expiry + 60: the next call sweeps
    assert await index.lookup(chat(SYSTEM, FIRST, assistant("a"), user("x"))) is None
    assert evicted == ["expired", "expired"] and len(index) == 0
    assert await index.take_releases("d0", BLOCKS.engine_id) == ("b",)
    assert await index.take_releases("d0", BLOCKS.engine_id) == ()


async def test_a_sweep_drops_what_can_no_longer_be_ordered_from_the_expiry_heaps() -> None:
    """Claimed flagged entries leave their node's heap at the next sweep, not only when a
    sync pops them: the heaps hold what may still be ordered (bounded memory)."""
    clock = Clock()
    index = InMemoryIndex(clock=clock, sweep_interval_s=1)
    turn1 = chat(SYSTEM, FIRST)
    for i in range(50):
        await index.put(stored_at(turn1, f"c{i}"), flagged(f"c{i}", 400.0), tenant="t")
        assert await index.claim(stored_at(turn1, f"c{i}"), flagged(f"c{i}", 400.0))
    await index.put(stored_at(turn1, "kept"), flagged("kept", 400.0), tenant="t")
    assert len(index._due["d0"]) == 51
    assert index.sweep() == 0
    assert [item[2] for item in index._due["d0"]] == [(stored_at(turn1, "kept"), 51)]
    assert await index.claim(stored_at(turn1, "kept"), flagged("kept", 400.0))
    index.sweep()
    assert index._due == {}
