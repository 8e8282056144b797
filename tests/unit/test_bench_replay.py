"""Replay loader: vLLM multi_turn (OpenAI messages) and ShareGPT files, turn grouping, answer
lengths as max_tokens, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest

from kvrelay.bench.replay import (
    RecordedConversation,
    ReplayFormatError,
    load_conversations,
    replay_workload,
)
from kvrelay.bench.tokens import byte_template_counter as count
from kvrelay.bench.workloads import Pacing, ThinkTime

OPENAI = [
    {"id": "c1", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "a" * 40},
        {"role": "user", "content": [{"type": "text", "text": "part one "},
                                     {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "b" * 7},
    ]},
    {"id": 2, "messages": [{"role": "user", "content": "only a question"}]},
]
SHAREGPT = [
    {"id": "s1", "conversations": [
        {"from": "system", "value": "sys"},
        {"from": "human", "value": "q1"},
        {"from": "gpt", "value": "x" * 3000},
        {"from": "human", "value": "q2"},
        {"from": "gpt", "value": "y" * 12},
        {"from": "human", "value": "q3 without answer"},
    ]},
]


def write(tmp_path, data, name="conv.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_loads_openai_messages_format(tmp_path):
    convs = load_conversations(write(tmp_path, OPENAI))
    assert [c.id for c in convs] == ["c1", "2"]
    assert [m["role"] for m in convs[0].messages] == [
        "system", "user", "assistant", "user", "assistant"]
    assert convs[0].messages[3]["content"] == "part one part two"


def test_loads_sharegpt_format_and_normalizes_roles(tmp_path):
    convs = load_conversations(write(tmp_path, SHAREGPT))
    assert [m["role"] for m in convs[0].messages] == [
        "system", "user", "assistant", "user", "assistant", "user"]
    assert convs[0].messages[1] == {"role": "user", "content": "q1"}


def test_loads_jsonl(tmp_path):
    text = "\n".join(json.dumps(c) for c in OPENAI + SHAREGPT) + "\n"
    convs = load_conversations(write(tmp_path, text, "conv.jsonl"))
    assert [c.id for c in convs] == ["c1", "2", "s1"]


@pytest.mark.parametrize(("content", "match"), [
    ("{not json", "not valid JSON"),
    ({"id": 1, "messages": []}, "expected a JSON list"),
    ([], "holds no conversations"),
    (["just a string"], "conversation 0: expected an object"),
    ([{"id": "a", "turns": []}], r"conversation 0 \(id a\): needs a 'messages' list"),
    ([{"id": "a", "messages": []}], "no messages"),
    ([{"messages": [{"role": "user", "content": "x"}]},
      {"id": "b", "messages": [{"role": "wizard", "content": "x"}]}],
     r"conversation 1 \(id b\), message 0: unknown 'role' 'wizard'"),
    ([{"id": "c", "conversations": [{"from": "human", "value": 3}]}],
     "'value' must be a string or a list of text parts"),
    ([{"id": "d", "messages": ["hi"]}], "message 0: expected an object"),
])
def test_bad_files_raise_clear_errors(tmp_path, content, match):
    path = write(tmp_path, content)
    with pytest.raises(ReplayFormatError, match=match) as info:
        load_conversations(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ReplayFormatError, match="cannot read"):
        load_conversations(tmp_path / "nope.json")


def test_turns_take_answer_lengths_as_max_tokens(tmp_path):
    convs = load_conversations(write(tmp_path, SHAREGPT))
    w = replay_workload(convs, count, max_answer_tokens=1024, default_answer_tokens=50,
                        pacing=Pacing(ThinkTime("constant", 2.0)))
    (conv,) = w.conversations
    assert [t.max_tokens for t in conv.turns] == [1024, 12, 50]  # clamped, exact, default
    assert [[m["role"] for m in t.new_messages] for t in conv.turns] == [
        ["system", "user"], ["user"], ["user"]]
    assert [t.think_s for t in conv.turns] == [0.0, 2.0, 2.0]
    # target = the recorded prompt, recorded answers included
    recorded = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "x" * 3000}, {"role": "user", "content": "q2"}]
    assert conv.turns[1].target_tokens == count(recorded)


def test_limits_ids_salt_and_tool_messages():
    convs = [
        RecordedConversation("a", (
            {"role": "assistant", "content": "Welcome!"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "call"},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "q2"},
        )),
        RecordedConversation("b", ({"role": "system", "content": "nothing to ask"},)),
        RecordedConversation("c", ({"role": "user", "content": "q"},)),
    ]
    w = replay_workload(convs, count, salt="S1", pacing=Pacing(arrival_mean_s=0))
    assert [c.conversation_id for c in w.conversations] == ["replay-0-a", "replay-2-c"]
    assert w.params["skipped"] == 1
    first = w.conversations[0].turns
    # a leading answer is context of the first turn, salted; a tool result becomes user text
    assert first[0].new_messages[0] == {"role": "assistant", "content": "[S1] Welcome!"}
    assert first[1].new_messages == ({"role": "user", "content": "Tool result:\n42"},)
    assert len(first) == 3
    assert len(replay_workload(convs, count, max_turns=2).conversations[0].turns) == 2
    assert len(replay_workload(convs, count, max_conversations=1).conversations) == 1


def test_nothing_to_replay_is_an_error():
    convs = [RecordedConversation("b", ({"role": "system", "content": "s"},))]
    with pytest.raises(ReplayFormatError, match="no conversation has a user turn"):
        replay_workload(convs, count)


def test_replay_is_deterministic(tmp_path):
    convs = load_conversations(write(tmp_path, OPENAI + SHAREGPT))
    assert replay_workload(convs, count, seed=3) == replay_workload(convs, count, seed=3)
