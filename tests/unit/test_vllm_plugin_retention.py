"""The connector's retention bookkeeping on D (vllm_plugin.retention) and its sync thread
(vllm_plugin.retention_client), without an engine; clocks are passed in."""

import threading
import time
import urllib.request

import pytest

from kvrelay.core.retention_sync import RetentionOrders, TurnCurve
from kvrelay.core.return_curve import ReturnCurve
from kvrelay.vllm_plugin.retention import RetentionLedger, TurnState, blocks_needed
from kvrelay.vllm_plugin.retention_client import Engine, Orders, RetentionSyncClient
from tests.retention_router import StandInRouter

URL = "http://127.0.0.1:9/internal/kv-retention"
OTHER = "http://127.0.0.1:10/internal/kv-retention"
ENGINE = Engine(engine_id="d0", block_size=16, bytes_per_block=1024, num_blocks_total=24)
TOOL = ReturnCurve(return_p=0.9, log_mean=0.0, log_sigma=1.0)
REPLY = ReturnCurve(return_p=0.5, log_mean=4.0, log_sigma=1.0)


def ledger_with(*turns: tuple[str, int, float], managed: bool = True,
                headroom: float = 0.0, url: str | None = URL) -> RetentionLedger:
    ledger = RetentionLedger(managed=managed, headroom=headroom)
    for request_id, blocks, at_s in turns:
        ledger.retain(request_id, num_blocks=blocks, num_tokens=blocks * 16, now_s=at_s,
                      retain_s=100.0, url=url)
    return ledger


def test_accounting_follows_retain_and_free():
    ledger = ledger_with(("a", 12, 0.0), ("b", 6, 1.0))
    assert (ledger.retained_blocks, ledger.retained_tokens) == (18, 288)
    assert ledger.freed("a", now_s=5.0) is None, "read by P before its deadline: no release"
    assert ledger.retained_blocks == 6 and "a" not in ledger
    released = ledger.freed("b", now_s=101.0)
    assert released is not None and released.cause == "expired"
    assert ledger.releases_total["expired"] == 1 and ledger.retained_blocks == 0
    assert [r.request_id for r in ledger.take_released()] == ["b"]


def test_pressure_asks_the_router_and_frees_only_what_it_answers():
    ledger = ledger_with(("old", 12, 0.0), ("new", 12, 1.0))
    release = ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=13, now_s=2.0)
    assert release.request_ids == ("old", "new")
    assert ledger.state("old") is TurnState.RELEASING and ledger.has_pending()
    assert ledger.take_to_free() == [], "nothing is freed before the router answers"
    assert ledger.view(0).releasing == {URL: ("old", "new")}
    ledger.confirmed(OTHER, ["old"])
    assert ledger.take_to_free() == [], "another router cannot answer for this one's turns"
    ledger.confirmed(URL, ["old"])  # "new" is being read: the router leaves it out
    assert ledger.take_to_free() == ["old"] and ledger.state("new") is TurnState.RELEASING
    released = ledger.freed("old", now_s=2.5)
    assert released is not None and released.cause == "pressure"
    assert ledger.freed("new", now_s=2.6) is None, "P read it: not a release"


def test_pressure_and_headroom_ask_for_the_turns_least_likely_to_be_pulled_first():
    ledger = RetentionLedger(headroom=0.5)
    ledger.retain("old-reply", num_blocks=12, num_tokens=192, now_s=0.0, retain_s=100.0,
                  url=URL, curve=REPLY)
    ledger.retain("tool", num_blocks=12, num_tokens=192, now_s=1.0, retain_s=100.0, url=URL,
                  curve=TOOL)
    ledger.retain("unknown", num_blocks=1, num_tokens=16, now_s=2.0, retain_s=50.0, url=URL)
    assert [t.curve for t in ledger.turns()] == [REPLY, TOOL, None]
    release = ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=12, now_s=30.0)
    assert release.request_ids == ("tool",) and ledger.state("old-reply") is TurnState.HELD
    over = ledger.ask_over_headroom(num_blocks_total=24, now_s=31.0)
    assert over.request_ids == ("old-reply",), "a curve's turn before one without"


