"""Issue #21's scenario on a real D whose cache holds 3,072 tokens (24 blocks): six new
~1,500-token conversations one after another, none continued, then a follow-up of the last.

Each retained turn holds about half of D's cache, so stock vLLM makes the second request wait
for the first turn's TTL. kvrelay's connector (managed retention) asks the router for the
oldest retained turn, frees it through vLLM's own expiry sweep once the router answers, and
the request runs. P and D are driven directly (``PDClient``) with a stand-in for the router's
retention endpoint that answers every ``releasing`` id (no P reads them); the router's side
has its own tests. Its own cluster (the session cluster's D is large): one ``kvrelay up``.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from scripts.bench_retention_pressure import Cluster, cluster, prompt

from kvrelay.bench.tokens import filler_words
from kvrelay.client.pd import PDClient
from kvrelay.client.prometheus import external_kv_tokens
from kvrelay.core.retention_sync import RETAIN_S_KEY, RETENTION_URL_KEY, RetentionOrders
from tests.retention_router import StandInRouter

pytestmark = pytest.mark.e2e

CLIENT_TIMEOUT_S = 120.0
"""Far below the stall stock retention would cause here (the TTL, ``kvrelay up --ttl-s 120``
in the scenario's flags, for every request after the first), far above a request's time."""


class ConfirmingRouter(StandInRouter):
    """Answers each sync by letting D free every turn it asks for (and ordering released
    what ``answer.release`` names)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def answer_for(self, sync: dict[str, object]) -> RetentionOrders:
        releasing = [str(i) for i in sync.get("releasing") or ()]  # type: ignore[attr-defined]
        self.asked.extend(i for i in releasing if i not in self.asked)
        return RetentionOrders(release=self.answer.release, dropped=tuple(releasing))


@pytest.fixture(scope="module")
def small_d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster("managed", tmp_path_factory.mktemp("retention"), extra=["--no-router"]) as c:
        yield c


@pytest.fixture
def router() -> Iterator[ConfirmingRouter]:
    stand_in = ConfirmingRouter()
    yield stand_in
    stand_in.close()


def test_a_prompt_shared_with_a_retained_turn_is_admitted_without_a_release(
    small_d: Cluster, router: ConfirmingRouter
):
    """Agents share a system prompt and tools: a new conversation's prompt is mostly blocks
    D already holds for another conversation's retained turn (its local prefix-cache hit).
    D sizes the waiting request as vLLM does, beside that hit, so it is admitted at once and
    no retained turn is asked for; counting the whole prompt would have asked for one (the
    request's 11 blocks against ~6 free). Runs first: D holds nothing yet, and it hands
    back what it retained (the next test counts every release)."""
    params = {RETENTION_URL_KEY: router.url, RETAIN_S_KEY: 120}
    words = filler_words(small_d.model)
    shared = "".join(random.Random(7).choice(words) for _ in range(1100))

    def agent(seed: int, num_tokens: int) -> list[dict[str, object]]:
        text = "".join(random.Random(seed).choice(words) for _ in range(num_tokens))
        return [{"role": "system", "content": shared}, {"role": "user", "content": text}]

    with PDClient(small_d.prefill, small_d.decode, small_d.model,
                  timeout_s=CLIENT_TIMEOUT_S) as client:
        first = client.turn(agent(1, 60), max_tokens=8, decode_params=params)
        other = client.turn(prompt(seed=3000, num_tokens=950, words=words), max_tokens=8,
                            decode_params=params)
        second = client.turn(agent(2, 200), max_tokens=8, decode_params=params)
        held = [t.retained for t in (first, other, second)]
        assert all(h is not None for h in held)
        assert second.prefill.prompt_tokens >= 1300
        asked = list(router.asked)
        ids = tuple(h.request_id for h in held if h is not None)
        router.answer = RetentionOrders(release=ids)  # hand D's cache back for the next test
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                s["retained_requests"] == 0 for s in list(router.syncs)[-3:]):
            time.sleep(0.1)
    assert asked == [], "the shared prompt's blocks are held already: nothing to release"
    assert router.syncs[-1]["retained_requests"] == 0


def test_abandoned_turns_are_released_under_pressure_and_the_last_one_still_pulls(
    small_d: Cluster, router: ConfirmingRouter
):
    params = {RETENTION_URL_KEY: router.url, RETAIN_S_KEY: 120}
    words = filler_words(small_d.model)
    with PDClient(small_d.prefill, small_d.decode, small_d.model,
                  timeout_s=CLIENT_TIMEOUT_S) as client:
        turns = []
        for i in range(6):
            messages = prompt(seed=2000 + i, num_tokens=1450, words=words)
            try:
                result = client.turn(messages, max_tokens=16, decode_params=params)
            except httpx.TimeoutException:
                pytest.fail(f"conversation {i + 1} waited for D's blocks past the client "
                            f"timeout: retained turns were not released")
            assert result.retained is not None
            assert result.prefill.prompt_tokens >= 1400
            turns.append((messages, result))
        messages, last = turns[-1]
        assert last.retained is not None
        follow_up = [*messages, {"role": "assistant", "content": last.text},
                     {"role": "user", "content": "Now run the tests."}]
        before = external_kv_tokens(client.metrics(small_d.prefill))
        pulled = client.turn(follow_up, max_tokens=8, reuse=last.retained,
                             decode_params=params)
        after = external_kv_tokens(client.metrics(small_d.prefill))
        asked_before_recompute = list(router.asked)
        recomputed = client.turn(follow_up, max_tokens=8, decode_params=params)  # again
        asked_before_fresh = list(router.asked)
        fresh = client.turn(prompt(seed=2100, num_tokens=1450, words=words), max_tokens=8,
                            decode_params=params)

    assert after - before == last.retained.num_tokens, \
        "the last conversation's turn was not needed by anyone: its follow-up pulls it"
    assert pulled.text == recomputed.text
    ids = [turn.retained.request_id for _, turn in turns if turn.retained is not None]
    assert asked_before_recompute == ids[:-1], \
        "each new conversation freed the one before (oldest first), never the last one"
    assert pulled.retained is not None and recomputed.retained is not None
    assert asked_before_fresh == ids[:-1], \
        "the recompute's prompt is the pulled turn's: D holds its blocks already (a local " \
        "prefix-cache hit), so admitting it needs a block or two, and no release"
    assert fresh.retained is not None
    both = {pulled.retained.request_id, recomputed.retained.request_id}
    asks = [{str(i) for i in sync["releasing"]}  # type: ignore[attr-defined]
            for sync in list(router.syncs)]
    first_ask = next(ask for ask in asks if ask & both)
    assert first_ask == both, \
        "the two turns share all but a block or two: releasing one alone frees almost " \
        "nothing (its blocks' other holder keeps them), so D asks for both at once"
    assert router.asked == [*ids[:-1], pulled.retained.request_id,
                            recomputed.retained.request_id]
    deadline = time.monotonic() + 30  # D tells each release in its next sync
    while True:
        told = {r["request_id"]: r["cause"] for sync in list(router.syncs)
                for r in sync["released"]}  # type: ignore[attr-defined]
        if set(router.asked) <= set(told) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(router.asked) <= set(told) and set(told.values()) == {"pressure"}
    log = (small_d.run_dir / "decode-0.log").read_text(errors="replace")
    for request_id in router.asked:
        assert re.search(rf"released retained request {re.escape(request_id)} \(pressure\)", log)
