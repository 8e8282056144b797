"""Issue #21, "release when the router knows the entry is dead", on the real cluster: an entry
the router evicts from its index is released on D at D's next sync, not at the TTL.

An extra router with ``--max-entries 1`` in front of the session cluster's engines (the
session cluster's D runs kvrelay's connector in managed retention: ``kvrelay up``'s default,
``--retention managed``, which writes no ``kvrelay_retention`` key into D's
``kv_connector_extra_config`` because managed is the connector's own default; the release
with cause ``router`` below is what only managed retention does). Conversation A's first turn
holds the router's one entry; conversation B's first turn evicts it (capacity), which queues
a release order for A's D request id; D gets it in the answer to its next sync, frees A's
blocks through vLLM's expiry path and tells the router in the sync right after.

The same for a D the router does not sync with (stock vLLM; here a router with ``--guard
tokenize``, which treats every D so): the order goes through P (``router.stock_release``), a
prompt too short to pull carrying A's D params, and D frees A's turn on P's notification.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from kvrelay.client.pd import PDClient
from kvrelay.client.prometheus import parse_prometheus
from kvrelay.cluster.launcher import ServiceProcess, free_port_block
from tests.e2e.conftest import RealCluster, chat, p_external, start_extra_router, words

pytestmark = pytest.mark.e2e

Message = dict[str, object]

RELEASE_DEADLINE_S = 30.0
"""How long the test waits for D to tell the release: far above the ~0.5 s sync interval
plus a busy machine's delays. The assertion is on the outcome (D released A, cause
``router``), the time taken is only reported."""


@pytest.fixture
def one_entry_router(real_cluster: RealCluster, tmp_path: Path) -> Iterator[str]:
    """A router that holds a single index entry: every new entry evicts the one before."""
    router: ServiceProcess = start_extra_router(
        real_cluster, free_port_block(2, start=18700), tmp_path / "one-entry-router.log",
        ["--max-entries", "1"])
    try:
        assert router.url is not None
        yield router.url
    finally:
        router.stop()


def opening(seed: int, num_words: int) -> list[Message]:
    rng = random.Random(seed)
    return [{"role": "system", "content": "You are a coding agent. " + words(num_words, rng)},
            {"role": "user", "content": "Task: " + words(20, rng)}]


def send(url: str, model: str, messages: Sequence[Message],
         conversation_id: str) -> tuple[str, str, str]:
    """One turn through a router: its answer, action and reason."""
    text, headers, _ = chat(url, {"model": model, "messages": list(messages),
                                  "max_tokens": 16, "temperature": 0.0,
                                  "conversation_id": conversation_id})
    return text, headers["x-kvrelay-action"], headers["x-kvrelay-reason"]


def d_retention(router_url: str) -> tuple[str, dict[str, object]] | None:
    """The router's view of its one D's retention (from D's latest sync), if D synced."""
    retention = httpx.get(f"{router_url}/stats", timeout=30).json()["retention"]
    assert len(retention) <= 1, retention
    return next(iter(retention.items()), None)


def count(retention: dict[str, object], key: str) -> int:
    """One of D's numbers in the router's ``/stats`` ``retention``."""
    value = retention[key]
    assert isinstance(value, int), retention
    return value


def router_releases(retention: dict[str, object]) -> int:
    """D's releases on a router's orders since D started (any router's)."""
    releases = retention["releases_total"]
    assert isinstance(releases, dict), retention
    return int(releases.get("router", 0))


def router_metric(router_url: str, name: str, **labels: str) -> float:
    """The sum of the router's ``kvrelay_router_NAME`` samples with these labels."""
    metrics = parse_prometheus(httpx.get(f"{router_url}/metrics", timeout=30).text)
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items()
               if k.startswith(f"kvrelay_router_{name}{{") and all(w in k for w in wanted))


def synced_since(router_url: str, since: float) -> tuple[str, dict[str, object]]:
    """D's retention as of a sync the router got after ``since`` (``time.monotonic``)."""
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while True:
        state = d_retention(router_url)
        if state is not None:
            ago = state[1]["synced_s_ago"]
            assert isinstance(ago, float | int)
            if time.monotonic() - ago > since:
                return state
        assert time.monotonic() < deadline, f"D did not sync with the router: {state}"
        time.sleep(0.05)