def test_d_logs_each_turn_it_asks_for_with_its_chance_of_a_pull():
    ledger = RetentionLedger()
    ledger.retain("tool", num_blocks=12, num_tokens=192, now_s=1.0, retain_s=100.0, url=URL,
                  curve=TOOL)
    ledger.retain("unknown", num_blocks=1, num_tokens=16, now_s=2.0, retain_s=50.0, url=URL)
    chance = ledger.turns()[0].pull_chance(30.0)
    assert 0.0 < chance < 0.1
    assert ledger.describe(["tool", "unknown", "gone"], 30.0) == (
        f"tool (pull chance {chance:.3f}), unknown (no curve), gone (no curve)")


def test_a_router_curve_makes_a_tool_calls_turn_the_first_asked_for():
    """Both turns were told the replies' curve (D cannot tell how its answer ends); the
    router then read that "tool" ended in a tool call and sends the tools' curve: 20 s on,
    "tool" is asked for before the older reply."""
    def told_replies() -> RetentionLedger:
        ledger = RetentionLedger()
        for request_id, at_s in (("reply", 0.0), ("tool", 1.0)):
            ledger.retain(request_id, num_blocks=12, num_tokens=192, now_s=at_s,
                          retain_s=100.0, url=URL, curve=REPLY)
        return ledger

    untold = told_replies()  # the same curve: the older goes first
    assert untold.ask_under_pressure(num_blocks_free=0, num_blocks_needed=12,
                                     now_s=20.0).request_ids == ("reply",)
    ledger = told_replies()
    ledger.take_curves([TurnCurve("tool", TOOL), TurnCurve("unknown", TOOL)])
    assert [t.curve for t in ledger.turns()] == [REPLY, TOOL]
    release = ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=12, now_s=20.0)
    assert release.request_ids == ("tool",) and ledger.state("reply") is TurnState.HELD


def test_blocks_on_their_way_count_as_free_for_the_next_ask():
    ledger = ledger_with(("a", 12, 0.0), ("b", 12, 1.0))
    ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=10, now_s=2.0)
    again = ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=10, now_s=2.1)
    assert again.request_ids == () and ledger.state("b") is TurnState.HELD


def test_an_unanswered_ask_gives_the_turn_back_and_backs_the_router_off():
    ledger = ledger_with(("a", 12, 0.0))
    ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=5, now_s=1.0)
    assert ledger.time_out(now_s=1.5) == []
    assert ledger.time_out(now_s=1.0 + ledger.confirm_timeout_s) == ["a"]
    assert ledger.state("a") is TurnState.HELD and not ledger.has_pending()
    later = 1.0 + ledger.confirm_timeout_s + 1.0
    assert ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=5,
                                     now_s=later).request_ids == ()
    assert ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=5,
                                     now_s=later + ledger.ask_backoff_s).request_ids == ("a",)


def test_a_turn_without_a_router_is_never_asked_for():
    ledger = ledger_with(("a", 12, 0.0), url=None)
    assert ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=5,
                                     now_s=1.0).request_ids == ()


def test_router_orders_free_at_once_and_headroom_asks():
    ledger = ledger_with(("a", 8, 0.0), ("b", 8, 1.0), ("c", 8, 2.0), headroom=0.5)
    ledger.ordered(["c", "unknown"])
    assert ledger.take_to_free() == ["c"]
    asked = ledger.ask_over_headroom(num_blocks_total=24, now_s=3.0)
    assert asked.request_ids == ("a",), "c is on its way out; a and b hold 4 over the cap"
    ledger.confirmed(URL, ["a", "b"])
    assert ledger.take_to_free() == ["a"], "b was not asked for: the answer cannot free it"
    assert ledger.freed("c", 3.1).cause == "router"  # type: ignore[union-attr]
    assert ledger.freed("a", 3.1).cause == "headroom"  # type: ignore[union-attr]


def test_stock_mode_accounts_but_never_releases():
    ledger = ledger_with(("a", 12, 0.0), managed=False, headroom=0.5)
    assert ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=20,
                                     now_s=1.0).request_ids == ()
    assert ledger.ask_over_headroom(num_blocks_total=12, now_s=1.0).request_ids == ()
    ledger.ordered(["a"])
    assert ledger.take_to_free() == [] and ledger.retained_blocks == 12


