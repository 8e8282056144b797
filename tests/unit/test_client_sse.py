"""kvrelay.client: server-sent events and Prometheus text as a client reads them, on a real
vLLM 0.32 stream captured on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from kvrelay.client.sse import (
    DONE,
    EventBuffer,
    Usage,
    chunk_content,
    chunk_error,
    json_chunk,
    line_chunks,
    sse_data,
    sse_events,
    sse_payloads,
    usage_of,
)

LINES: list[str] = json.loads(
    (Path(__file__).parents[1] / "data" / "vllm-0.32.0" / "chat_stream.json").read_text()
)["d_stream"]
BODY = "".join(f"{line}\n\n" for line in LINES)


def test_a_stream_reads_the_same_whole_by_lines_and_in_any_pieces() -> None:
    payloads = sse_payloads(BODY)
    assert payloads[-1] == DONE and len(payloads) == len(LINES)
    assert [json_chunk(p) for p in payloads[:-1]] == list(line_chunks(LINES))
    for size in (1, 7, 64, len(BODY)):
        buffer, got = EventBuffer(), []
        raw = BODY.encode()
        for start in range(0, len(raw), size):
            got += buffer.feed(raw[start : start + size])
        assert got == payloads
    events = sse_events(BODY)
    assert events[-1] == DONE and events[:-1] == list(line_chunks(LINES))


def test_the_text_and_usage_of_vllms_stream() -> None:
    chunks = list(line_chunks(LINES))
    assert "".join(chunk_content(c) for c in chunks) == "=Lv]0bF<"
    usages = [u for u in map(usage_of, chunks) if u is not None]
    assert usages == [Usage(prompt_tokens=379, completion_tokens=8)]


def test_completions_chunks_errors_and_odd_lines() -> None:
    assert chunk_content({"choices": [{"index": 0, "text": "ab"}, {"text": "c"}]}) == "abc"
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_content({"choices": None}) == ""
    error = {"message": "the decode node failed mid-stream", "code": 502}
    assert chunk_error({"error": error}) == error and chunk_error({"choices": []}) is None
    assert sse_data("data:{}") == "{}" and sse_data("data:  x") == " x"
    assert sse_data(": keep-alive") is None and sse_data("") is None
    assert json_chunk(" [DONE] ") is None and json_chunk("[1]") is None
    with pytest.raises(ValueError):
        json_chunk("{oops")
    assert usage_of({"usage": {}}) is None and usage_of({}) is None
    assert usage_of({"usage": {"prompt_tokens": "7"}}) == Usage(7, None)


def test_prometheus_samples_keep_their_labels() -> None:
    text = """# HELP x
vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 40.0
vllm:prompt_tokens_by_source_total{source="local_compute"} 2.0
kvrelay_turns_total 3
broken line here
"""
    metrics = parse_prometheus(text)
    assert metrics["kvrelay_turns_total"] == 3.0 and len(metrics) == 3
    assert external_kv_tokens(metrics) == 40.0
