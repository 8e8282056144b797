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
    """Answers each sync by letting D free every turn it asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def answer_for(self, sync: dict[str, object]) -> RetentionOrders:
        releasing = [str(i) for i in sync.get("releasing") or ()]  # type: ignore[attr-defined]
        self.asked.extend(i for i in releasing if i not in self.asked)
        return RetentionOrders(dropped=tuple(releasing))


@pytest.fixture(scope="module")
def small_d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster("managed", tmp_path_factory.mktemp("retention"), extra=["--no-router"]) as c:
        yield c


@pytest.fixture
def router() -> Iterator[ConfirmingRouter]:
    stand_in = ConfirmingRouter()
    yield stand_in
    stand_in.close()


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
        recomputed = client.turn(follow_up, max_tokens=8)  # needs the follow-up's blocks

    assert after - before == last.retained.num_tokens, \
        "the last conversation's turn was not needed by anyone: its follow-up pulls it"
    assert pulled.text == recomputed.text
    ids = [turn.retained.request_id for _, turn in turns if turn.retained is not None]
    assert asked_before_recompute == ids[:-1], \
        "each new conversation freed the one before (oldest first), never the last one"
    assert pulled.retained is not None
    assert router.asked == [*ids[:-1], pulled.retained.request_id]
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