def test_an_evicted_entry_is_released_on_d_and_its_next_turn_recomputes(
    real_cluster: RealCluster, one_entry_router: str
) -> None:
    """A's entry, evicted by B's (``--max-entries 1``), is released on D (cause ``router``,
    D's retained tokens drop by A's turn less B's) shortly after B's turn; A's second turn
    then recomputes with reason ``no_entry`` and answers as a direct P/D recompute does.

    ``no_entry``, not ``released``: a capacity eviction removes the entry from the index (and
    queues its release order); nothing of it is left to find. ``released`` is the reason for
    an entry that is still indexed when D tells it released (pressure, headroom, an order
    from another replica); here the router itself dropped it, so the next turn finds none.
    """
    model = real_cluster.model
    a_id, b_id = f"evicted-{secrets.token_hex(4)}", f"evictor-{secrets.token_hex(4)}"
    a_turn1 = opening(2101, num_words=2500)  # about 3,000 tokens retained on D
    b_turn1 = opening(2102, num_words=200)  # about 300: B's retention cannot hide A's release

    a_text, action, reason = send(one_entry_router, model, a_turn1, a_id)
    assert (action, reason) == ("recompute", "no_entry")
    a_done = time.monotonic()
    node_id, with_a = synced_since(one_entry_router, a_done)
    assert count(with_a, "retained_requests") >= 1
    assert router_metric(one_entry_router, "release_orders_total", node=node_id) == 0

    b_text, action, reason = send(one_entry_router, model, b_turn1, b_id)
    assert (action, reason) == ("recompute", "no_entry")
    b_done = time.monotonic()
    deadline = b_done + RELEASE_DEADLINE_S
    while True:  # until this router ordered A's release and D told one, its tokens fallen
        state = d_retention(one_entry_router)
        assert state is not None
        after = state[1]
        if (router_metric(one_entry_router, "release_orders_total", node=node_id) >= 1
                and router_releases(after) > router_releases(with_a)
                and count(after, "retained_tokens") < count(with_a, "retained_tokens")):
            break
        assert time.monotonic() < deadline, \
            f"D did not release A's evicted turn: before B {with_a}, now {after}"
        time.sleep(0.02)
    release_latency_s = time.monotonic() - b_done
    print(f"\nD told the release of A's evicted entry {release_latency_s:.3f} s after B's "
          f"turn ended; D's retention before B's turn: {with_a}; after the release: {after}")

    assert router_metric(one_entry_router, "release_orders_total", node=node_id) == 1, \
        "the router ordered exactly one release: A's, the entry B's turn evicted"
    assert count(after, "retained_blocks") < count(with_a, "retained_blocks"), \
        "A's ~3,000 tokens left D's retention, B's ~250 came in"
    assert router_releases(after) >= 1, "the router's /stats: D's releases on router orders"
    assert router_metric(one_entry_router, "retention_releases_seen_total",
                         node=node_id, cause="router") >= 1

    a_turn2: list[Message] = [*a_turn1, {"role": "assistant", "content": a_text},
               {"role": "user", "content": "Now run the tests."}]
    pulled_before = p_external(real_cluster)
    a2_text, action, reason = send(one_entry_router, model, a_turn2, a_id)
    assert (action, reason) == ("recompute", "no_entry")
    assert p_external(real_cluster) == pulled_before, "a released turn is never pulled"
    with PDClient(real_cluster.prefill_url, real_cluster.decode_url, model) as client:
        recomputed = client.turn(a_turn2, max_tokens=16)
    assert a2_text == recomputed.text
    assert b_text  # B answered: its turn is what evicted A


@pytest.fixture
def stock_view_router(real_cluster: RealCluster, tmp_path: Path) -> Iterator[str]:
    """A one-entry router that syncs with no D (``--guard tokenize``: it proves pulls itself
    and treats every D as stock vLLM, sending no retention keys), so its release orders go
    through P (``router.stock_release``), as they do for a D without kvrelay's connector."""
    router: ServiceProcess = start_extra_router(
        real_cluster, free_port_block(2, start=18750), tmp_path / "stock-view-router.log",
        ["--max-entries", "1", "--guard", "tokenize"])
    try:
        assert router.url is not None
        yield router.url
    finally:
        router.stop()


def d_usage(cluster: RealCluster) -> float:
    """D's ``vllm:kv_cache_usage_perc``: retained turns count (nothing else runs now)."""
    metrics = parse_prometheus(httpx.get(f"{cluster.decode_url}/metrics", timeout=30).text)
    return sum(v for k, v in metrics.items() if k.startswith("vllm:kv_cache_usage_perc"))


def test_an_evicted_entry_of_a_d_that_does_not_sync_is_freed_through_p(
    real_cluster: RealCluster, stock_view_router: str
) -> None:
    """As above, for a D the router does not sync with: A's evicted turn is freed on D by a
    P request too short to pull that carries A's D params (P pulls nothing, D is notified
    and frees the blocks), shortly after B's turn, not at D's TTL; A's next turn recomputes
    with the answer of a recompute."""
    model = real_cluster.model
    a_id, b_id = f"stock-a-{secrets.token_hex(4)}", f"stock-b-{secrets.token_hex(4)}"
    a_turn1 = opening(2201, num_words=2500)  # about 3,000 tokens retained on D
    b_turn1 = opening(2202, num_words=200)  # about 300

    a_text, _, _ = send(stock_view_router, model, a_turn1, a_id)
    time.sleep(1.0)  # vLLM's gauges follow the engine's steps
    with_a = d_usage(real_cluster)
    assert router_metric(stock_view_router, "release_orders_total") == 0
    pulled_before = p_external(real_cluster)

    send(stock_view_router, model, b_turn1, b_id)
    b_done = time.monotonic()
    deadline = b_done + RELEASE_DEADLINE_S
    while not (router_metric(stock_view_router, "release_orders_total") >= 1
               and d_usage(real_cluster) < with_a):
        assert time.monotonic() < deadline, \
            f"D did not free A's evicted turn: usage with A {with_a}, now {d_usage(real_cluster)}"
        time.sleep(0.02)
    print(f"\nD freed A's evicted turn through P {time.monotonic() - b_done:.3f} s after B's "
          f"turn ended; D's usage with A {with_a:.4f}, now {d_usage(real_cluster):.4f}")
    assert router_metric(stock_view_router, "release_orders_total") == 1
    assert p_external(real_cluster) == pulled_before, "the release pulled nothing"

    a_turn2: list[Message] = [*a_turn1, {"role": "assistant", "content": a_text},
               {"role": "user", "content": "Now run the tests."}]
    a2_text, action, reason = send(stock_view_router, model, a_turn2, a_id)
    assert (action, reason) == ("recompute", "no_entry")
    with PDClient(real_cluster.prefill_url, real_cluster.decode_url, model) as client:
        assert a2_text == client.turn(a_turn2, max_tokens=16).text
