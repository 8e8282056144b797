"""Server-sent events as OpenAI-compatible servers stream them, read by a client.

A stream is events separated by a blank line; the payload of an event is its ``data:``
line (OpenAI-compatible servers send one per event): a JSON object (a chunk, or
``{"error": {...}}`` when the stream fails midway), and ``[DONE]`` last.

A chunk's generated text is ``choices[*].delta.content`` (chat) or ``choices[*].text``
(completions); its ``usage`` (with ``stream_options.include_usage``) comes on a chunk of its
own near the end. The same ``usage`` object ends a non-streamed response, so ``usage_of``
reads both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

DONE = "[DONE]"
"""The payload of a stream's last event."""


def sse_data(line: str) -> str | None:
    """The payload of one line of a stream: what follows ``data:`` (one leading space
    dropped, as SSE says), or ``None`` for any other line (blank, comment, other field)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(" ") else payload


def sse_payloads(body: str) -> list[str]:
    """The payloads of every event of a whole stream body, in order."""
    out: list[str] = []
    for line in body.replace("\r\n", "\n").split("\n"):
        payload = sse_data(line)
        if payload is not None:
            out.append(payload)
    return out


class EventBuffer:
    """Framing of a stream that arrives in pieces: ``feed`` the bytes as they come, get the
    payloads of the events they complete."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        out: list[str] = []
        for event in events:
            for line in event.decode("utf-8").split("\n"):
                payload = sse_data(line.rstrip("\r"))
                if payload is not None:
                    out.append(payload)
        return out


def json_chunk(payload: str) -> Mapping[str, object] | None:
    """The JSON object of an event's payload; ``None`` for ``[DONE]`` and for JSON that is
    not an object. ``ValueError`` when the payload is not JSON."""
    if payload.strip() == DONE:
        return None
    chunk = json.loads(payload)
    return chunk if isinstance(chunk, dict) else None


def line_chunks(lines: Iterable[str]) -> Iterator[Mapping[str, object]]:
    """The JSON chunks of a stream read line by line (``httpx``'s ``iter_lines``), each as
    soon as its line arrives; ``[DONE]`` and other lines are skipped."""
    for line in lines:
        payload = sse_data(line)
        chunk = json_chunk(payload) if payload is not None else None
        if chunk is not None:
            yield chunk


def sse_events(body: str) -> list[Mapping[str, object] | str]:
    """Every event of a whole stream body: its JSON object, or ``DONE``."""
    out: list[Mapping[str, object] | str] = []
    for payload in sse_payloads(body):
        chunk = json_chunk(payload)
        if chunk is not None:
            out.append(chunk)
        elif payload.strip() == DONE:
            out.append(DONE)
    return out


def chunk_content(chunk: Mapping[str, object]) -> str:
    """The text one streamed chunk adds: ``delta.content`` of a chat chunk's choices, or
    ``text`` of a completions chunk's."""
    out: list[str] = []
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(content, str):
            out.append(content)
    return "".join(out)


def chunk_error(chunk: Mapping[str, object]) -> object | None:
    """The ``error`` of an error event (the stream failed midway), else ``None``."""
    error = chunk.get("error")
    return error if error else None


@dataclass(frozen=True)
class Usage:
    """Token counts a server reports (``None``: not reported)."""

    prompt_tokens: int | None
    completion_tokens: int | None


def usage_of(body: Mapping[str, object]) -> Usage | None:
    """The ``usage`` of a chunk or a whole response, ``None`` when it has none."""
    usage = body.get("usage")
    if not isinstance(usage, dict) or not usage:
        return None
    return Usage(json_count(usage.get("prompt_tokens")),
                 json_count(usage.get("completion_tokens")))


def json_count(value: object) -> int | None:
    """A count as a JSON body gives it (a number, or a numeric string), ``None`` if it is
    missing or not one."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return int(value)
    except ValueError:
        return None
