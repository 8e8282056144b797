"""The fake engine's HTTP API is shaped like vLLM 0.32's: response and SSE chunk fields
(compared with responses captured from a real engine), return_token_ids, /tokenize, /models,
/health, /metrics, and kvrelay's D-side report POST."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.client.sse import line_chunks
from kvrelay.fakevllm import FakeCluster, FakeEngineConfig, ManualClock
from tests.component.fake_engine_helpers import (
    DATA,
    GatedSleep,
    Receiver,
    chat,
    client,
    post,
    sse_json,
    sse_lines,
    text_of,
    user,
)

CONFIG = FakeEngineConfig(report_delay_s=0.0)
PROMPT = user("Streaming shapes must match vLLM exactly. " * 10)
TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "list files",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def captured(name: str) -> Any:
    return json.loads(Path(DATA, name).read_text())


def keys(obj: Any) -> Any:
    """The key structure of a JSON value (dicts -> sorted keys, recursively on choices)."""
    if isinstance(obj, dict):
        return {k: keys(v) if k in ("choices", "delta", "message", "usage") else None
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [keys(v) for v in obj[:1]]
    return None


async def test_streamed_chat_chunks_are_shaped_like_vllm_032() -> None:
    real = list(line_chunks(captured("chat_stream.json")["d_stream"]))
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        lines = await sse_lines(d, "/v1/chat/completions", {
            "messages": PROMPT, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": pr["kv_transfer_params"]})
        chunks = sse_json(lines)
        assert len(chunks) == len(real) == 10
        for ours, theirs in zip(chunks, real, strict=True):
            assert list(keys(ours)) == list(keys(theirs))
            assert keys(ours) == keys(theirs)
        assert all("kv_transfer_params" not in c for c in chunks)  # vLLM 0.32
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 8
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:-1]) == (
            text_of(await chat(d, PROMPT, max_tokens=8)))
        # D retained its blocks even though the stream did not say which.
        assert len(d.held()) == 1


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_vllm_033_streams_params_on_the_final_chunk_and_still_reports(
    endpoint: str,
) -> None:
    """0.33: D's retained params ride on the chunk with ``finish_reason``, ``null`` before it,
    not on the role or usage chunk; they carry ``remote_registration_generation`` like P's,
    which D received unchanged. kvrelay's connector on D posts its report as well, with the
    same params (docs/vllm-versions.md)."""
    config = replace(CONFIG, vllm_version="0.33")
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    prompt: dict[str, Any] = {"messages": PROMPT} if endpoint == "chat" else {
        "prompt": "final chunk " * 30}
    async with Receiver() as receiver, FakeCluster(1, 1, config) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await post(p, path, {**prompt, "max_tokens": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}})
        assert pr["kv_transfer_params"]["remote_registration_generation"] == 1
        params = {**pr["kv_transfer_params"], "kvrelay_report_url": receiver.url,
                  "kvrelay_turn_id": "turn-33"}
        chunks = sse_json(await sse_lines(d, path, {
            **prompt, "max_tokens": 6, "stream": True, "kv_transfer_params": params,
            "stream_options": {"include_usage": True}}))
        rec = d.record(chunks[0]["id"])
        assert rec.request_kv_transfer_params == params
        body = await receiver.next_body()
    tokens = chunks[1:-1] if endpoint == "chat" else chunks[:-1]
    assert len(tokens) == 6 and chunks[-1]["choices"] == []
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert [c.get("kv_transfer_params", "absent") for c in chunks] == (
        ["absent"] * (endpoint == "chat") + [None] * 5 + [rec.kv_transfer_params, "absent"])
    retained = tokens[-1]["kv_transfer_params"]
    assert retained["do_remote_decode"] is True
    assert retained["remote_registration_generation"] == 1
    assert body["kv_transfer_params"] == retained and body["turn_id"] == "turn-33"
    assert tokens[-1]["choices"][0]["weight_versions"] is None
    assert chunks[-1]["system_fingerprint"] == "vllm-0.33.0-fake"


async def test_vllm_033_final_chunk_says_null_when_d_retains_nothing() -> None:
    """Without bidirectional transfer D retains nothing: 0.33's final chunk carries
    ``"kv_transfer_params": null`` (the key is there), which means "nothing retained"."""
    config = replace(CONFIG, vllm_version="0.33", bidirectional_kv_xfer=False)
    async with FakeCluster(1, 1, config) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        chunks = sse_json(await sse_lines(d, "/v1/chat/completions", {
            "messages": PROMPT, "max_tokens": 3, "stream": True,
            "kv_transfer_params": pr["kv_transfer_params"]}))
        assert d.record(chunks[0]["id"]).kv_transfer_params is None
    assert [c.get("kv_transfer_params", "absent") for c in chunks] == [
        "absent", None, None, None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_non_streamed_responses_are_shaped_like_vllm_032() -> None:
    turn1 = captured("chat_turn1.json")
    completions = captured("completions.json")
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        dr = await chat(d, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        assert keys(pr) == keys(turn1["p1"]) and keys(dr) == keys(turn1["d1"])
        assert list(pr) == list(turn1["p1"])
        prompt = "hello " * 50
        cp = await post(p, "/v1/completions", {
            "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        cd = await post(d, "/v1/completions", {
            "prompt": prompt, "max_tokens": 8, "return_token_ids": True,
            "kv_transfer_params": cp["kv_transfer_params"]})
        assert keys(cp) == keys(completions["p"]) and keys(cd) == keys(completions["d"])
        assert cp["id"].startswith("cmpl-") and cp["object"] == "text_completion"
        choice = cd["choices"][0]
        assert choice["prompt_token_ids"] == d.model.encode_prompt(prompt)
        # The generated ids are answer tokens (one word each) that spell the text and that the
        # tokenizer gives back from it.
        assert all(t in d.model.answer_ids for t in choice["token_ids"])
        assert d.model.decode(choice["token_ids"]) == choice["text"]
        assert d.model.encode_prompt(choice["text"], False) == choice["token_ids"]
        assert len(choice["token_ids"]) == 8 == cd["usage"]["completion_tokens"]
        assert cd["kv_transfer_params"]["remote_num_tokens"] == len(choice["prompt_token_ids"]) + 7


async def test_return_token_ids_when_streaming() -> None:
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        expected_prompt = p.model.encode_chat(PROMPT)
        chunks = sse_json(await sse_lines(p, "/v1/chat/completions", {
            "messages": PROMPT, "max_tokens": 5, "stream": True, "return_token_ids": True}))
        assert chunks[0]["prompt_token_ids"] == expected_prompt
        tokens = chunks[1:]
        assert len(tokens) == 5
        for c in tokens:
            choice = c["choices"][0]
            assert len(choice["token_ids"]) == 1  # one answer token (a word) per chunk
            assert p.model.decode(choice["token_ids"]) == choice["delta"]["content"]
            assert "prompt_token_ids" not in c
        assert "usage" not in chunks[-1]  # no include_usage: no usage chunk

        completion = sse_json(await sse_lines(p, "/v1/completions", {
            "prompt": "abc", "max_tokens": 3, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}))
        firsts = [c["choices"][0]["prompt_token_ids"] for c in completion[:-1]]
        assert firsts == [p.model.encode_prompt("abc"), None, None]
        assert completion[-1]["choices"] == [] and completion[-1]["object"] == "text_completion"


async def test_tokenize_matches_the_chat_template_and_tokenizer() -> None:
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        tok = p.model.tokenizer
        messages = [{"role": "system", "content": "be brief"}, *PROMPT,
                    {"role": "assistant", "content": "ok"}, *user("again, é")]
        raw = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                      tokenize=True)
        expected = list(raw["input_ids"] if hasattr(raw, "keys") else raw)
        body = await post(p, "/tokenize", {"messages": messages, "tools": TOOLS})
        assert body == {"count": len(expected), "max_model_len": CONFIG.max_model_len,
                        "tokens": expected, "token_strs": None}
        prompt_body = await post(p, "/tokenize", {"prompt": "héllo <|im_start|>"})
        assert prompt_body["tokens"] == list(tok.encode("héllo <|im_start|>"))
        assert prompt_body["count"] == len(prompt_body["tokens"])
        # The generation endpoints see the same prompt ids.
        r = await chat(p, messages, tools=TOOLS, max_tokens=1)
        assert r["usage"]["prompt_tokens"] == len(expected)


async def test_models_health_and_errors() -> None:
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        async with client() as http:
            models = (await http.get(p.url + "/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [CONFIG.served_model_name]
            assert models["data"][0]["max_model_len"] == CONFIG.max_model_len
            assert (await http.get(p.url + "/health")).status_code == 200
            wrong = await http.post(p.url + "/v1/chat/completions",
                                    json={"model": "other", "messages": PROMPT})
            assert wrong.status_code == 404
            assert wrong.json()["error"]["type"] == "NotFoundError"
            # vLLM 0.32 / 0.33: a budget over the context is refused, one that only does not
            # fit with the prompt is clamped (tests/e2e/test_contract_pressure.py)
            limit = CONFIG.max_model_len
            long = await http.post(p.url + "/v1/completions",
                                   json={"prompt": "x", "max_tokens": limit + 1})
            assert long.status_code == 400
            assert (f"max_tokens={limit + 1} cannot be greater than max_model_len={limit}"
                    in long.json()["error"]["message"])
            fits = await http.post(p.url + "/v1/completions",
                                   json={"prompt": "x", "max_tokens": limit})
            assert fits.status_code == 200
            assert fits.json()["usage"]["total_tokens"] <= limit
            fixed = await http.post(p.url + "/v1/chat/completions",
                                    headers={"X-Request-Id": "abc123"},
                                    json={"messages": PROMPT, "max_tokens": 1})
            assert fixed.json()["id"] == "chatcmpl-abc123"
            assert p.record("chatcmpl-abc123").max_tokens == 1


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_count_prompt_sources_and_transfers_like_vllm() -> None:
    async with FakeCluster(1, 1, CONFIG, clock=ManualClock()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        dr = await chat(d, PROMPT, max_tokens=16, kv_transfer_params=pr["kv_transfer_params"])
        messages = [*PROMPT, {"role": "assistant", "content": text_of(dr)}, *user("more")]
        p2 = await chat(p, messages, max_tokens=2, kv_transfer_params=dr["kv_transfer_params"])
        n1, n2 = pr["usage"]["prompt_tokens"], p2["usage"]["prompt_tokens"]
        pulled = p.record(p2["id"]).pulled_tokens
        assert pulled == n1 + 15
        async with client() as http:
            text = (await http.get(p.url + "/metrics")).text
        m = samples(text)
        base = (("engine", "0"), ("model_name", CONFIG.served_model_name))

        def value(name: str, **labels: str) -> float:
            return m[(name, tuple(sorted((*base, *labels.items()))))]

        assert value("vllm:prompt_tokens_total") == n1 + n2
        assert value("vllm:prompt_tokens_by_source_total", source="local_compute") == (
            n1 + n2 - pulled)
        assert value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0
        assert value("vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") == pulled
        assert value("vllm:external_prefix_cache_queries_total") == n1 + n2
        assert value("vllm:external_prefix_cache_hits_total") == pulled
        assert value("vllm:prefix_cache_queries_total") == 0  # P: prefix caching off
        assert value("vllm:prefix_cache_hits_total") == 0
        assert value("vllm:nixl_num_failed_transfers_total") == 0
        assert value("vllm:nixl_num_kv_expired_reqs_total") == 0
        assert value("vllm:nixl_xfer_time_seconds_count") == 1
        assert value("vllm:nixl_xfer_time_seconds_sum") >= 0
        assert value("vllm:generation_tokens_total") == 3

        async with client() as http:
            dm = samples((await http.get(d.url + "/metrics")).text)
        assert dm[("vllm:external_prefix_cache_hits_total", base)] == n1
        assert dm[("vllm:prefix_cache_queries_total", base)] == n1  # D: prefix caching on


async def test_decode_reports_retained_params_after_the_stream_completes() -> None:
    sleep = GatedSleep(open_=False)  # holds the report delay until the test opens it
    config = replace(CONFIG, report_delay_s=0.1)
    async with Receiver() as receiver, FakeCluster(1, 1, config, sleep=sleep) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = {**pr["kv_transfer_params"], "kvrelay_report_url": receiver.url,
                  "kvrelay_turn_id": "turn-7"}
        chunks = sse_json(await sse_lines(d, "/v1/chat/completions", {
            "messages": PROMPT, "max_tokens": 6, "stream": True, "kv_transfer_params": params}))
        rec = d.record(chunks[0]["id"])
        # Submitted once [DONE] was written (before the body ended), posted after the delay.
        assert rec.report is not None and rec.report.status is None
        assert sleep.requested == [0.1] and receiver.bodies == []
        sleep.gate.set()
        body = await receiver.next_body()
        assert body == {"turn_id": "turn-7", "kv_transfer_params": rec.kv_transfer_params,
                        "num_prompt_tokens": len(rec.prompt_token_ids), "num_output_tokens": 6}
        assert body["kv_transfer_params"]["do_remote_decode"] is True
        assert body["kv_transfer_params"]["remote_num_tokens"] == len(rec.prompt_token_ids) + 5
        await d.drain_reports()
        assert rec.report.status == 204

        plain = await chat(d, PROMPT, max_tokens=2)  # no report URL: no report
        assert d.record(plain["id"]).report is None


async def test_report_for_non_streamed_request_and_only_to_loopback_hosts() -> None:
    async with Receiver() as receiver, FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = {**pr["kv_transfer_params"], "kvrelay_report_url": receiver.url,
                  "kvrelay_turn_id": "t1"}
        dr = await chat(d, PROMPT, max_tokens=3, kv_transfer_params=params)
        body = await receiver.next_body()
        assert body["turn_id"] == "t1"
        assert body["kv_transfer_params"] == dr["kv_transfer_params"]

        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        remote = {**pr["kv_transfer_params"], "kvrelay_report_url": "http://192.0.2.1:9/report",
                  "kvrelay_turn_id": "t2"}
        dr = await chat(d, PROMPT, max_tokens=3, kv_transfer_params=remote)
        await d.drain_reports()
        rec = d.record(dr["id"])
        assert rec.report is not None and rec.report.status is None
        assert rec.report.error is not None and "report_hosts" in rec.report.error
        assert receiver.bodies == [body]


async def test_admin_endpoints_describe_engine_and_records() -> None:
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        async with client() as http:
            info = (await http.get(p.url + "/fake/info")).json()
            assert info["engine_id"] == p.engine_id
            assert [h["request_id"] for h in info["held"]] == [
                pr["kv_transfer_params"]["remote_request_id"]]
            rec = (await http.get(p.url + f"/fake/requests/{pr['id']}")).json()
            assert rec["kv_role"] == "prefill" and rec["wrong_reuse"] is False
            missing = await http.get(p.url + "/fake/requests/nope")
            assert missing.status_code == 404
        assert cluster.side_channels == [
            f"{e.side_channel_host}:{e.side_channel_port}" for e in (p, d)]
        assert cluster.engine(p.engine_id) is p and cluster.engine(d.url) is d


async def test_many_engines_in_one_process_on_distinct_ports() -> None:
    async with FakeCluster(2, 3, CONFIG) as cluster:
        urls = {e.url for e in cluster.engines}
        assert len(urls) == 5 and len(set(cluster.side_channels)) == 5
        assert len({e.engine_id for e in cluster.engines}) == 5
        async with httpx.AsyncClient(trust_env=False) as http:
            for e in cluster.engines:
                assert (await http.get(e.url + "/health")).status_code == 200


async def test_health_requests_are_counted_and_request_params_recorded() -> None:
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        async with client() as http:
            for _ in range(3):
                assert (await http.get(p.url + "/health")).status_code == 200
            p.faults.unhealthy = True
            assert (await http.get(p.url + "/health")).status_code == 503
        assert (p.num_health_requests, d.num_health_requests) == (4, 0)
        sent = {"do_remote_decode": True, "kvrelay_turn_id": "t-1",
                "kvrelay_report_url": "http://127.0.0.1:9/internal/kv-report"}
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params=sent)
        assert p.record(pr["id"]).request_kv_transfer_params == sent
        plain = await chat(p, PROMPT, max_tokens=1)
        assert p.record(plain["id"]).request_kv_transfer_params is None


async def test_received_keeps_every_body_read_faulted_ones_included() -> None:
    async with FakeCluster(1, 0, replace(CONFIG, records_limit=3)) as cluster:
        p = cluster.prefill[0]
        async with client() as http:
            assert (await http.get(p.url + "/health")).status_code == 200  # no body: none
            await http.post(p.url + "/tokenize", json={"prompt": "hi"})
            p.faults.error_status, p.faults.error_count = 503, 1
            assert (await http.post(p.url + "/v1/completions",
                                    json={"prompt": "x", "max_tokens": 1})).status_code == 503
            assert (await http.post(p.url + "/v1/completions", content=b"not json",
                                    headers={"content-type": "application/json"})
                    ).status_code == 400
        assert [(r.method, r.path) for r in p.received] == [
            ("POST", "/tokenize"), ("POST", "/v1/completions"), ("POST", "/v1/completions")]
        assert json.loads(p.received[1].body) == {"prompt": "x", "max_tokens": 1}
        assert p.received[2].body == b"not json" and not p.records
        await chat(p, PROMPT, max_tokens=1)  # the oldest falls out at records_limit
        assert [r.path for r in p.received] == ["/v1/completions"] * 2 + [
            "/v1/chat/completions"]
        await p.restart()
        assert len(p.received) == 3  # kept across restarts, like num_health_requests
