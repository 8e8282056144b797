"""core.identity: which entry a request continues, from digests of what it sends."""

from __future__ import annotations

import json

from kvrelay.core.identity import (
    TEXT_BLOCK_BYTES,
    TEXT_FINE_BYTES,
    ChatMessage,
    Continuation,
    RequestIdentity,
    ToolCall,
    answer_digest,
    chat_identity,
    scope_of,
    text_end,
    text_entry,
    text_fines,
    text_identity,
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


def test_tool_arguments_digest_as_the_numbers_a_javascript_client_re_sends() -> None:
    """Probe 12: a JavaScript client (Claude Code, Codex) parses D's arguments into doubles
    and re-sends them: ``1.0`` as ``1``, ``1e3`` as ``1000``, an integer past 2**53 as the
    double it rounds to, and Infinity as ``null``. Each must digest as D's answer did."""
    from_d = ToolCall("f", '{"a": 1.0, "b": [1e3, 2.5, -0.0], "c": 12345678901234567890, '
                           '"d": true, "e": 1e400, "f": 0, "g": "1.0"}')
    re_sent = ToolCall("f", '{"a":1,"b":[1000,2.5,0],"c":12345678901234567000,"d":true,'
                            '"e":null,"f":0,"g":"1.0"}')
    assert answer_digest("", [from_d]) == answer_digest("", [re_sent])
    for other in ('{"a":1.5}', '{"a":"1"}', '{"a":true}', '{"a":1,"g":"1"}'):
        assert answer_digest("", [ToolCall("f", '{"a": 1.0}')]) != answer_digest(
            "", [ToolCall("f", other)])
    assert answer_digest("", [ToolCall("f", "[" * 5000 + "]" * 5000)]) != answer_digest(
        "", [ToolCall("f", "[]")])  # too deep to read: digested as sent, never an error
    assert answer_digest("", [ToolCall("f", "[" * 100_000)]) == answer_digest(
        "", [ToolCall("f", "[" * 100_000)])


def test_scopes_differ_by_tenant_and_id() -> None:
    assert scope_of("t", None) != scope_of("t", "")
    assert scope_of("t", "a") != scope_of("u", "a")
    assert scope_of("ab", "c") != scope_of("a", "bc")
    narrowed = [scope_of("t", "a", user="u"), scope_of("t", "a", safety_identifier="u"),
                scope_of("t", "a", cache_salt="u"), scope_of("t", "a", bound=True),
                scope_of("t", "a", cache_salt=""), scope_of("t", "a")]
    assert len(set(narrowed)) == len(narrowed)  # every part narrows, none aliases another


def carried(identity: RequestIdentity, anchor: bytes, cont: Continuation) -> bool:
    """Whether ``identity`` carries the entry at (``anchor``, ``cont``), as a lookup finds it."""
    probe = next((p for p in identity.probes if p.anchor == anchor), None)
    return probe is not None and \
        text_end(identity, probe, text_fines(identity, probe), cont.num_bytes) == cont


def test_text_anchors_every_block_and_files_an_entry_at_its_end() -> None:
    prompt = ("x" * (2 * TEXT_BLOCK_BYTES + 100)).encode()
    turn1 = text_identity(SCOPE, b"ctx", prompt)
    assert turn1.tail_offset == 2 * TEXT_BLOCK_BYTES
    anchor, cont = text_entry(turn1, b" answer")
    assert anchor == turn1.anchor and cont.num_bytes == 100 + len(" answer")
    follow = text_identity(SCOPE, b"ctx", prompt + b" answer and more")
    assert [p.offset for p in follow.probes] == [2048, 1024, 0]
    assert all(p.continuation is None for p in follow.probes)
    assert carried(follow, anchor, cont)
    assert not carried(text_identity(SCOPE, b"ctx", prompt + b" answer"), anchor, cont)
    assert not carried(text_identity(SCOPE, b"ctx", prompt + b" ANSWER and more"), anchor, cont)
    assert not carried(text_identity(SCOPE, b"ctx", b"y" + prompt[1:] + b" answer and more"),
                       anchor, cont)
    assert not carried(text_identity(SCOPE, b"ctx2", prompt + b" answer and more"), anchor, cont)


def test_an_answer_that_crosses_a_block_files_the_entry_in_the_next_block() -> None:
    prompt = ("p" * (TEXT_BLOCK_BYTES - 10)).encode()
    answer = ("a" * 300).encode()
    turn1 = text_identity(SCOPE, b"ctx", prompt)
    anchor, cont = text_entry(turn1, answer)
    assert anchor != turn1.anchor and cont.num_bytes == len(prompt) + 300 - TEXT_BLOCK_BYTES
    follow = text_identity(SCOPE, b"ctx", prompt + answer + b" next")
    assert follow.probes[0].anchor == anchor and carried(follow, anchor, cont)
    assert text_entry(follow, b"")[0] == anchor  # the follow-up's own prompt anchors there


def test_ends_at_every_offset_of_a_block_are_told_apart() -> None:
    base = bytes(range(256)) * 4
    follow = text_identity(SCOPE, b"ctx", base + b"!")
    probe = follow.probes[-1]  # block 0
    fines = text_fines(follow, probe)
    assert len(fines) == TEXT_BLOCK_BYTES // TEXT_FINE_BYTES
    seen = set()
    for end in range(1, TEXT_BLOCK_BYTES):
        anchor, cont = text_entry(text_identity(SCOPE, b"ctx", base[:end]), b"")
        assert anchor == probe.anchor
        assert text_end(follow, probe, fines, end) == cont
        seen.add(cont)
    assert len(seen) == TEXT_BLOCK_BYTES - 1
    assert text_end(follow, probe, fines, TEXT_BLOCK_BYTES) is None


def test_a_short_prompt_anchors_at_the_context() -> None:
    turn1 = text_identity(SCOPE, b"ctx", b"hello")
    assert turn1.tail_offset == 0 and len(turn1.probes) == 1
    follow = text_identity(SCOPE, b"ctx", b"hello world, again")
    anchor, cont = text_entry(turn1, b" world")
    assert follow.probes[-1].anchor == turn1.anchor == anchor
    assert carried(follow, anchor, cont)
