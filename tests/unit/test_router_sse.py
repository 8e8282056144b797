"""The byte-level relay of D's answers (``kvrelay.router.sse``), on vLLM 0.32's captured
responses and on hand-made events: framing across reads, untouched events passed through
byte for byte, the few rewrites (usage ``cached_tokens``, token ids, ``kv_transfer_params``,
error events), and the answer the next turn will carry."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client.sse import line_chunks, sse_events
from kvrelay.core.identity import ToolCall
from kvrelay.router.sse import (
    BATCH_BYTES,
    SSE_DONE,
    Rewrite,
    StreamScan,
    frame,
    rewrite_body,
    sse_error,
)

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def event(obj: object) -> bytes:
    """An SSE event as vLLM writes it (compact JSON)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def captured_stream() -> list[bytes]:
    """D's streamed chat answer captured from vLLM 0.32 (with the usage event)."""
    return [line.encode() + b"\n\n" for line in load("chat_stream.json")["d_stream"]]


def chunk(delta: dict[str, Any] | None = None, *, index: int = 0, **top: Any) -> bytes:
    choice: dict[str, Any] = {"index": index, "delta": delta or {}, "logprobs": None,
                              "finish_reason": None}
    return event({"id": "x", "object": "chat.completion.chunk", "model": "m",
                  "choices": [choice], **top})


def relay(stream: bytes, cuts: list[int], rewrite: Rewrite) -> tuple[bytes, StreamScan]:
    """What the client gets when D's bytes arrive cut at ``cuts``: frame each read, feed
    the complete events, pass what is left at the end (as ``decode.Decoder`` does)."""
    scan = StreamScan(rewrite)
    out, carry, start = b"", b"", 0
    for end in [*sorted(cuts), len(stream)]:
        events, carry = frame(carry, stream[start:end])
        start = end
        if events:
            out += scan.feed(events)
    return out + carry, scan


def parsed(out: bytes) -> list[Any]:
    return list(line_chunks(out.decode().split("\n")))


# -- frame ------------------------------------------------------------------------------


def test_frame_cuts_after_the_last_blank_line() -> None:
    assert frame(b"", b"data: {\"a\":1}") == (b"", b"data: {\"a\":1}")
    assert frame(b"", b"data: 1\n\ndata: 2\n\ndata: 3") == (b"data: 1\n\ndata: 2\n\n", b"data: 3")
    assert frame(b"data: 3", b"\n\n") == (b"data: 3\n\n", b"")
    assert frame(b"data: 3\n", b"\ndata: 4\n") == (b"data: 3\n\n", b"data: 4\n")
    assert frame(b"", b"") == (b"", b"")


def test_frame_reassembles_events_cut_anywhere() -> None:
    stream = b"".join(captured_stream())
    for cut in range(1, len(stream)):
        first, carry = frame(b"", stream[:cut])
        rest, left = frame(carry, stream[cut:])
        assert first + rest == stream and left == b""
        assert first + carry == stream[:cut]
        assert first == b"" or first.endswith(b"\n\n")
        assert b"\n\n" not in carry


# -- pass-through -------------------------------------------------------------------------


def test_captured_stream_passes_through_byte_for_byte() -> None:
    stream = b"".join(captured_stream())
    out, scan = relay(stream, [], Rewrite())
    assert out == stream
    assert scan.done and scan.error is None and scan.params is None
    text, calls = scan.answer()
    expected = "".join(
        c["delta"].get("content") or ""
        for e in parsed(stream) for c in e["choices"]
    )
    assert text == expected and len(text) == 8 and calls == []
    assert scan.prompt_token_ids is None and scan.output_token_ids == []


def test_pass_through_whatever_the_reads() -> None:
    stream = b"".join(captured_stream())
    rng = random.Random(7)
    whole = relay(stream, [], Rewrite())[1].answer()
    for _ in range(200):
        cuts = rng.sample(range(1, len(stream)), rng.randrange(1, 12))
        out, scan = relay(stream, cuts, Rewrite())
        assert out == stream
        assert scan.answer() == whole
        assert scan.done


