"""The ``direct`` action on the real cluster: with ``--direct``, a turn whose new suffix is
short goes straight to the D holding the conversation, which serves the history from its
own prefix cache (P is not involved), and answers exactly as a recompute would."""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay.client.prometheus import parse_prometheus
from tests.e2e.conftest import CPU_BLOCK_SIZE, RealCluster, start_extra_router
from tests.ports import free_port_block

pytestmark = pytest.mark.e2e

WORDS = "grep sed awk make test lint build deploy rollback page".split()


@pytest.fixture
def direct_router(real_cluster: RealCluster, tmp_path: Path) -> Iterator[str]:
    router = start_extra_router(real_cluster, free_port_block(2, start=18400),
                                tmp_path / "direct-router.log", ["--direct"])
    try:
        yield router.url or ""
    finally:
        router.stop()


def tokens_by_source(http: httpx.Client, url: str, source: str) -> float:
    metrics = parse_prometheus(http.get(f"{url}/metrics").text)
    return sum(v for k, v in metrics.items()
               if k.startswith("vllm:prompt_tokens_by_source_total") and f'"{source}"' in k)


def test_direct_turns_use_ds_cache_and_match_recompute(real_cluster: RealCluster,
                                                       direct_router: str):
    rng = random.Random(5)
    conversation = f"direct-{secrets.token_hex(4)}"
    messages: list[dict[str, object]] = [
        {"role": "system",
         "content": "Ops agent. " + " ".join(rng.choice(WORDS) for _ in range(150))},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))}]
    turns: list[tuple[str, str, int, float, float, float]] = []
    answers: list[str] = []
    prompts: list[list[dict[str, object]]] = []
    with httpx.Client(timeout=300, trust_env=False) as http:
        for _ in range(4):
            p_before = tokens_by_source(http, real_cluster.prefill_url, "local_compute")
            d_hit_before = tokens_by_source(http, real_cluster.decode_url, "local_cache_hit")
            d_ext_before = tokens_by_source(http, real_cluster.decode_url, "external_kv_transfer")
            resp = http.post(f"{direct_router}/v1/chat/completions", json={
                "model": real_cluster.model, "messages": messages, "max_tokens": 12,
                "temperature": 0, "conversation_id": conversation})
            assert resp.status_code == 200, resp.text
            turns.append((
                resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"],
                int(resp.headers["x-kvrelay-reused-tokens"]),
                tokens_by_source(http, real_cluster.prefill_url, "local_compute") - p_before,
                tokens_by_source(http, real_cluster.decode_url, "local_cache_hit") - d_hit_before,
                tokens_by_source(http, real_cluster.decode_url, "external_kv_transfer")
                - d_ext_before))
            prompts.append(list(messages))
            answers.append(str(resp.json()["choices"][0]["message"]["content"]))
            messages = [*messages, {"role": "assistant", "content": answers[-1]},
                        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(6))}]
        baseline = []
        for prompt in prompts:  # the same prompts, recomputed (each in a fresh id's scope)
            resp = http.post(f"{real_cluster.router_url}/v1/chat/completions", json={
                "model": real_cluster.model, "messages": prompt, "max_tokens": 12,
                "temperature": 0, "conversation_id": f"baseline-{secrets.token_hex(8)}"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvrelay-action"] == "recompute"
            baseline.append(str(resp.json()["choices"][0]["message"]["content"]))

    assert turns[0][:2] == ("recompute", "no_entry"), turns
    for action, reason, reused, p_computed, d_hits, d_pulled in turns[1:]:
        assert (action, reason) == ("direct", "direct"), turns
        assert p_computed == 0, "a direct turn must not touch P"
        assert d_pulled == 0, "a direct turn pulls nothing"
        assert reused > 0 and d_hits > 0 and abs(d_hits - reused) < CPU_BLOCK_SIZE, turns
    assert answers == baseline
