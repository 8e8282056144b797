"""Reading traces: the chat format (sessions by parent_chat_id), Mooncake (sessions inferred
from chained block hashes, ms timestamps), CSV, kvrelay's turn log; format detection, sorting
and clear errors with the file and line."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.turnlog import TurnLogRecord
from kvrelay.tune.trace import (
    MooncakeSessions,
    TraceFormatError,
    TraceOrderError,
    detect_format,
    read_turns,
)


def jsonl(tmp_path, rows, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(chat_id, parent, ts, inp=100, out=10, **extra):
    return {"chat_id": chat_id, "parent_chat_id": parent, "timestamp": ts, "input_length": inp,
            "output_length": out, "turn": 1, "type": "text", **extra}


def test_chat_sessions_follow_parent_links_to_the_root(tmp_path):
    path = jsonl(tmp_path, [chat(1, -1, 0.5), chat(2, -1, 1.0), chat(3, 1, 2.0),
                            chat(4, 3, 3.0), chat(5, 77, 4.0), chat(6, 77, 5.0)])
    assert detect_format(path) == "chat"
    turns = list(read_turns(path))
    assert [t.conversation for t in turns] == [1, 2, 1, 1, 77, 77]
    assert [t.at_s for t in turns] == [0.5, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert turns[0].input_tokens == 100 and turns[0].output_tokens == 10
    assert turns[0].hash_ids is None


def test_sorting_reads_children_listed_before_their_parents(tmp_path):
    path = jsonl(tmp_path, [chat(3, 1, 2.0), chat(1, -1, 0.5), chat("4", "3", 3.0)])
    turns = list(read_turns(path, sort=True))
    assert [t.at_s for t in turns] == [0.5, 2.0, 3.0]
    assert {t.conversation for t in turns} == {1}


def test_mooncake_timestamps_are_ms_and_sessions_are_inferred(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 2600, "output_length": 5,
         "hash_ids": [1, 2, 3, 4, 5, 6]},          # continues request 1 (whole prompt)
        {"timestamp": 1500, "input_length": 1100, "output_length": 5,
         "hash_ids": [1, 2, 9]},                   # shares a prefix only: new session
        {"timestamp": 2000, "input_length": 4000, "output_length": 5,
         "hash_ids": [1, 2, 3, 4, 5, 7, 8, 10]},   # continues request 2 (5 full blocks)
        {"timestamp": 2500, "input_length": 2000, "output_length": 5,
         "hash_ids": [1, 2, 3, 11]},               # request 1 is spent; extends request 3
        {"timestamp": 2600, "input_length": 600, "output_length": 5,
         "hash_ids": [20, 21]},                    # nothing in common: new
    ]
    path = jsonl(tmp_path, rows)
    assert detect_format(path) == "mooncake"
    turns = list(read_turns(path))
    assert [t.at_s for t in turns] == [0.0, 1.0, 1.5, 2.0, 2.5, 2.6]
    c = [t.conversation for t in turns]
    assert c[0] == c[1] == c[3]
    assert c[2] == c[4]
    assert len({c[0], c[2], c[5]}) == 3


def test_mooncake_sessions_need_time_order():
    sessions = MooncakeSessions(512)
    sessions.conversation_of(1, 5.0, 600, [1, 2])
    with pytest.raises(TraceOrderError):
        sessions.conversation_of(2, 4.0, 600, [1, 2])


def test_csv_with_and_without_chat_ids(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("chat_id,parent_chat_id,timestamp,input_length,output_length,hash_ids\n"
                    '1,-1,0.0,40,8,"[10, 11, 12]"\n'
                    "2,1,3.5,60,8,10 11 12 13\n")
    turns = list(read_turns(path))
    assert detect_format(path) == "csv"
    assert [t.conversation for t in turns] == [1, 1]
    assert turns[0].hash_ids == [10, 11, 12] and turns[1].hash_ids == [10, 11, 12, 13]
    plain = tmp_path / "m.csv"
    plain.write_text("timestamp,input_length,output_length\n0,10,1\n2500,20,1\n")
    assert [t.at_s for t in read_turns(plain)] == [0.0, 2.5]


def test_turn_log_records_become_turns(tmp_path):
    path = tmp_path / "turns.jsonl"
    first = TurnLogRecord(key="k1", at_s=100.0, gap_s=None, prompt_tokens=500, reused_tokens=0,
                          new_tokens=500, output_tokens=50, action="recompute",
                          reason="no_entry", decode_node="decode-1", retained_tokens=549,
                          duration_s=2.0)
    second = TurnLogRecord(key="k1", at_s=130.0, gap_s=28.0, prompt_tokens=600,
                           reused_tokens=549, new_tokens=51, output_tokens=None,
                           action="pull", reason="pull", decode_node="decode-1",
                           retained_tokens=700)
    anon = TurnLogRecord(key=None, at_s=131.0, gap_s=None, prompt_tokens=10, reused_tokens=0,
                         new_tokens=10, output_tokens=3, action="recompute",
                         reason="no_conversation_id", decode_node="decode-0",
                         retained_tokens=None)
    path.write_text(first.to_json_line() + second.to_json_line() + anon.to_json_line())
    assert detect_format(path) == "turnlog"
    a, b, c = read_turns(path)
    assert (a.conversation, a.gap_s, a.duration_s, a.decode_node) == ("k1", None, 2.0, "decode-1")
    assert a.retained_tokens == 549 and a.reused_tokens == 0
    assert b.reused_tokens == 549 and b.output_tokens == 100  # from retained - prompt
    assert c.retained_tokens == 0 and c.conversation not in ("k1", None)


@pytest.mark.parametrize("content, message", [
    ('{"chat_id": 1, "timestamp": 0, "input_length": 5, "output_length": 1}\n{oops\n',
     "line 2 is not JSON"),
    ('{"chat_id": 1, "timestamp": 0, "output_length": 1}\n', "line 1: needs timestamp"),
    ('{"chat_id": 1, "timestamp": 0, "input_length": -5, "output_length": 1}\n', "line 1"),
    ('{"chat_id": 1, "timestamp": 0, "input_length": 5, "output_length": 1, '
     '"hash_ids": 3}\n', "hash_ids"),
    ('{"something": 1}\n', "unknown record"),
    ("", "empty"),
    # Python's json reads NaN / Infinity; a trace's numbers are finite and plausible
    ('{"chat_id": 1, "timestamp": NaN, "input_length": 5, "output_length": 1}\n',
     "line 1: NaN is not a number"),
    ('{"chat_id": 1, "timestamp": 0, "input_length": 1e30, "output_length": 1}\n',
     r"line 1: .*length 1e\+30 is not in"),
])
def test_bad_files_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message) as info:
        list(read_turns(path))
    assert str(path) in str(info.value)


def test_csv_without_the_needed_columns_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TraceFormatError, match="CSV header"):
        list(read_turns(path))


def test_a_csv_timestamp_must_be_finite_and_a_bom_is_no_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,input_length,output_length\ninf,5,1\n")
    with pytest.raises(TraceFormatError, match="not a finite number"):
        list(read_turns(bad))
    bom = tmp_path / "bom.jsonl"  # as Windows tools write UTF-8
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(chat(1, -1, 0)).encode() + b"\n")
    assert detect_format(bom) == "chat"
    assert [t.input_tokens for t in read_turns(bom)] == [100]
