"""Reading turns from a turn log or a public trace file, one ``TraceTurn`` per request.

Formats (``--format``, detected from the file by default):

* ``turnlog``: kvrelay's own turn log (``core.turnlog``), one record per line. The measured
  ``gap_s``, ``duration_s``, D node and retained tokens are used as they are.
* ``chat``: JSONL ``{chat_id, parent_chat_id, timestamp, input_length, output_length, turn,
  type, hash_ids}`` (the public chat/API traces of a large cloud provider: ``chat_id`` is one
  request, ``parent_chat_id`` the previous request of its session or ``-1``). Timestamps in
  seconds; ``hash_ids`` are 16-token block hashes (optional).
* ``mooncake``: JSONL ``{timestamp, input_length, output_length, hash_ids}``. Timestamps in
  milliseconds; ``hash_ids`` are chained 512-token block ids. There are no session ids:
  a request continues the earlier, not yet continued request whose whole prompt (every full
  block) its own ``hash_ids`` start with, the longest such one (see ``MooncakeSessions``).
* ``csv``: a header row and the same columns as ``chat`` (when there is a ``chat_id``
  column) or ``mooncake``; ``hash_ids`` as a JSON list or ids separated by spaces or ``;``.

Detection: ``.csv`` files are ``csv``; otherwise the first record decides (``v`` and
``prompt_tokens``: turn log; ``chat_id``: chat; ``input_length``: mooncake).

Every problem raises ``TraceFormatError`` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from kvrelay.core.turnlog import TurnLogFormatError, TurnLogRecord

TraceFormat = Literal["turnlog", "chat", "mooncake", "csv"]
#: Progress callback: characters (~bytes) of the file read so far.
OnBytes = Callable[[int], None]
FORMATS: tuple[str, ...] = ("auto", "turnlog", "chat", "mooncake", "csv")
#: Tokens per ``hash_ids`` block, by schema.
DEFAULT_BLOCK_TOKENS = {"chat": 16, "mooncake": 512}
#: Seconds per timestamp unit, by schema.
DEFAULT_TIME_UNIT_S = {"chat": 1.0, "mooncake": 0.001, "turnlog": 1.0}


class TraceFormatError(ValueError):
    """A trace or turn log that cannot be read."""


@dataclass(frozen=True, slots=True)
class TraceTurn:
    """One request of a trace.

    ``conversation`` groups the turns of a session (any hashable value). ``at_s`` is the
    arrival time in seconds. ``hash_ids`` (trace formats) are the prompt's block hashes.
    The turn log's measured fields (``gap_s`` since the previous turn's end, ``duration_s``,
    ``decode_node``, ``retained_tokens``, ``reused_tokens``, ``prefix_mismatch``) are ``None``
    / false for traces.
    """

    conversation: object
    at_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] | None = None
    gap_s: float | None = None
    duration_s: float | None = None
    decode_node: str | None = None
    retained_tokens: int | None = None
    reused_tokens: int | None = None
    prefix_mismatch: bool = False


def detect_format(path: Path) -> TraceFormat:
    """The format of ``path`` (see the module docstring)."""
    if path.suffix.lower() == ".csv":
        return "csv"
    try:
        with path.open("rb") as f:
            for raw in f:
                if raw.strip():
                    first = json.loads(raw.removeprefix(_BOM))  # Windows tools write one
                    break
            else:
                raise TraceFormatError(f"{path}: the file is empty")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: line 1 is not JSON ({exc}); CSV files need a "
                               ".csv suffix or --format csv") from exc
    if not isinstance(first, dict):
        raise TraceFormatError(f"{path}: line 1 is not a JSON object")
    if "prompt_tokens" in first and "v" in first:
        return "turnlog"
    if "chat_id" in first:
        return "chat"
    if "input_length" in first:
        return "mooncake"
    raise TraceFormatError(
        f"{path}: unknown record {sorted(first)}; expected a kvrelay turn log, "
        "{chat_id, parent_chat_id, timestamp, input_length, output_length, hash_ids} or "
        "{timestamp, input_length, output_length, hash_ids}"
    )


def read_turns(
    path: Path,
    fmt: str = "auto",
    *,
    time_unit_s: float | None = None,
    block_tokens: int | None = None,
    on_bytes: OnBytes | None = None,
    sort: bool = False,
) -> Iterator[TraceTurn]:
    """The turns of ``path`` in file order, or by arrival time with ``sort`` (which reads
    the whole file first: sessions are inferred in time order). ``time_unit_s`` overrides
    the seconds per timestamp unit; ``on_bytes(n)`` (if given) is called with the bytes read
    so far."""
    kind: TraceFormat = detect_format(path) if fmt == "auto" else fmt  # type: ignore[assignment]
    if kind not in FORMATS:
        raise TraceFormatError(f"unknown format {fmt!r}; choose from {FORMATS}")
    try:
        f = path.open("r", encoding="utf-8-sig", newline="" if kind == "csv" else None)
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc
    with f:
        if kind == "turnlog":
            turns = _turnlog(path, f, time_unit_s or 1.0, on_bytes)
            yield from sorted(turns, key=lambda t: t.at_s) if sort else turns
        elif kind == "csv":
            yield from _csv(path, f, time_unit_s, block_tokens, on_bytes, sort)
        else:
            rows = _json_lines(path, f, on_bytes)
            yield from _records(path, _by_time(path, rows) if sort else rows, kind,
                                time_unit_s, block_tokens)


def turns_from_records(
    records: Iterable[dict[str, Any]], fmt: Literal["chat", "mooncake"] = "chat",
    *, origin: str = "<records>",
) -> Iterator[TraceTurn]:
    """Turns of already-parsed trace records (e.g. ``synth.synth_trace``), as if read from a
    file of format ``fmt``."""
    return _records(Path(origin), enumerate(records, start=1), fmt, None, None)


def _by_time(path: Path, rows: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    def when(row: tuple[int, Any]) -> float:
        number, data = row
        try:
            return float(data["timestamp"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{path}: line {number}: no numeric timestamp") from exc

    return iter(sorted(rows, key=when))


def schema_of(record: dict[str, Any]) -> Literal["chat", "mooncake"]:
    return "chat" if "chat_id" in record else "mooncake"


def _counted(f: IO[str], on_bytes: OnBytes | None) -> Iterator[str]:
    """The lines of ``f``, reporting the characters read (~bytes) every 4096 lines."""
    if on_bytes is None:
        yield from f
        return
    done = 0
    for number, line in enumerate(f, start=1):
        done += len(line)
        if number % 4096 == 0:
            on_bytes(done)
        yield line
    on_bytes(done)


def _json_lines(
    path: Path, f: IO[str], on_bytes: OnBytes | None
) -> Iterator[tuple[int, Any]]:
    decode = json.JSONDecoder(parse_constant=_not_a_number).raw_decode
    number = 0
    try:
        for number, line in enumerate(_counted(f, on_bytes), start=1):
            text = line.strip()
            if text:
                value, end = decode(text)
                if end != len(text):
                    raise json.JSONDecodeError("extra data after the object", text, end)
                yield number, value
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: line {number} is not JSON: {exc}") from exc
    except _NotANumber as exc:
        raise TraceFormatError(f"{path}: line {number}: {exc} is not a number") from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: line {number + 1} is not UTF-8: {exc}") from exc


def _turnlog(
    path: Path, f: IO[str], unit: float, on_bytes: OnBytes | None
) -> Iterator[TraceTurn]:
    for number, data in _json_lines(path, f, on_bytes):
        try:
            rec = TurnLogRecord.from_json(data)
        except TurnLogFormatError as exc:
            raise TraceFormatError(f"{path}: line {number}: {exc}") from exc
        conversation: object = rec.key if rec.key is not None else ("line", str(path), number)
        output = rec.output_tokens
        if output is None and rec.retained_tokens is not None:
            output = max(0, rec.retained_tokens - rec.prompt_tokens)
        yield TraceTurn(
            conversation=conversation,
            at_s=rec.at_s * unit,
            input_tokens=rec.prompt_tokens,
            output_tokens=output or 0,
            gap_s=rec.gap_s,
            duration_s=rec.duration_s,
            decode_node=rec.decode_node,
            retained_tokens=rec.retained_tokens or 0,
            reused_tokens=rec.reused_tokens if rec.action in ("pull", "direct") else 0,
            prefix_mismatch=rec.reason == "prefix_mismatch",
        )


def _records(
    path: Path,
    rows: Iterator[tuple[int, Any]],
    kind: str,
    time_unit_s: float | None,
    block_tokens: int | None,
) -> Iterator[TraceTurn]:
    roots: dict[object, object] = {}
    sessions: MooncakeSessions | None = None
    unit = time_unit_s
    for number, data in rows:
        if not isinstance(data, dict):
            raise TraceFormatError(f"{path}: line {number} is not a JSON object")
        schema = schema_of(data) if kind == "csv" else kind
        if unit is None:
            unit = DEFAULT_TIME_UNIT_S[schema]
        try:
            at_s = float(data["timestamp"]) * unit
            if not math.isfinite(at_s):
                raise ValueError(f"timestamp {data['timestamp']!r} is not a finite number")
            input_tokens = _count(data["input_length"])
            output_tokens = _count(data["output_length"])
            hash_ids = _hash_ids(data.get("hash_ids"))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(
                f"{path}: line {number}: needs timestamp, input_length, output_length "
                f"(numbers >= 0) and optional hash_ids (a list of integers): {exc!r}"
            ) from exc
        if schema == "chat":
            chat = _key(data.get("chat_id"))
            parent = _key(data.get("parent_chat_id", -1))
            root = roots.get(parent, parent) if parent not in (-1, "-1", None) else chat
            roots[chat] = root
            conversation: object = root
        else:
            if sessions is None:
                sessions = MooncakeSessions(block_tokens or DEFAULT_BLOCK_TOKENS["mooncake"])
            conversation = sessions.conversation_of(number, at_s, input_tokens, hash_ids)
        yield TraceTurn(conversation, at_s, input_tokens, output_tokens, hash_ids)


class TraceOrderError(TraceFormatError):
    """Turns that are not in time order where the reader needs them to be."""


class MooncakeSessions:
    """Infers sessions in a trace without ids, from chained block hashes.

    A request *continues* an earlier request when its ``hash_ids`` start with every full
    block of the earlier one's prompt (the earlier turn's whole prompt is its prefix, as in a
    multi-turn conversation); of the candidates not yet continued, the longest wins. Each
    request is continued at most once (D's retained entry is single-use). Requests must come
    in time order (``TraceOrderError`` otherwise).
    """

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._open: dict[tuple[int, int], object] = {}
        self._last_at_s = float("-inf")

    def conversation_of(
        self, number: int, at_s: float, input_tokens: int, hash_ids: Sequence[int] | None
    ) -> object:
        if at_s < self._last_at_s:
            raise TraceOrderError(f"line {number}: timestamp goes backwards")
        self._last_at_s = at_s
        if not hash_ids:
            return ("request", number)
        conversation: object = ("request", number)
        for j in range(len(hash_ids) - 1, -1, -1):
            found = self._open.pop((j + 1, hash_ids[j]), None)
            if found is not None:
                conversation = found
                break
        full = min(input_tokens // self.block_tokens, len(hash_ids))
        if full > 0:
            self._open[(full, hash_ids[full - 1])] = conversation
        return conversation


def _csv(
    path: Path, f: IO[str], time_unit_s: float | None, block_tokens: int | None,
    on_bytes: OnBytes | None, sort: bool,
) -> Iterator[TraceTurn]:
    reader = csv.DictReader(_counted(f, on_bytes))
    if not reader.fieldnames or not {"timestamp", "input_length", "output_length"} <= set(
        reader.fieldnames
    ):
        raise TraceFormatError(
            f"{path}: the CSV header needs timestamp, input_length, output_length (and "
            f"optionally chat_id, parent_chat_id, hash_ids); got {reader.fieldnames}"
        )

    def rows() -> Iterator[tuple[int, Any]]:
        for number, row in enumerate(reader, start=2):
            data: dict[str, Any] = dict(row)
            cell = (data.get("hash_ids") or "").strip()
            try:
                data["hash_ids"] = _parse_id_list(cell) if cell else None
            except ValueError as exc:
                raise TraceFormatError(f"{path}: line {number}: bad hash_ids: {exc}") from exc
            yield number, data

    yield from _records(path, _by_time(path, rows()) if sort else rows(), "csv", time_unit_s,
                        block_tokens)


def _parse_id_list(cell: str) -> list[int]:
    if cell.startswith("["):
        value = json.loads(cell)
        if not isinstance(value, list):
            raise ValueError("not a list")
        return [int(x) for x in value]
    return [int(x) for x in cell.replace(";", " ").replace(",", " ").split()]


MAX_TOKENS = 1 << 32
"""No prompt or answer is this long: a larger length is a broken record, not a turn."""


def _count(value: object) -> int:
    number = float(value)  # type: ignore[arg-type]
    if not 0 <= number < MAX_TOKENS:  # NaN too
        raise ValueError(f"length {value!r} is not in [0, {MAX_TOKENS})")
    return int(number)


_BOM = b"\xef\xbb\xbf"


class _NotANumber(ValueError):
    """JSON's non-standard ``NaN`` / ``Infinity`` (Python's ``json`` accepts them)."""


def _not_a_number(name: str) -> float:
    raise _NotANumber(name)


def _hash_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError("hash_ids must be a list")
    return value


def _key(value: object) -> object:
    """Chat ids as they come (ints or strings); ``"12"`` and ``12`` are the same chat."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value