def test_a_collect_only_scan_changes_no_byte() -> None:
    """``/tokenize`` mode with a client that asked for the ids itself: collected, kept."""
    first = {"id": "x", "choices": [{"index": 0, "delta": {"content": ""}}],
             "prompt_token_ids": [1, 2, 3]}
    token = {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"},
                                     "token_ids": [97]}]}
    stream = event(first) + event(token) + SSE_DONE
    out, scan = relay(stream, [5, 50], Rewrite(collect_ids=True))
    assert out == stream
    assert scan.prompt_token_ids == [1, 2, 3] and scan.output_token_ids == [97]


# -- rewrites -----------------------------------------------------------------------------


def test_usage_gets_cached_tokens_only_in_the_usage_event() -> None:
    events = captured_stream()
    stream = b"".join(events)
    out, scan = relay(stream, [len(events[0]) + 3], Rewrite(cached_tokens=300))
    out_events = [e + b"\n\n" for e in out.split(b"\n\n") if e]
    assert len(out_events) == len(events)
    usage_at = next(i for i, e in enumerate(events) if b'"usage":{' in e)
    for i, (sent, got) in enumerate(zip(events, out_events, strict=True)):
        if i != usage_at:
            assert got == sent  # untouched, byte for byte
    (usage,) = sse_events(out_events[usage_at].decode())
    assert usage["usage"] == {"prompt_tokens": 379, "total_tokens": 387,
                              "completion_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 300}}
    assert usage["system_fingerprint"] == "vllm-0.32.0-1b05e8e7"
    assert scan.done


@pytest.mark.parametrize(("usage", "cached", "expected"), [
    ({"prompt_tokens": 10}, 4, {"cached_tokens": 4}),
    ({"prompt_tokens": 10}, 25, {"cached_tokens": 10}),  # never more than the prompt
    ({"prompt_tokens": 10, "prompt_tokens_details": None}, 4, {"cached_tokens": 4}),
    ({"prompt_tokens": 10, "prompt_tokens_details": {"audio_tokens": 0}}, 4,
     {"audio_tokens": 0, "cached_tokens": 4}),
])
def test_cached_tokens_fill_usage(usage: dict[str, Any], cached: int,
                                  expected: dict[str, Any]) -> None:
    out, _ = relay(event({"choices": [], "usage": usage}) + SSE_DONE, [],
                   Rewrite(cached_tokens=cached))
    assert parsed(out)[0]["usage"]["prompt_tokens_details"] == expected


def test_usage_that_d_filled_or_nobody_asked_for_is_left_alone() -> None:
    own = event({"choices": [], "usage": {"prompt_tokens": 10,
                                          "prompt_tokens_details": {"cached_tokens": 7}}})
    assert relay(own + SSE_DONE, [], Rewrite(cached_tokens=3))[0] == own + SSE_DONE
    plain = event({"choices": [], "usage": {"prompt_tokens": 10}})
    assert relay(plain + SSE_DONE, [], Rewrite())[0] == plain + SSE_DONE
    no_usage = chunk({"content": "x"}, usage=None)  # "usage":null is not a usage event
    assert relay(no_usage, [], Rewrite(cached_tokens=3))[0] == no_usage


def test_token_ids_the_router_asked_for_are_collected_and_stripped() -> None:
    first = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                          "content": ""}}],
             "prompt_token_ids": [1, 2, 3]}
    tokens = [{"id": "x", "choices": [{"index": 0, "delta": {"content": c},
                                       "token_ids": [ord(c)]}]} for c in "ab"]
    other = {"id": "x", "choices": [{"index": 1, "delta": {"content": "z"},
                                     "token_ids": [122]}]}
    stream = b"".join(event(o) for o in (first, *tokens, other)) + SSE_DONE
    out, scan = relay(stream, [len(event(first)) + 10], Rewrite(strip_ids=True,
                                                                collect_ids=True))
    assert scan.prompt_token_ids == [1, 2, 3]
    assert scan.output_token_ids == [97, 98]  # choice 0 only
    got = parsed(out)
    assert "prompt_token_ids" not in got[0]
    assert all("token_ids" not in c for e in got for c in e["choices"])
    assert [c["delta"]["content"] for e in got for c in e["choices"]] == ["", "a", "b", "z"]
    assert out.endswith(SSE_DONE)
    assert scan.answer() == ("ab", [])


