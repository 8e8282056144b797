"""Every fault knob of the fake engine, set as an attribute or over ``POST /fake/faults``:
crash, 5xx, hang, slow stream, restart with a new engine id, unreachable side channel, and
dying mid-stream after k tokens."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig, ManualClock
from tests.component.fake_engine_helpers import (
    GatedSleep,
    Receiver,
    chat,
    client,
    post,
    text_of,
    until,
    user,
)

CONFIG = FakeEngineConfig(report_delay_s=0.0)
PROMPT = user("Faults must be injectable at runtime, from a test or over HTTP. " * 8)


async def prefill(p: FakeEngine) -> Any:
    return await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})


async def faults(engine: FakeEngine, body: dict[str, Any], status: int = 200) -> Any:
    return await post(engine, "/fake/faults", body, status)


async def test_crash_closes_connections_and_start_brings_a_new_engine() -> None:
    sleep = GatedSleep(open_=False)
    config = replace(CONFIG, latency=replace(CONFIG.latency, decode_s_per_token=0.01))
    async with FakeCluster(1, 1, config, sleep=sleep, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        sleep.gate.set()
        pr = await prefill(p)
        old_id = p.engine_id
        sleep.gate.clear()
        async with client() as http:
            request = {"messages": PROMPT, "max_tokens": 8, "stream": True}
            async with http.stream("POST", d.url + "/v1/chat/completions", json=request) as r:
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # role chunk
                await until(lambda: d.state.running == 1, "decode in flight")
                await d.crash()
                with pytest.raises(httpx.HTTPError):
                    async for _ in lines:
                        pass
            assert not d.running
            with pytest.raises(httpx.ConnectError):
                await http.get(d.url + "/health")
        sleep.gate.set()

        await faults(p, {"crash": True})
        await until(lambda: not p.running, "crash over HTTP")
        await p.start()
        assert p.running and p.engine_id != old_id and p.incarnation == 2
        assert p.held() == []  # the crash lost every block
        await d.start()
        dr = await chat(d, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        assert d.record(dr["id"]).load_failure == "engine_mismatch"


async def test_error_status_answers_5xx_for_error_count_requests() -> None:
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        state = await faults(p, {"error_status": 503, "error_count": 2})
        assert state["error_status"] == 503
        for _ in range(2):
            body = await post(p, "/v1/chat/completions", {"messages": PROMPT}, status=503)
            assert body["error"]["code"] == 503
        await chat(p, PROMPT, max_tokens=1)
        p.faults.error_status = 500  # as an attribute, until cleared
        await post(p, "/v1/completions", {"prompt": "x"}, status=500)
        await post(p, "/v1/completions", {"prompt": "x"}, status=500)
        await faults(p, {"clear": True})
        await post(p, "/v1/completions", {"prompt": "x"})


async def test_hang_holds_requests_until_cleared() -> None:
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        await faults(p, {"hang": True})
        pending = asyncio.create_task(chat(p, PROMPT, max_tokens=2))
        await until(lambda: p.faults.num_hung == 1, "request held by the hang")
        assert not pending.done()
        async with client() as http:  # the rest of the API still answers
            assert (await http.get(p.url + "/health")).status_code == 200
        p.faults.hang = False
        response = await pending
        assert response["usage"]["completion_tokens"] == 2 and p.faults.num_hung == 0
        assert len(p.record(response["id"]).output_token_ids) == 2 and text_of(response)


async def test_slow_stream_delays_every_token() -> None:
    sleep = GatedSleep()
    async with FakeCluster(1, 0, CONFIG, sleep=sleep) as cluster:
        p = cluster.prefill[0]
        await chat(p, PROMPT, max_tokens=3)
        assert sleep.requested == []  # the fast preset simulates nothing
        await faults(p, {"slow_stream_s": 0.25})
        async with client() as http:
            request = {"messages": PROMPT, "max_tokens": 4, "stream": True}
            async with http.stream("POST", p.url + "/v1/chat/completions", json=request) as r:
                lines = [line async for line in r.aiter_lines() if line]
        assert len(lines) == 1 + 4 + 1  # role, 4 tokens, [DONE]
        assert sleep.requested == [0.25] * 4


async def test_latency_model_simulates_prefill_transfer_and_decode() -> None:
    sleep = GatedSleep()
    from kvrelay.fakevllm import CPU

    config = replace(CONFIG, latency=CPU)
    async with FakeCluster(1, 1, config, sleep=sleep, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await prefill(p)
        n = pr["usage"]["prompt_tokens"]
        assert sleep.requested == [pytest.approx(CPU.prefill_s(n, n))]
        sleep.requested.clear()
        await chat(d, PROMPT, max_tokens=5, kv_transfer_params=pr["kv_transfer_params"])
        assert sleep.requested == [pytest.approx(CPU.transfer_s(n))] + [CPU.decode_s_per_token] * 4
    assert CPU.prefill_s(16384, 16384) == pytest.approx(0.05e-3 * 16384 + 2.0)
    assert CPU.transfer_s(1000) == pytest.approx(0.040 + 0.005)


async def test_restart_gives_a_new_engine_id_and_drops_held_blocks() -> None:
    async with FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await prefill(p)
        old_id = p.engine_id
        await faults(p, {"restart": True})
        await until(lambda: p.incarnation == 2 and p.running, "restart over HTTP")
        assert p.engine_id != old_id and p.held() == []
        assert p.metrics.prompt_tokens == 0  # counters restart with the process
        dr = await chat(d, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        rec = d.record(dr["id"])
        assert rec.load_failure == "engine_mismatch" and rec.recomputed_after_failure
        assert d.metrics.nixl_failed_transfers == 1

        pr = await prefill(p)
        await p.restart()
        assert p.incarnation == 3 and p.held() == []


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_unreachable_side_channel_fails_the_read(policy: str) -> None:
    config = replace(CONFIG, kv_load_failure_policy=policy)  # type: ignore[arg-type]
    async with FakeCluster(1, 1, config, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await prefill(p)
        await faults(p, {"side_channel_unreachable": True})
        request = {"messages": PROMPT, "max_tokens": 4,
                   "kv_transfer_params": pr["kv_transfer_params"]}
        if policy == "fail":
            body = await post(d, "/v1/chat/completions", request, status=500)
            assert body["error"]["type"] == "InternalServerError"
            rec = d.records[-1]
        else:
            dr = await post(d, "/v1/chat/completions", request)
            rec = d.record(dr["id"])
            assert rec.recomputed_after_failure
            assert text_of(dr) == text_of(await chat(p, PROMPT, max_tokens=4))
        assert rec.load_failure == "unreachable" and rec.pulled_tokens == 0
        assert d.metrics.nixl_failed_transfers == 1
        assert len(p.held()) == 1  # never read: P keeps its lease
        p.faults.side_channel_unreachable = False
        again = await chat(d, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        assert d.record(again["id"]).plan == "pull" and p.held() == []


async def test_die_mid_stream_after_k_tokens_aborts_the_request() -> None:
    async with Receiver() as receiver, FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await prefill(p)
        await faults(d, {"die_after_tokens": 3})
        params = {**pr["kv_transfer_params"], "kvrelay_report_url": receiver.url,
                  "kvrelay_turn_id": "t-die"}
        got: list[str] = []
        async with client() as http:
            request = {"messages": PROMPT, "max_tokens": 8, "stream": True,
                       "kv_transfer_params": params}
            async with http.stream("POST", d.url + "/v1/chat/completions", json=request) as r:
                with pytest.raises(httpx.HTTPError):
                    async for line in r.aiter_lines():
                        if line:
                            got.append(line)
            assert len(got) == 1 + 3 and "[DONE]" not in got[-1]
            rec = d.records[-1]
            assert rec.finish_reason == "abort" and len(rec.output_token_ids) == 3
            assert rec.kv_transfer_params is None and d.held() == []
            report = await receiver.next_body()
            assert report == {"turn_id": "t-die", "kv_transfer_params": None,
                              "num_prompt_tokens": len(rec.prompt_token_ids),
                              "num_output_tokens": 3}

            with pytest.raises(httpx.HTTPError):  # non-streamed: no response at all
                await http.post(d.url + "/v1/chat/completions",
                                json={"messages": PROMPT, "max_tokens": 8})
            # A request with no more than k tokens is not affected.
            short = await http.post(d.url + "/v1/chat/completions",
                                    json={"messages": PROMPT, "max_tokens": 3})
            assert short.status_code == 200
        assert (await faults(d, {"die_after_tokens": None}))["die_after_tokens"] is None


async def test_unhealthy_and_fault_validation() -> None:
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        await faults(p, {"unhealthy": True})
        async with client() as http:
            assert (await http.get(p.url + "/health")).status_code == 503
        bad = await faults(p, {"no_such_knob": 1}, status=400)
        assert "unknown fault" in bad["error"]["message"]
        await faults(p, {"slow_stream_s": -1}, status=400)
        state = await faults(p, {"clear": True})
        assert state["unhealthy"] is False and state["slow_stream_s"] == 0.0
        async with client() as http:
            assert (await http.get(p.url + "/fake/faults")).json() == state


async def test_non_streamed_request_is_aborted_when_its_client_disconnects() -> None:
    """Like vLLM's ``with_cancellation``: the request stops at once and frees its blocks,
    it does not run to completion for nobody."""
    sleep = GatedSleep(open_=False)
    async with FakeCluster(1, 0, CONFIG, sleep=sleep) as cluster:
        p = cluster.prefill[0]
        p.faults.slow_stream_s = 0.01  # every token waits on the (closed) gate
        body = json.dumps({"messages": PROMPT, "max_tokens": 50}).encode()
        reader, writer = await asyncio.open_connection(p.host, p.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: fake\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await until(lambda: bool(p.records) and len(sleep.requested) == 1,
                    "the request is generating, held on its first token")
        record = p.records[-1]
        assert record.finish_reason is None and p.state.running == 1
        writer.close()
        await until(lambda: record.finish_reason == "abort", "the request was aborted")
        assert p.state.running == 0 and p.held() == []
        assert len(sleep.requested) == 1  # no token was produced after the disconnect
        sleep.gate.set()
        alive = await chat(p, PROMPT, max_tokens=2)  # the engine lives on
        assert alive["usage"]["completion_tokens"] == 2 and text_of(alive)
        assert len(p.record(alive["id"]).output_token_ids) == 2
        assert await reader.read() == b""
