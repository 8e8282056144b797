"""Issue #12, defect 12: fuzzing over a real socket, along the three dimensions the round-2
probe broke: header sizes, JSON nesting depth and number literals.

Hypothesis draws requests (derandomized: the same few hundred every run) and sends each to
``kvrelay route`` (a subprocess, API keys on) in front of fake engines. For every answer:
never a 5xx, and every 4xx that has a body carries an OpenAI error body. Where issue #12 fixes
the outcome, it is checked too:

* a request line, a header field, all header fields or their number clearly over its limit
  (8 KiB, 8 KiB, 64 KiB, 100) is refused with 431 (414 or 431 for the request line), and a
  request clearly under every limit is not;
* a body nested 300 levels or deeper is a 400;
* a number that overflows to infinity is a 400 and reaches no engine.

"Clearly" leaves a margin around each limit (how a field is measured is the router's
business: name and value, with or without the separator).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.raw_http import RawConnection, RawResponse, request_bytes
from tests.component.router_process import PATIENCE_S, RouterProcess, is_openai_error, run_router

KIB = 1024
CHAT = "/v1/chat/completions"
KEYS = ("--api-key", "alice:KA", "--api-key", "bob:KB")
AUTH = ("Authorization", "Bearer KA")
LINE_LIMIT, FIELD_LIMIT, TOTAL_LIMIT, COUNT_LIMIT = 8 * KIB, 8 * KIB, 64 * KIB, 100
MARGIN = 256
MESSAGES = [{"role": "user", "content": "hi"}]
OPTIONS = settings(deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck))


class Harness:
    """The router and its fake engines on an event loop of their own (hypothesis calls the
    test functions synchronously); every request is one fresh connection."""

    def __init__(self, log_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.stack = contextlib.AsyncExitStack()
        self.cluster, self.router = self.loop.run_until_complete(self._start(log_dir))
        self.count = 0

    async def _start(self, log_dir: Path) -> tuple[FakeCluster, RouterProcess]:
        cluster = await self.stack.enter_async_context(
            FakeCluster(1, 1, engine_config(report_delay_s=0.0)))
        router = await self.stack.enter_async_context(run_router(cluster, log_dir, *KEYS))
        return cluster, router

    def generation_requests(self) -> int:
        return sum(len(e.records) for e in self.cluster.engines)

    def send(self, data: bytes) -> RawResponse:
        self.count += 1
        return self.loop.run_until_complete(asyncio.wait_for(self._send(data), PATIENCE_S))

    async def _send(self, data: bytes) -> RawResponse:
        conn = await RawConnection.open(self.router.host, self.router.port)
        try:
            await conn.send(data)
            return await conn.read_response()
        finally:
            conn.abort()

    def close(self) -> None:
        self.loop.run_until_complete(self.stack.aclose())
        self.loop.close()


def check_answer(resp: RawResponse, what: str) -> None:
    """Never a 5xx (nor no answer at all); a 4xx body is an OpenAI error."""
    assert 200 <= resp.status < 500, f"{what}: HTTP {resp.status or 'no answer'}"
    if resp.status >= 400:
        announced = (resp.headers.get("transfer-encoding")
                     or resp.headers.get("content-length", "0"))
        if announced != "0":
            assert resp.complete, f"{what}: HTTP {resp.status} with a cut-off body"
            try:
                body = resp.json()
            except ValueError:
                raise AssertionError(
                    f"{what}: HTTP {resp.status}, body not JSON: {resp.body[:200]!r}") from None
            assert is_openai_error(body, resp.status), (
                f"{what}: HTTP {resp.status} without an OpenAI error body: {resp.body[:200]!r}")


@dataclass(frozen=True)
class Head:
    """A request head: query length and header fields (name, value size)."""

    method: str
    query_len: int
    fields: tuple[tuple[str, int], ...]
    auth: bool

    def to_bytes(self) -> bytes:
        target = "/health" if self.method == "GET" else CHAT
        if self.query_len:
            target += "?q=" + "a" * self.query_len
        headers = [(name, "v" * size) for name, size in self.fields]
        if self.auth:
            headers.append(AUTH)
        body = b""
        if self.method == "POST":
            headers.append(("Content-Type", "application/json"))
            body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 2}).encode()
        return request_bytes(self.method, target, headers, body)

    def measure(self) -> tuple[int, list[int], int]:
        """Request line length, the length of each header line, their number."""
        head = self.to_bytes().split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        return len(head[0]), [len(h) for h in head[1:]], len(head) - 1


sizes = st.one_of(st.integers(0, 40),
                  st.integers(FIELD_LIMIT - 2 * MARGIN, FIELD_LIMIT + 2 * MARGIN),
                  st.integers(0, 12 * KIB))
heads = st.builds(
    Head,
    method=st.sampled_from(["GET", "POST"]),
    query_len=st.one_of(st.just(0), st.integers(0, 200),
                        st.integers(LINE_LIMIT - 2 * MARGIN, LINE_LIMIT + 2 * MARGIN),
                        st.integers(0, 12 * KIB)),
    fields=st.one_of(
        st.lists(st.tuples(st.from_regex(r"X-[A-Za-z0-9-]{1,12}", fullmatch=True), sizes),
                 max_size=12),
        st.integers(0, 160).map(lambda n: tuple((f"X-F{i}", 1) for i in range(n))),
    ).map(tuple),
    auth=st.booleans(),
)


def fuzz_headers(h: Harness, examples: int) -> None:
    @settings(OPTIONS, max_examples=examples)
    @given(head=heads)
    def run(head: Head) -> None:
        line, lines, count = head.measure()
        resp = h.send(head.to_bytes())
        what = (f"{head.method}, request line {line} B, {count} header fields, largest "
                f"{max(lines, default=0)} B, {sum(lines)} B in all")
        check_answer(resp, what)
        line_over = line > LINE_LIMIT + MARGIN
        fields_over = (max(lines, default=0) > FIELD_LIMIT + MARGIN
                       or sum(lines) > TOTAL_LIMIT + 4 * MARGIN or count > COUNT_LIMIT + 3)
        under = (line < LINE_LIMIT - MARGIN and max(lines, default=0) < FIELD_LIMIT - MARGIN
                 and sum(lines) < TOTAL_LIMIT - 4 * MARGIN and count < COUNT_LIMIT - 3)
        if fields_over:
            assert resp.status == 431, f"{what}: HTTP {resp.status}, expected 431"
        elif line_over:
            assert resp.status in (414, 431), f"{what}: HTTP {resp.status}, expected 414/431"
        elif under:
            assert resp.status not in (414, 431), f"{what}: HTTP {resp.status}, within limits"

    run()


def fuzz_nesting(h: Harness, examples: int) -> None:
    @settings(OPTIONS, max_examples=examples)
    @given(depth=st.one_of(st.integers(1, 3000), st.integers(940, 1000), st.integers(1, 80)),
           kind=st.sampled_from(["dict", "list"]),
           where=st.sampled_from(["unknown_field", "tools", "content"]))
    def run(depth: int, kind: str, where: str) -> None:
        inner = ('{"a": ' * depth + "1" + "}" * depth) if kind == "dict" else (
            "[" * depth + "1" + "]" * depth)
        if where == "content":
            messages = f'[{{"role": "user", "content": {inner}}}]'
            body = f'{{"model": "tiny", "max_tokens": 2, "messages": {messages}}}'
        else:
            body = (f'{{"model": "tiny", "max_tokens": 2, "messages": {json.dumps(MESSAGES)},'
                    f' "{where}": {inner}}}')
        resp = h.send(request_bytes("POST", CHAT, [AUTH, ("Content-Type", "application/json")],
                                    body.encode()))
        what = f"{kind} nested {depth} deep in {where}"
        check_answer(resp, what)
        if depth >= 300:
            assert resp.status == 400, f"{what}: HTTP {resp.status}, expected 400"

    run()


literals = st.builds(
    lambda sign, digits, frac, marker, esign, exp: (
        f"{sign}{digits}{'.' + frac if frac else ''}{marker + esign + str(exp) if marker else ''}"),
    sign=st.sampled_from(["", "-"]),
    digits=st.one_of(st.sampled_from(["0", "1", "9"]), st.from_regex(r"[1-9][0-9]{0,20}",
                                                                     fullmatch=True)),
    frac=st.one_of(st.just(""), st.from_regex(r"[0-9]{1,8}", fullmatch=True)),
    marker=st.sampled_from(["", "e", "E"]),
    esign=st.sampled_from(["", "+", "-"]),
    exp=st.one_of(st.integers(0, 400), st.integers(300, 330), st.integers(0, 1200)),
)


def fuzz_numbers(h: Harness, examples: int) -> None:
    @settings(OPTIONS, max_examples=examples)
    @given(literal=literals,
           where=st.sampled_from(["temperature", "top_p", "seed", "max_tokens", "nested"]))
    def run(literal: str, where: str) -> None:
        field = (f'"unknown_field": {{"x": [0, {{"y": {literal}}}]}}' if where == "nested"
                 else f'"{where}": {literal}')
        body = (f'{{"model": "tiny", "messages": {json.dumps(MESSAGES)},'
                f' "max_tokens": 2, {field}}}' if where != "max_tokens"
                else f'{{"model": "tiny", "messages": {json.dumps(MESSAGES)}, {field}}}')
        before = h.generation_requests()
        resp = h.send(request_bytes("POST", CHAT, [AUTH, ("Content-Type", "application/json")],
                                    body.encode()))
        what = f"{literal} as {where}"
        check_answer(resp, what)
        if math.isinf(float(literal)):
            forwarded = h.generation_requests() - before
            assert resp.status == 400 and forwarded == 0, (
                f"{what} (infinite): HTTP {resp.status}, {forwarded} engine request(s)")

    run()


def test_fuzzed_header_sizes_nesting_and_numbers_over_the_socket(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    try:
        fuzz_headers(harness, 160)
        fuzz_nesting(harness, 120)
        fuzz_numbers(harness, 160)
    finally:
        harness.close()
    assert harness.count >= 440, harness.count