def test_completions_prompt_ids_on_the_first_choice_are_collected() -> None:
    first = {"id": "c", "object": "text_completion",
             "choices": [{"index": 0, "text": "h", "token_ids": [104],
                          "prompt_token_ids": [5, 6]}]}
    second = {"id": "c", "object": "text_completion",
              "choices": [{"index": 0, "text": "i", "token_ids": [105],
                           "prompt_token_ids": None}]}
    out, scan = relay(event(first) + event(second) + SSE_DONE, [], Rewrite(
        strip_ids=True, collect_ids=True))
    assert (scan.prompt_token_ids, scan.output_token_ids) == ([5, 6], [104, 105])
    assert all(set(c) == {"index", "text"} for e in parsed(out) for c in e["choices"])
    assert scan.answer() == ("hi", [])


def test_final_chunk_params_are_captured_and_removed() -> None:
    """vLLM >= 0.33 puts D's retained params on the final chunk, cut here mid-marker."""
    params = load("chat_turn1.json")["d1"]["kv_transfer_params"]
    final = chunk({"content": "!"}, kv_transfer_params=params)
    stream = chunk({"content": "hi"}) + final + SSE_DONE
    marker = stream.index(b'"kv_transfer_params"') + 5
    out, scan = relay(stream, [marker], Rewrite())
    assert scan.params == params
    got = parsed(out)
    assert all("kv_transfer_params" not in e for e in got)
    assert got[1]["choices"][0]["delta"] == {"content": "!"}
    assert out.startswith(chunk({"content": "hi"}))  # the other event untouched
    assert scan.answer() == ("hi!", []) and scan.done


def test_error_events_are_noted_and_passed_through() -> None:
    err = event({"error": {"message": "KV load failed", "type": "InternalServerError",
                           "param": None, "code": 500}})
    stream = chunk({"content": "a"}) + err + SSE_DONE
    out, scan = relay(stream, [len(stream) - 3], Rewrite(cached_tokens=1))
    assert out == stream
    assert scan.error == {"message": "KV load failed", "type": "InternalServerError",
                          "param": None, "code": 500}
    quoted = chunk({"content": 'the "error" word'})  # in the text: not an error event
    _, clean = relay(quoted + SSE_DONE, [], Rewrite())
    assert clean.error is None and clean.answer()[0] == 'the "error" word'


def test_sse_error_is_vllms_error_event() -> None:
    raw = sse_error(502, "the decode node failed mid-stream")
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert sse_events(raw.decode()) == [{"error": {
        "message": "the decode node failed mid-stream", "type": "BadGatewayError",
        "param": None, "code": 502}}]


# -- the answer ---------------------------------------------------------------------------