def test_blocks_needed_counts_the_first_decode_token_and_the_watermark():
    assert blocks_needed(1500, 128) == 12
    assert blocks_needed(1535, 128) == 12 and blocks_needed(1536, 128) == 13
    assert blocks_needed(100, 128, watermark_blocks=2) == 3
    with pytest.raises(ValueError):
        RetentionLedger(headroom=2.0)


def test_blocks_needed_beside_a_prefix_cache_hit_counts_only_hit_blocks_in_the_free_queue():
    assert blocks_needed(1500, 128, num_hit_blocks=9, num_free_hit_blocks=0) == 3
    assert blocks_needed(1500, 128, num_hit_blocks=9, num_free_hit_blocks=4) == 7
    assert blocks_needed(1500, 128, num_hit_blocks=9) == 12, "unknown: every hit block"
    assert blocks_needed(1500, 128, watermark_blocks=1, num_hit_blocks=9,
                         num_free_hit_blocks=0) == 4
    assert blocks_needed(1500, 128, num_hit_blocks=40, num_free_hit_blocks=0) == 0, \
        "a hit is never longer than the request"


@pytest.fixture
def router():
    stand_in = StandInRouter()
    yield stand_in
    stand_in.close()


def test_client_syncs_what_the_ledger_holds_and_hands_back_the_answer(router):
    client = RetentionSyncClient(["127.0.0.1"], ENGINE, background=False)
    assert client.add_url(router.url)
    assert not client.add_url("http://evil.example/x"), "hosts not allowed are never contacted"
    ledger = RetentionLedger()
    ledger.retain("a", num_blocks=12, num_tokens=180, now_s=0.0, retain_s=9.0, url=router.url)
    ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=5, now_s=1.0)
    router.answer = RetentionOrders(dropped=("a",))
    client.publish(ledger.view(num_blocks_free=3), ledger.take_released())
    assert client.sync_once() == 1
    sent = router.syncs[-1]
    assert sent["engine_id"] == "d0" and sent["retained_blocks"] == 12
    assert sent["releasing"] == ["a"] and sent["num_blocks_free"] == 3
    [answer] = client.take_orders()
    assert answer.url == router.url and answer.orders.dropped == ("a",)
    ledger.confirmed(answer.url, answer.orders.dropped)
    assert ledger.take_to_free() == ["a"]
    router.answer = RetentionOrders(curves=(TurnCurve("b", TOOL),))
    assert client.sync_once() == 1
    [curves_only] = client.take_orders()
    assert curves_only.orders.turn_curves == (TurnCurve("b", TOOL),)


def test_client_keeps_releases_for_a_router_until_it_hears_them(router):
    client = RetentionSyncClient(["127.0.0.1"], ENGINE, background=False)
    dead = "http://127.0.0.1:9/internal/kv-retention"
    client.add_url(dead)
    client.add_url(router.url)
    ledger = ledger_with(("a", 4, 0.0), ("b", 4, 0.5), url=router.url)
    ledger.ordered(["a"])
    ledger.take_to_free()
    ledger.freed("a", now_s=1.0)
    client.publish(ledger.view(20), ledger.take_released())
    assert client.sync_once() == 1, "the live router answered, the dead one did not"
    assert router.syncs[-1]["released"] == [{"request_id": "a", "cause": "router"}]
    assert router.syncs[-1]["releases_total"]["router"] == 1
    client.publish(ledger.view(20), [])
    assert client.sync_once() == 1, "D still holds b: it keeps syncing"
    assert router.syncs[-1]["released"] == [], "each release is told once per router"
    assert ledger.freed("b", now_s=2.0) is None  # P read it
    client.publish(ledger.view(24), ledger.take_released())
    assert client.sync_once() == 1, "one more sync says D holds nothing now"
    assert router.syncs[-1]["retained_requests"] == 0
    assert client.sync_once() == 0, "then D is quiet until it holds turns again"


def test_client_thread_syncs_at_once_when_asked(router):
    client = RetentionSyncClient(["127.0.0.1"], ENGINE, interval_s=3600.0)
    client.add_url(router.url)
    ledger = ledger_with(("a", 4, 0.0), url=router.url)
    client.publish(ledger.view(20), [], urgent=True)
    assert router.got.wait(10), "an urgent publish syncs without waiting for the interval"



