"""Turn log records: built from a turn with the key hashed, encoded as one JSON line, decoded
back exactly, and bad lines rejected with a clear error."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.conversation import ConversationKey
from kvrelay.core.turnlog import TurnLogFormatError, TurnLogRecord

TAG_KEY = bytes(range(32))


def record(**overrides: object) -> TurnLogRecord:
    values: dict[str, object] = dict(
        key=ConversationKey("tenant-a", "session-42"), tag_key=TAG_KEY, at_s=1_700_000_000.25,
        gap_s=12.5,
        prompt_tokens=2048, reused_tokens=1900, output_tokens=300, action="pull",
        reason="pull", decode_node="decode-0", retained_tokens=2347, duration_s=1.5,
        ttft_s=0.12,
    )
    values.update(overrides)
    return TurnLogRecord.for_turn(**values)  # type: ignore[arg-type]


def test_for_turn_hashes_the_key_and_derives_new_tokens():
    rec = record()
    assert rec.key == ConversationKey("tenant-a", "session-42").hashed(TAG_KEY)
    assert rec.new_tokens == 2048 - 1900
    line = rec.to_json_line()
    assert "session-42" not in line and "tenant-a" not in line


def test_json_line_round_trips():
    rec = record()
    line = rec.to_json_line()
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line)["v"] == 1
    assert TurnLogRecord.from_json_line(line) == rec
    assert TurnLogRecord.from_json_line(line.encode()) == rec


def test_first_turn_without_conversation_or_stream_round_trips():
    rec = record(key=None, gap_s=None, ttft_s=None, retained_tokens=None, output_tokens=None,
                 reused_tokens=0, action="recompute", reason="no_conversation_id")
    assert TurnLogRecord.from_json_line(rec.to_json_line()) == rec


def test_unknown_keys_are_ignored_for_forward_compatibility():
    data = json.loads(record().to_json_line())
    data["later_field"] = [1, 2]
    assert TurnLogRecord.from_json(data) == record()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(v=2), "version"),
    (lambda d: d.pop("at_s"), "at_s"),
    (lambda d: d.update(prompt_tokens="12"), "prompt_tokens"),
    (lambda d: d.update(prompt_tokens=True), "prompt_tokens"),
    (lambda d: d.update(new_tokens=5), "new_tokens"),
    (lambda d: d.update(gap_s=-1), "gap_s"),
    (lambda d: d.update(action=""), "action"),
    (lambda d: d.update(reused_tokens=99999), "reused_tokens"),
])
def test_bad_records_are_rejected(mutate, message):
    data = json.loads(record().to_json_line())
    mutate(data)
    with pytest.raises(TurnLogFormatError, match=message):
        TurnLogRecord.from_json(data)


def test_non_json_and_non_objects_are_rejected():
    with pytest.raises(TurnLogFormatError, match="not JSON"):
        TurnLogRecord.from_json_line("{nope")
    with pytest.raises(TurnLogFormatError, match="object"):
        TurnLogRecord.from_json_line("[1, 2]")


def test_nan_cannot_be_recorded():
    with pytest.raises(ValueError):
        record(gap_s=float("nan"))