def tool_delta(index: int, name: str | None = None, arguments: str | None = None) -> bytes:
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if arguments is not None:
        function["arguments"] = arguments
    return chunk({"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                                  "function": function}]})


def test_answer_with_tool_calls_assembled_from_deltas() -> None:
    stream = b"".join([
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me "}), chunk({"content": "look."}),
        tool_delta(0, "search"), tool_delta(0, arguments='{"q": '),
        tool_delta(1, "fetch", '{"url"'), tool_delta(0, arguments='"tides"}'),
        tool_delta(1, arguments=': "x"}'),
        chunk({"content": "ignored"}, index=1),
        SSE_DONE,
    ])
    for cuts in ([], [30], list(range(7, len(stream), 41))):
        out, scan = relay(stream, cuts, Rewrite())
        assert out == stream
        assert scan.answer() == ("Let me look.", [ToolCall("search", '{"q": "tides"}'),
                                                  ToolCall("fetch", '{"url": "x"}')])


def test_answer_over_several_batches_and_odd_events() -> None:
    """More than ``BATCH_BYTES`` of events (parsed in batches on the way) with a comment
    and a non-JSON event in between: the whole answer, nothing lost at batch edges."""
    pieces = [f"w{i} " for i in range(6000)]
    body = [chunk({"content": p}) for p in pieces]
    body.insert(100, b": keep-alive\n\n")
    body.insert(3000, b"data: not json\n\n")
    stream = b"".join(body) + SSE_DONE
    assert len(stream) > 3 * BATCH_BYTES
    cuts = list(range(1000, len(stream), 7919))
    out, scan = relay(stream, cuts, Rewrite())
    assert out == stream
    assert scan.answer() == ("".join(pieces), [])


def test_completions_text_is_the_answer() -> None:
    events = [{"id": "c", "object": "text_completion", "choices": [
        {"index": 0, "text": t, "logprobs": None, "finish_reason": None}]} for t in "abc"]
    stream = b"".join(event(e) for e in events) + SSE_DONE
    out, scan = relay(stream, [9], Rewrite())
    assert out == stream and scan.answer() == ("abc", [])


# -- non-streamed bodies ------------------------------------------------------------------


def test_rewrite_body_completions_captured() -> None:
    body = load("completions.json")["d"]
    obj = copy.deepcopy(body)
    params, text, calls, prompt_ids, output_ids = rewrite_body(
        obj, Rewrite(cached_tokens=5, strip_ids=True, collect_ids=True))
    assert params == body["kv_transfer_params"]
    assert text == "1*[qZ*)_" and calls == []
    assert prompt_ids == body["choices"][0]["prompt_token_ids"]
    assert output_ids == [49, 42, 91, 113, 90, 42, 41, 95]
    assert set(body) - set(obj) == {"kv_transfer_params"}
    assert set(body["choices"][0]) - set(obj["choices"][0]) == {"token_ids", "prompt_token_ids"}
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    kept = copy.deepcopy(body)
    rewrite_body(kept, Rewrite(collect_ids=True))  # the client asked for the ids itself
    assert kept["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    assert "kv_transfer_params" not in kept and kept["usage"] == body["usage"]


def test_rewrite_body_chat_with_tool_calls() -> None:
    obj: dict[str, Any] = {
        "id": "x", "object": "chat.completion",
        "choices": [{"index": 0, "message": {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "search", "arguments": "{\"q\":\"tides\"}"}}]},
            "token_ids": [1, 2]}],
        "prompt_token_ids": [7, 8, 9],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "kv_transfer_params": None,
    }
    params, text, calls, prompt_ids, output_ids = rewrite_body(
        obj, Rewrite(cached_tokens=0, strip_ids=True, collect_ids=True))
    assert params is None and text == ""
    assert calls == [ToolCall("search", "{\"q\":\"tides\"}")]
    assert (prompt_ids, output_ids) == ([7, 8, 9], [1, 2])
    assert "prompt_token_ids" not in obj and "token_ids" not in obj["choices"][0]
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


# -- vLLM 0.33: kv_transfer_params on the stream's chunks ----------------------------------

PARAMS_033 = {"do_remote_prefill": False, "do_remote_decode": True,
              "remote_block_ids": [[3, 4]], "remote_registration_generation": 1}


def text_chunk(text: str, *, final: bool = False, **top: Any) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
              "finish_reason": "length" if final else None}
    return event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice],
                  **top})


def relay_events(*events: bytes) -> tuple[StreamScan, bytes]:
    scan = StreamScan(Rewrite())
    out = b"".join(scan.feed(e) for e in (*events, SSE_DONE))
    assert scan.done
    return scan, out


def test_a_032_stream_carries_no_params() -> None:
    scan, out = relay_events(text_chunk("a"), text_chunk("b", final=True))
    assert (scan.params_seen, scan.params) == (False, None)
    assert out == text_chunk("a") + text_chunk("b", final=True) + SSE_DONE  # passed as is
    assert scan.answer()[0] == "ab"


def test_a_033_stream_gives_the_final_chunks_params_and_hides_every_one() -> None:
    scan, out = relay_events(text_chunk("a", kv_transfer_params=None),
                             text_chunk("b", final=True, kv_transfer_params=PARAMS_033))
    assert (scan.params_seen, scan.params) == (True, PARAMS_033)
    assert b"kv_transfer_params" not in out and b"registration" not in out
    assert scan.answer()[0] == "ab"


def test_a_033_final_chunk_with_null_params_means_nothing_retained() -> None:
    scan, out = relay_events(text_chunk("a", kv_transfer_params=None),
                             text_chunk("b", final=True, kv_transfer_params=None))
    assert (scan.params_seen, scan.params) == (True, None)
    assert b"kv_transfer_params" not in out