def test_a_router_that_never_answers_holds_up_only_its_own_syncs(router):
    """D knows two routers; the first never answers (its POST blocks: a wedged replica, or
    one shutting down whose socket still listens). D's ask for a turn the second gave
    reaches the second, and its answer comes back, while the first's POST is still blocked:
    each router is synced from a lane of its own (one after another, the ask would wait
    behind the hung POST)."""
    hung_url = "http://127.0.0.1:9/hung/internal/kv-retention"
    in_hung_post = threading.Event()
    unblock = threading.Event()

    def post(url: str, body: bytes) -> bytes:
        if url == hung_url:
            in_hung_post.set()
            unblock.wait(30)
            raise OSError("no answer")
        request = urllib.request.Request(url, data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return bytes(answer.read())

    client = RetentionSyncClient(["127.0.0.1"], ENGINE, interval_s=3600.0, post=post)
    client.add_url(hung_url)
    client.add_url(router.url)
    ledger = ledger_with(("a", 4, 0.0), url=router.url)
    ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=2, now_s=1.0)
    router.answer = RetentionOrders(dropped=("a",))
    try:
        client.publish(ledger.view(0), [], urgent=True)
        assert in_hung_post.wait(10)
        answers: list[Orders] = []
        deadline = time.monotonic() + 10
        while not answers and time.monotonic() < deadline:
            answers = client.take_orders()
            time.sleep(0.01)
        still_blocked = not unblock.is_set()
    finally:
        unblock.set()
    assert still_blocked and [a.url for a in answers] == [router.url]
    assert router.syncs[-1]["releasing"] == ["a"]
    ledger.confirmed(router.url, answers[0].orders.dropped)
    assert ledger.take_to_free() == ["a"]


def test_a_gone_replicas_turns_are_asked_of_a_replica_naming_the_same_shared_state(router):
    """Replicas on one Redis name the same shared state in their answers. Replica A gave
    turn "a" and goes away (its connection refused); D's ask for "a" goes to replica B, and
    B's answer frees it as A's would have (D asked only A: "a" stayed pinned under pressure
    until its TTL, and a live request waited: probe 6, finding 3)."""
    other = StandInRouter()
    try:
        client = RetentionSyncClient(["127.0.0.1"], ENGINE, background=False)
        client.add_url(other.url)
        client.add_url(router.url)
        other.answer = router.answer = RetentionOrders(shared="redis-1")
        ledger = ledger_with(("a", 4, 0.0), url=other.url)
        ledger.retain("b", num_blocks=4, num_tokens=64, now_s=0.0, retain_s=100.0,
                      url=router.url)
        client.publish(ledger.view(20), [])
        assert client.sync_once() == 2  # both answered: both name "redis-1"
        other.close()  # replica A is gone
        ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=2, now_s=1.0)
        assert ledger.state("a") is TurnState.RELEASING
        router.answer = RetentionOrders(dropped=("a",), shared="redis-1")
        client.publish(ledger.view(0), [])
        assert client.sync_once() == 1  # A refused, B answered
        assert router.syncs[-1]["releasing"] == ["a"]
        answers = client.take_orders()
        assert [(o.url, o.orders.dropped) for o in answers] == [(other.url, ("a",))]
        for answer in answers:
            ledger.confirmed(answer.url, answer.orders.dropped)
        assert ledger.take_to_free() == ["a"]
    finally:
        other.server.server_close()


def test_a_turn_is_never_asked_of_a_router_that_shares_nothing_with_its_own(router):
    """A router whose answers name no shared state (or another) is never asked for a turn
    another router gave: it could not know that one's reads in progress."""
    other = StandInRouter()
    try:
        client = RetentionSyncClient(["127.0.0.1"], ENGINE, background=False)
        client.add_url(other.url)
        client.add_url(router.url)
        other.answer = RetentionOrders(shared="redis-1")
        router.answer = RetentionOrders(shared="redis-2")
        ledger = ledger_with(("a", 4, 0.0), url=other.url)
        client.publish(ledger.view(20), [])
        assert client.sync_once() == 2
        other.close()
        ledger.ask_under_pressure(num_blocks_free=0, num_blocks_needed=2, now_s=1.0)
        client.publish(ledger.view(0), [])
        client.sync_once()
        assert all(sync["releasing"] == [] for sync in router.syncs)
        assert client.take_orders() == []
    finally:
        other.server.server_close()
