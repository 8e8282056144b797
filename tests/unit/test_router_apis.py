"""The API adapters (``router.apis``): each API's canonical history chains a re-sent answer
to D's answer in that API's form (text and tool calls; reasoning and ``cache_control`` left
out), conversation hints, usage in each API's convention, and the stream scanners."""

from __future__ import annotations

import json
from typing import Any

from kvrelay.core.identity import answer_digest
from kvrelay.router.apis.messages import MessagesScan, content_answer, session_of, set_cache_read
from kvrelay.router.apis.responses import ResponsesScan, output_answer
from kvrelay.router.config import DEFAULT_SESSION_HEADERS
from kvrelay.router.request import IdRules, parse_request
from kvrelay.router.sse import Rewrite


def identity(endpoint: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return parse_request(endpoint, json.dumps(body).encode(), headers or {}, "t",
                         IdRules(DEFAULT_SESSION_HEADERS)).identity


D_OUTPUT = [  # a Responses answer: reasoning, text, two function calls
    {"id": "rs_1", "type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "let me look"}], "encrypted_content": None},
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
    {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "ls",
     "arguments": '{"path": ".", "all": true}'},
    {"id": "fc_2", "type": "function_call", "call_id": "c2", "name": "cat",
     "arguments": '{"file": "a"}'},
]


def test_a_resent_responses_turn_continues_ds_output_as_one_item() -> None:
    turn1 = {"model": "m", "instructions": "i", "input": [{"role": "user", "content": "hi"}]}
    follow = {**turn1, "input": [
        *turn1["input"],
        {**D_OUTPUT[0], "encrypted_content": "opaque"},  # Codex re-sends reasoning its way
        D_OUTPUT[1],
        {**D_OUTPUT[2], "arguments": '{"all":true,"path":"."}'},  # reformatted JSON
        D_OUTPUT[3],
        {"type": "function_call_output", "call_id": "c1", "output": "a b"},
        {"type": "function_call_output", "call_id": "c2", "output": "x"},
    ]}
    first, second = identity("responses", turn1), identity("responses", follow)
    assert len(second.probes) == 1
    probe = second.probes[0]
    assert probe.anchor == first.anchor
    assert probe.continuation == answer_digest(*output_answer(D_OUTPUT))
    assert output_answer(D_OUTPUT)[0] == "Looking."
    assert [c.name for c in output_answer(D_OUTPUT)[1]] == ["ls", "cat"]
    # a context change (instructions, tools) starts another chain; chat never meets it
    assert identity("responses", {**turn1, "instructions": "j"}).anchor != first.anchor
    chat = parse_request("chat", json.dumps({"model": "m", "messages": turn1["input"]})
                         .encode(), {}, "t", IdRules(())).identity
    assert chat.anchor != first.anchor


MESSAGES = [{"role": "user", "content": [
    {"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}]}]
D_CONTENT = [{"type": "thinking", "thinking": "hmm", "signature": "s"},
             {"type": "text", "text": "I will read it."},
             {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}}]


def test_a_resent_messages_turn_continues_ds_content_markers_and_metadata_aside() -> None:
    system = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    turn1 = {"model": "m", "system": system, "messages": MESSAGES, "max_tokens": 9,
             "metadata": {"user_id": "u1"}, "thinking": {"type": "enabled", "budget_tokens": 5}}
    moved = {**turn1,
             "system": [{"type": "text", "text": "sys"}],
             "metadata": {"user_id": "u2"},
             "thinking": {"type": "enabled", "budget_tokens": 7},
             "messages": [
                 {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
                 {"role": "assistant", "content": [
                     D_CONTENT[0], D_CONTENT[1],
                     {**D_CONTENT[2], "cache_control": {"type": "ephemeral"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                               "content": "print(1)"}]}]}
    first, second = identity("messages", turn1), identity("messages", moved)
    assert second.probes[0].anchor == first.anchor
    assert second.probes[0].continuation == answer_digest(*content_answer(D_CONTENT))
    # thinking disabled renders another prompt: another chain
    off = {**turn1, "thinking": {"type": "disabled"}}
    assert identity("messages", off).anchor != first.anchor


def test_a_streamed_messages_answer_digests_as_the_non_streamed_one() -> None:
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "x", "usage": {"input_tokens": 50, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "I will "}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "read it."}}),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "t1", "name": "Read", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '{"file_path": '}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '"a.py"}'}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                           "usage": {"input_tokens": 50, "output_tokens": 9}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    raw = "".join(f"event: {k}\ndata: {json.dumps(v, separators=(',', ':'))}\n\n"
                  for k, v in events).encode()  # compact, as vLLM writes it
    scan = MessagesScan(Rewrite(cached_tokens=30))
    out = scan.feed(raw)
    assert scan.done and scan.error is None and scan.params is None
    assert answer_digest(*scan.answer()) == answer_digest(*content_answer(D_CONTENT))
    usages = [json.loads(b.split(b"data: ", 1)[1]) for b in out.split(b"\n\n")
              if b"usage" in b]
    assert usages[0]["message"]["usage"] == {"input_tokens": 20, "output_tokens": 0,
                                             "cache_read_input_tokens": 30}
    assert usages[1]["usage"] == {"input_tokens": 20, "output_tokens": 9,
                                  "cache_read_input_tokens": 30}
    untouched = [b for b in out.split(b"\n\n") if b"content_block_delta" in b]
    assert all(b + b"\n\n" in raw for b in untouched)  # relayed byte for byte


def test_anthropic_usage_counts_the_reuse_as_cache_read() -> None:
    usage: dict[str, Any] = {"input_tokens": 70, "cache_read_input_tokens": 30,
                             "cache_creation_input_tokens": 10, "output_tokens": 3}
    assert set_cache_read(usage, 80)  # the prompt is 110 tokens, 10 of them created
    assert usage == {"input_tokens": 20, "cache_read_input_tokens": 80,
                     "cache_creation_input_tokens": 10, "output_tokens": 3}
    small = {"input_tokens": 5, "output_tokens": 1}
    set_cache_read(small, 99)
    assert small == {"input_tokens": 0, "output_tokens": 1, "cache_read_input_tokens": 5}
    assert not set_cache_read(None, 3) and not set_cache_read({"output_tokens": 1}, 3)


def test_claude_codes_session_is_read_from_metadata_user_id() -> None:
    sid = "8f14e45f-ceea-467f-a0e6-7c9b5b1d2a3c"
    assert session_of(json.dumps({"device_id": "d", "session_id": sid})) == sid
    assert session_of(f"user_abc_account_def_session_{sid}") == sid
    assert session_of("user-42") is None and session_of("{not json") is None
    assert session_of(json.dumps({"session_id": ""})) is None
    body = {"model": "m", "messages": MESSAGES, "metadata": {"user_id": f"u_session_{sid}"}}
    # a client-sent session narrows the scope but binds to no caller (issue #23 finding 2)
    with_session = identity("messages", body)
    assert not with_session.explicit
    assert identity("messages", {**body, "metadata": {"user_id": "u"}}).scope \
        != with_session.scope
    header = identity("messages", body, {"x-claude-code-session-id": "h"})
    assert not header.explicit and header.scope != with_session.scope


def test_a_responses_stream_loses_only_internal_fields_and_gets_cached_tokens() -> None:
    snapshot = {"id": "r", "status": "in_progress", "usage": None, "kv_transfer_params": None,
                "ec_transfer_params": None}
    final = {**snapshot, "status": "completed", "output": D_OUTPUT,
             "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 40,
                                                                      "cache_write_tokens": 0},
                       "output_tokens": 5},
             "kv_transfer_params": {"remote_block_ids": [1]}}
    delta = {"type": "response.output_text.delta", "delta": '"kv_transfer_params":null'}

    def ev(kind: str, obj: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

    created = ev("response.created", {"response": snapshot, "type": "response.created"})
    text = ev("response.output_text.delta", delta)
    done = ev("response.completed", {"response": final, "type": "response.completed"})
    scan = ResponsesScan(Rewrite(cached_tokens=25))
    out = scan.feed(created + text) + scan.feed(done)
    assert b"kv_transfer_params" not in out.replace(text, b"")
    assert text in out  # the text delta (quoting the key) is relayed as it was
    assert scan.done and scan.params == {"remote_block_ids": [1]} and scan.params_seen
    assert scan.answer() == output_answer(D_OUTPUT)
    completed = json.loads(out.split(b"event: response.completed\ndata: ")[1])
    assert completed["response"]["usage"]["input_tokens_details"] == {
        "cached_tokens": 25, "cache_write_tokens": 0}


def test_a_cut_responses_stream_numbers_its_error_after_the_last_event() -> None:
    def ev(seq: int, delta: str) -> bytes:
        body = {"type": "response.output_text.delta", "delta": delta, "sequence_number": seq}
        return (b"event: response.output_text.delta\ndata: "
                + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")

    scan = ResponsesScan(Rewrite())
    assert json.loads(scan.cut(502, "x").split(b"data: ")[1])["sequence_number"] == 0
    scan.feed(ev(0, "a") + ev(1, '"sequence_number":99'))  # a delta quoting the key
    scan.feed(ev(22, "b"))
    cut = scan.cut(502, "the decode node failed mid-stream")
    assert cut.startswith(b"event: error\ndata: ")
    error = json.loads(cut.split(b"data: ")[1])
    assert error == {"type": "error", "code": "502", "param": None, "sequence_number": 23,
                     "message": "the decode node failed mid-stream"}


def test_a_streamed_tool_use_cut_before_its_arguments_digests_as_the_sdk_rebuilds_it() -> None:
    """A forced call cut by ``max_tokens`` streams ``content_block_start`` (``input: {}``) and
    no ``input_json_delta``; the SDK keeps ``input: {}`` and re-sends it, so the streamed
    answer must digest as that block does (it digested as empty arguments and never met)."""
    block = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "usage": {"input_tokens": 50, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": block}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                           "usage": {"output_tokens": 40}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    raw = "".join(f"event: {k}\ndata: {json.dumps(v, separators=(',', ':'))}\n\n"
                  for k, v in events).encode()
    scan = MessagesScan(Rewrite(cached_tokens=None))
    scan.feed(raw)
    assert scan.answer()[1][0].arguments == "{}"
    assert answer_digest(*scan.answer()) == answer_digest(*content_answer([block]))


def test_a_chat_message_of_one_text_part_digests_as_its_string() -> None:
    """vLLM renders content that is one text part as its string: a history re-sent the
    other way continues the same entry (probe 8b, finding 3); more parts, or a part with
    other keys, are another history."""
    def chat(content: Any) -> Any:
        return identity("chat", {"model": "m", "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "Three rivers."},
            {"role": "user", "content": "More?"}]})

    as_string = chat("Name three rivers.")
    as_part = chat([{"type": "text", "text": "Name three rivers."}])
    assert as_part.probes == as_string.probes and as_part.anchor == as_string.anchor
    for other in ([{"type": "text", "text": "Name three "}, {"type": "text", "text": "rivers."}],
                  [{"type": "text", "text": "Name three rivers.", "extra": 1}]):
        assert chat(other).probes != as_string.probes


def test_a_lone_surrogate_escape_is_named_as_such() -> None:
    """msgspec calls a high surrogate escape with no low one after it "Input data was
    truncated" (probe 13, H5: a client re-sending D's tool input with ``\\ud800`` was told
    its body was cut); the router names it. A pair decodes; a cut body is still "truncated"."""
    from kvrelay.router.apis.fields import load_json
    from kvrelay.router.errors import ClientError

    def refusal(raw: bytes) -> str:
        try:
            load_json(raw)
        except ClientError as exc:
            return str(exc)
        raise AssertionError("accepted")

    for raw in (rb'{"input": {"q": "\ud800"}}', rb'{"a": ["x\uDBFF"]}'):
        assert "lone UTF-16 surrogate" in refusal(raw)
    assert "surrogate" in refusal(rb'{"a": "x\uDBFF", "b": 1}')  # msgspec names this one
    assert load_json(rb'{"a": "\ud83d\ude00"}') == {"a": "\U0001F600"}
    assert refusal(rb'{"a": "\ud83d\ude00"') == "Invalid JSON body: Input data was truncated"
    assert "surrogate" in refusal(rb'{"a": "\udc00"}')  # a lone low one: msgspec names it
