"""core.identity: which entry a request continues, from digests of what it sends."""

from __future__ import annotations

import json

from kvrelay.core.identity import (
    TEXT_BLOCK_BYTES,
    ChatMessage,
    ToolCall,
    answer_digest,
    chat_identity,
    scope_of,
    text_continuation,
    text_identity,
    text_matches,
)

SCOPE = scope_of("t", None)


def msg(role: str, content: str, **extra: object) -> ChatMessage:
    raw = json.dumps({"role": role, "content": content, **extra}).encode()
    return ChatMessage(raw, answer_digest(content) if role == "assistant" else None)


def test_the_anchor_commits_to_context_and_every_message() -> None:
    a = chat_identity(SCOPE, b"ctx", [msg("system", "s"), msg("user", "u")])
    assert a.anchor == chat_identity(SCOPE, b"ctx", [msg("system", "s"), msg("user", "u")]).anchor
    assert a.anchor != chat_identity(SCOPE, b"ctx2", [msg("system", "s"), msg("user", "u")]).anchor
    assert a.anchor != chat_identity(SCOPE, b"ctx", [msg("system", "s"), msg("user", "v")]).anchor
    assert a.anchor != chat_identity(SCOPE, b"ctx", [msg("system", "su")]).anchor
    assert a.prompt_bytes == sum(len(m.raw) for m in [msg("system", "s"), msg("user", "u")])


def test_probes_sit_at_assistant_messages_longest_first() -> None:
    messages = [msg("system", "s"), msg("user", "u1"), msg("assistant", "a1"),
                msg("user", "u2"), msg("assistant", "a2"), msg("tool", "t")]
    identity = chat_identity(SCOPE, b"ctx", messages)
    assert [p.offset for p in identity.probes] == [4, 2]
    turn2 = chat_identity(SCOPE, b"ctx", messages[:4])
    assert identity.probes[0].anchor == turn2.anchor
    assert identity.probes[0].continuation == answer_digest("a2")
    turn1 = chat_identity(SCOPE, b"ctx", messages[:2])
    assert identity.probes[1].anchor == turn1.anchor
    assert identity.probes[1].covered_bytes == sum(len(m.raw) for m in messages[:3])
    assert chat_identity(SCOPE, b"ctx", messages[:2]).probes == ()


def test_answers_compare_content_and_tool_calls_not_formatting() -> None:
    assert answer_digest("Hello") == answer_digest("  Hello\n")
    assert answer_digest("Hello") != answer_digest("Hello!")
    call = ToolCall("search", '{"q": "rivers", "n": 2}')
    assert answer_digest("", [call]) == answer_digest(
        "", [ToolCall("search", '{"n":2,"q":"rivers"}')])
    assert answer_digest("", [call]) != answer_digest("", [ToolCall("search", '{"q": "x"}')])
    assert answer_digest("", [call]) != answer_digest("", [ToolCall("find", call.arguments)])
    assert answer_digest("", [ToolCall("f", "not json")]) == answer_digest(
        "", [ToolCall("f", "not json")])


def test_scopes_differ_by_tenant_and_id() -> None:
    assert scope_of("t", None) != scope_of("t", "")
    assert scope_of("t", "a") != scope_of("u", "a")
    assert scope_of("ab", "c") != scope_of("a", "bc")
    narrowed = [scope_of("t", "a", user="u"), scope_of("t", "a", safety_identifier="u"),
                scope_of("t", "a", cache_salt="u"), scope_of("t", "a", bound=True),
                scope_of("t", "a", cache_salt=""), scope_of("t", "a")]
    assert len(set(narrowed)) == len(narrowed)  # every part narrows, none aliases another


def test_text_anchors_every_block_and_continues_with_prompt_tail_and_answer() -> None:
    prompt = ("x" * (2 * TEXT_BLOCK_BYTES + 100)).encode()
    turn1 = text_identity(SCOPE, b"ctx", prompt)
    assert turn1.tail_offset == 2 * TEXT_BLOCK_BYTES
    cont = text_continuation(turn1, b" answer")
    assert cont.num_bytes == 100 + len(" answer")
    follow = text_identity(SCOPE, b"ctx", prompt + b" answer and more")
    probe = next(p for p in follow.probes if p.offset == turn1.tail_offset)
    assert probe.anchor == turn1.anchor and probe.continuation is None
    assert text_matches(follow, probe, cont)
    assert not text_matches(text_identity(SCOPE, b"ctx", prompt + b" answer"), probe, cont)
    other = text_identity(SCOPE, b"ctx", prompt + b" ANSWER and more")
    assert not text_matches(other, probe, cont)


def test_a_short_prompt_anchors_at_the_context() -> None:
    turn1 = text_identity(SCOPE, b"ctx", b"hello")
    assert turn1.tail_offset == 0 and len(turn1.probes) == 1
    follow = text_identity(SCOPE, b"ctx", b"hello world, again")
    assert follow.probes[-1].anchor == turn1.anchor
    assert text_matches(follow, follow.probes[-1], text_continuation(turn1, b" world"))
