"""The turn log writer: buffered appends, flush on size, age and close, rotation by size with N
backups (never more on disk), write errors counted instead of raised; and the gap tracker."""

from __future__ import annotations

import os

import pytest

from kvrelay.core.turnlog import TurnLogRecord
from kvrelay.router.turnlog import TurnGaps, TurnLogWriter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rec(i: int) -> TurnLogRecord:
    return TurnLogRecord.for_turn(
        key=None, tag_key=bytes(32), at_s=1000.0 + i, gap_s=None, prompt_tokens=100 + i,
        reused_tokens=0, output_tokens=10, action="recompute", reason="no_entry",
        decode_node="decode-0", retained_tokens=109 + i,
    )


def read_records(*paths):
    out = []
    for p in paths:
        out += [TurnLogRecord.from_json_line(line) for line in p.read_text().splitlines()]
    return out


def test_appends_are_buffered_until_close(tmp_path):
    path = tmp_path / "turns.jsonl"
    writer = TurnLogWriter(path, buffer_bytes=1 << 20, flush_interval_s=60, clock=Clock())
    for i in range(3):
        writer.append(rec(i))
    assert path.read_text() == ""
    writer.close()
    assert read_records(path) == [rec(0), rec(1), rec(2)]
    assert writer.written_records == 3 and writer.closed
    writer.close()  # idempotent
    with pytest.raises(ValueError):
        writer.append(rec(3))


def test_flushes_when_the_buffer_fills_or_ages(tmp_path):
    path = tmp_path / "turns.jsonl"
    clock = Clock()
    line = len(rec(0).to_json_line())
    writer = TurnLogWriter(path, buffer_bytes=2 * line, flush_interval_s=5, clock=clock)
    writer.append(rec(0))
    assert path.read_text() == ""
    writer.append(rec(0))  # buffer full
    assert len(read_records(path)) == 2
    writer.append(rec(0))
    clock.now = 5.0
    writer.append(rec(0))  # old enough
    assert len(read_records(path)) == 4
    writer.close()


def test_rotates_by_size_and_keeps_n_backups(tmp_path):
    path = tmp_path / "turns.jsonl"
    line = len(rec(0).to_json_line())
    writer = TurnLogWriter(path, max_bytes=3 * line + 5, backups=2, buffer_bytes=1,
                           clock=Clock())
    for i in range(20):
        writer.append(rec(i))
    writer.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["turns.jsonl", "turns.jsonl.1", "turns.jsonl.2"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 3 * line + 5
    # the newest records survive, in order, oldest backup first
    kept = read_records(tmp_path / "turns.jsonl.2", tmp_path / "turns.jsonl.1", path)
    assert kept == [rec(i) for i in range(20 - len(kept), 20)]
    assert len(kept) == 3 + 3 + 2  # two full backups, the live file holds 20 mod 3


def test_rotation_inside_one_flush_keeps_every_file_bounded(tmp_path):
    path = tmp_path / "turns.jsonl"
    line = len(rec(0).to_json_line())
    writer = TurnLogWriter(path, max_bytes=2 * line, backups=10, buffer_bytes=2 * line,
                           flush_interval_s=60, clock=Clock())
    for i in range(9):
        writer.append(rec(i))
    writer.close()
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert max(sizes) <= 2 * line and sum(sizes) == 9 * line


def test_zero_backups_truncates(tmp_path):
    path = tmp_path / "turns.jsonl"
    line = len(rec(0).to_json_line())
    writer = TurnLogWriter(path, max_bytes=2 * line, backups=0, buffer_bytes=1, clock=Clock())
    for i in range(5):
        writer.append(rec(i))
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["turns.jsonl"]
    assert read_records(path) == [rec(4)]


def test_appends_to_an_existing_log_and_counts_its_size(tmp_path):
    path = tmp_path / "turns.jsonl"
    line = len(rec(0).to_json_line())
    path.write_text(rec(0).to_json_line() * 2)
    writer = TurnLogWriter(path, max_bytes=3 * line, backups=1, buffer_bytes=1, clock=Clock())
    writer.append(rec(1))
    writer.append(rec(2))
    writer.close()
    assert read_records(tmp_path / "turns.jsonl.1") == [rec(0), rec(0), rec(1)]
    assert read_records(path) == [rec(2)]


def test_unopenable_path_raises_at_construction(tmp_path):
    with pytest.raises(OSError):
        TurnLogWriter(tmp_path / "missing-dir" / "turns.jsonl")


def test_write_errors_drop_records_without_raising(tmp_path, caplog):
    path = tmp_path / "turns.jsonl"
    writer = TurnLogWriter(path, buffer_bytes=1, clock=Clock())
    os.close(writer._fd)  # simulate the file descriptor going bad under the writer
    writer.append(rec(0))
    writer.append(rec(1))
    assert writer.dropped_records == 2 and writer.written_records == 0
    assert sum("write failed" in r.message for r in caplog.records) == 1  # rate-limited
    writer._fd = None  # the next write reopens
    writer.append(rec(2))
    writer.close()
    assert read_records(path) == [rec(2)]


def test_turn_gaps_remember_the_last_end_per_key_lru_bounded():
    gaps = TurnGaps(max_keys=2)
    assert gaps.gap_s("a", 10.0) is None
    gaps.turn_ended("a", 10.0)
    gaps.turn_ended("b", 11.0)
    assert gaps.gap_s("a", 14.5) == 4.5
    assert gaps.gap_s("a", 9.0) == 0.0
    gaps.turn_ended("a", 20.0)  # a is now the most recent
    gaps.turn_ended("c", 21.0)  # evicts b
    assert gaps.gap_s("b", 30.0) is None and gaps.gap_s("a", 30.0) == 10.0
    assert len(gaps) == 2
