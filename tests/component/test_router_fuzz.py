"""Property: whatever a client sends (bodies, types, paths, methods, headers), the router
answers below 500, and every error is an OpenAI error body. Over 10,000 requests, generated
deterministically by hypothesis, against the app called directly (ASGI) in front of the
scripted mock cluster; API keys and an admin key are on, so auth paths are fuzzed too."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.component.asgi_direct import Answer, call, is_openai_error
from tests.component.router_mock import MockCluster
from tests.component.router_rig import Rig

KEYS = ["t1:fuzz-key-1", "t2:fuzz-key-2"]
FIELDS = ["messages", "prompt", "model", "stream", "max_tokens", "n", "conversation_id",
          "stream_options", "return_token_ids", "tools", "max_completion_tokens", "role",
          "content", "kv_transfer_params", "include_usage", "temperature"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
         "/stats", "/internal/kv-report", "/admin/nodes/decode-0/drain",
         "/admin/nodes/decode-0/undrain", "/admin/conversations/drop", "/", "/v1"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
AUTH = [b"Bearer fuzz-key-1", b"Bearer fuzz-key-2", b"Bearer fuzz-admin", b"Bearer nope",
        b"bearer fuzz-key-1", b"Basic Zm9v", b""]

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
           | st.sampled_from(["user", "assistant", "system", "", "[DONE]", "mock", "missing"]))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4),
    max_leaves=5,
)
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                     "content": st.text(max_size=20)})
messages = (st.lists(good_message, min_size=1, max_size=3)
            | st.lists(good_message | st.dictionaries(
                st.sampled_from(["role", "content", "name"]), scalars, max_size=3), max_size=3)
            | json_values)
prompts = (st.text(max_size=30) | st.lists(st.integers(-5, 300), max_size=20)
           | st.lists(st.text(max_size=5), max_size=3) | json_values)
conversation_ids = st.none() | st.text(max_size=300) | st.sampled_from(["c1", "c2"]) | scalars


def bodies(prompt_key: str, prompt: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly-plausible request bodies with random fields, types and omissions."""
    plausible = st.fixed_dictionaries(
        {prompt_key: prompt},
        optional={"model": st.sampled_from(["mock", "missing"]) | scalars,
                  "max_tokens": st.integers(-2, 10**12) | scalars,
                  "stream": st.booleans() | scalars, "n": st.integers(0, 3) | scalars,
                  "conversation_id": conversation_ids, "stream_options": json_values,
                  "return_token_ids": st.booleans() | scalars,
                  "max_completion_tokens": st.integers(-1, 50) | scalars,
                  "kv_transfer_params": json_values},
    )
    extra = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values,
                            max_size=3)
    valid = st.fixed_dictionaries(
        {prompt_key: prompt, "model": st.just("mock"), "max_tokens": st.integers(1, 8)},
        optional={"stream": st.booleans(), "conversation_id": st.sampled_from(["c1", "c2"])})
    return st.one_of(
        valid, st.builds(lambda a, b: {**a, **b}, plausible, extra), plausible, json_values)


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


raw_bodies = st.binary(max_size=80) | st.text(max_size=40).map(str.encode)
header_values = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
headers = st.lists(st.tuples(
    st.sampled_from([b"authorization", b"content-type", b"content-length",
                     b"x-conversation-id", b"x-session-id", b"accept", b"x-other"]),
    header_values | st.sampled_from(AUTH)), max_size=4)


class Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.cluster = MockCluster(1, 2)
        self.rig = self.loop.run_until_complete(self._rig())
        self.count = 0
        self.statuses: dict[int, int] = {}

    async def _rig(self) -> Rig:
        return Rig(self.cluster, {"api_keys": KEYS, "admin_key": "fuzz-admin",
                                  "max_body_bytes": 256, "report_wait_s": 0.0})

    def request(self, method: str, path: str, hdrs: list[tuple[bytes, bytes]],
                raw: bytes) -> Answer:
        answer = self.loop.run_until_complete(call(self.rig.app, method, path, hdrs, [raw]))
        self.count += 1
        self.statuses[answer.status] = self.statuses.get(answer.status, 0) + 1
        assert 200 <= answer.status < 500, (method, path, hdrs, raw[:300], answer.body[:300])
        if answer.status >= 400 and method != "HEAD":
            assert is_openai_error(answer), (path, answer.status, answer.body[:300])
        return answer

    def close(self) -> None:
        self.loop.run_until_complete(self.rig.close())
        self.loop.close()


def fuzz(harness: Harness, examples: int) -> list[Callable[[], None]]:
    opts = settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
    auth = (b"authorization", b"Bearer fuzz-key-1")
    ctype = (b"content-type", b"application/json")

    @opts
    @given(body=bodies("messages", messages), stream=st.booleans())
    def chat(body: Any, stream: bool) -> None:
        if stream and isinstance(body, dict):
            body["stream"] = True
        harness.request("POST", "/v1/chat/completions", [auth, ctype], encode(body))

    @opts
    @given(body=bodies("prompt", prompts))
    def completions(body: Any) -> None:
        harness.request("POST", "/v1/completions", [auth, ctype], encode(body))

    @opts
    @given(method=st.sampled_from(METHODS),
           path=st.sampled_from(PATHS) | st.sampled_from(PATHS).map(lambda p: p + "/x")
           | st.text(min_size=1, max_size=30).map(lambda p: "/" + p),
           hdrs=headers, raw=raw_bodies | json_values.map(encode))
    def anything(method: str, path: str, hdrs: list[tuple[bytes, bytes]], raw: bytes) -> None:
        harness.request(method, path, hdrs, raw)

    @opts
    @given(path=st.sampled_from(PATHS[:2]), hdrs=headers, raw=raw_bodies)
    def headers_and_bytes(path: str, hdrs: list[tuple[bytes, bytes]], raw: bytes) -> None:
        harness.request("POST", path, hdrs, raw)

    return [chat, completions, anything, headers_and_bytes]


def test_fuzzed_requests_never_get_a_5xx() -> None:
    harness = Harness()
    try:
        for i, examples in enumerate((2200, 1800, 3600, 2500)):
            fuzz(harness, examples)[i]()
    finally:
        harness.close()
    assert harness.count >= 10_000, harness.count
    statuses = harness.statuses
    assert statuses.get(200, 0) > 100  # plenty of requests were routed end to end
    for status in (400, 401, 404, 405, 413):
        assert statuses.get(status, 0) > 0, statuses
