"""Property: whatever a client sends (bodies, types, paths, methods, headers), the router
answers below 500, and every error is in its API's error body (OpenAI's; Anthropic's on
``/v1/messages``). Over 10,000 requests (Responses and Messages bodies among them), generated
deterministically by hypothesis, against the app called directly (ASGI) in front of the
scripted mock cluster; API keys and an admin key are on, so auth paths are fuzzed too.

Multi-turn conversations are fuzzed as well (ids or none, streams, answers re-sent exactly,
re-spaced, edited, with tool calls or content parts; D's reports delivered, corrupted,
repeated or lost), and so is the internal listener D posts reports to. Whatever happens,
no pull reads anything but the prompt's exact prefix and no D request is read twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.client.sse import sse_events
from tests.component.asgi_direct import Answer, call, is_openai_error
from tests.component.router_mock import MockCluster
from tests.component.router_rig import Rig, stream_text

KEYS = ["t1:fuzz-key-1", "t2:fuzz-key-2"]
FIELDS = ["messages", "prompt", "model", "stream", "max_tokens", "n", "conversation_id",
          "stream_options", "return_token_ids", "tools", "max_completion_tokens", "role",
          "content", "kv_transfer_params", "include_usage", "temperature", "input",
          "instructions", "previous_response_id", "store", "max_output_tokens", "system",
          "metadata", "cache_control", "type", "tool_use", "tool_result", "background"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
         "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics",
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


Corruption = str
CORRUPTIONS = ["none", "none", "lost", "twice", "engine", "prompt_tokens", "output_tokens",
               "turn_id", "garbage", "batch"]
ASSISTANT_FORMS = ["exact", "exact", "spaced", "edited", "tool_call", "parts", "reasoning",
                   "earlier_edited"]


class Harness:
    """Two routers in one event loop: ``rig`` (1 P, 2 D, reports as D sends them, small
    body limit) for single requests, ``conv`` (reports held until the test delivers them,
    corrupted or not) for conversations."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.cluster = MockCluster(1, 2)
        self.rig = self.loop.run_until_complete(self._rig(self.cluster, max_body_bytes=256))
        # the conversations are about correctness: the rig's fixed costs pull whenever the
        # guard allows
        self.conv = self.loop.run_until_complete(self._rig(
            MockCluster(1, 2, report_mode="manual"), max_body_bytes=1 << 20))
        self.count = 0
        self.statuses: dict[int, int] = {}
        self.report_outcomes: dict[str, int] = {}

    async def _rig(self, cluster: MockCluster, **settings: Any) -> Rig:
        return Rig(cluster, {"api_keys": KEYS, "admin_key": "fuzz-admin",
                             "report_wait_s": 0.0, **settings})

    def request(self, method: str, path: str, hdrs: list[tuple[bytes, bytes]],
                raw: bytes, *, rig: Rig | None = None, internal: bool = False) -> Answer:
        rig = rig or self.rig
        app = rig.app.internal if internal else rig.app
        answer = self.loop.run_until_complete(call(app, method, path, hdrs, [raw]))
        self.count += 1
        self.statuses[answer.status] = self.statuses.get(answer.status, 0) + 1
        assert 200 <= answer.status < 500, (method, path, hdrs, raw[:300], answer.body[:300])
        if answer.status >= 400 and method != "HEAD":
            # on the Messages API's paths every refusal is Anthropic's, a wrong method's too
            bare = path.partition("?")[0]
            messages = bare == "/v1/messages" or bare.startswith("/v1/messages/")
            shaped = is_anthropic_error if messages and not internal else is_openai_error
            assert shaped(answer), (path, answer.status, answer.body[:300])
        if internal and path == "/internal/kv-report" and answer.status == 200:
            body = answer.json()
            for outcome in body.get("outcomes", [body.get("outcome")]):
                self.report_outcomes[outcome] = self.report_outcomes.get(outcome, 0) + 1
        return answer

    def deliver(self, corruption: Corruption) -> None:
        """Post the conversation router's held reports as D would, after ``corruption``."""
        cluster = self.conv.cluster
        held, cluster.held_reports = cluster.held_reports, []
        if corruption == "lost":
            return
        for report in held:
            sent: Any = dict(report)
            params = dict(sent["kv_transfer_params"])
            if corruption == "engine":
                params["remote_engine_id"] = "engine-impostor"
            elif corruption == "prompt_tokens":
                sent["num_prompt_tokens"] += 1
            elif corruption == "output_tokens":
                sent["num_output_tokens"] += 1000
            elif corruption == "turn_id":
                sent["turn_id"] = sent["turn_id"][::-1]
            sent["kv_transfer_params"] = params
            if corruption == "garbage":
                sent = {"turn_id": sent["turn_id"], "kv_transfer_params": [1, 2]}
            elif corruption == "batch":
                sent = [sent, {"turn_id": "nope"}, 3]
            for _ in range(2 if corruption == "twice" else 1):
                self.request("POST", "/internal/kv-report", [JSON_TYPE], encode(sent),
                             rig=self.conv, internal=True)

    def close(self) -> None:
        for rig in (self.rig, self.conv):
            self.loop.run_until_complete(rig.close())
            assert not rig.cluster.wrong_reuses, rig.cluster.wrong_reuses
            assert not rig.cluster.double_reads, rig.cluster.double_reads
        self.loop.close()


JSON_TYPE = (b"content-type", b"application/json")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def is_anthropic_error(answer: Answer) -> bool:
    """``{"type": "error", "error": {"type": str, "message": str}}``."""
    try:
        body = answer.json()
    except ValueError:
        return False
    inner = body.get("error") if isinstance(body, dict) else None
    return (body.get("type") == "error" and isinstance(inner, dict)
            and isinstance(inner.get("type"), str) and isinstance(inner.get("message"), str))


items = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "developer", "system"]),
     "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["input_text", "output_text", "text", "tool_use",
                                   "tool_result", "image"]),
          "text": st.text(max_size=10) | scalars},
         optional={"cache_control": json_values, "input": json_values,
                   "name": scalars}), max_size=3)},
    optional={"type": st.sampled_from(["message", "function_call", "function_call_output",
                                       "reasoning", "web_search_call"]) | scalars,
              "name": scalars, "arguments": scalars, "call_id": scalars}),
    max_size=3) | json_values
SYSTEM = {"role": "system", "content": "You are an agent under test; answer briefly. " * 4}


def answer_text(answer: Answer, stream: bool) -> str:
    if stream:
        return stream_text(sse_events(answer.body.decode()))
    content = answer.json()["choices"][0]["message"]["content"]
    return str(content)


def resent(messages: list[dict[str, Any]], answer: str, form: str) -> list[dict[str, Any]]:
    """The history a client re-sends after ``answer``, in one of ``ASSISTANT_FORMS``."""
    out = [dict(m) for m in messages]
    reply: dict[str, Any] = {"role": "assistant", "content": answer}
    if form == "spaced":
        reply["content"] = f" {answer}\n"
    elif form == "edited":
        reply["content"] = answer[:-1] + "!"
    elif form == "tool_call":
        reply["tool_calls"] = [{"id": "call_1", "type": "function", "function": {
            "name": "lookup", "arguments": '{"q": 1}'}}]
    elif form == "parts":
        reply["content"] = [{"type": "text", "text": answer}]
    elif form == "reasoning":
        reply["reasoning_content"] = "thinking it over"
    elif form == "earlier_edited":
        out[0]["content"] = str(out[0].get("content")) + "?"
    return [*out, reply]


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
    @given(body=bodies("input", items), extra=st.fixed_dictionaries({}, optional={
        "previous_response_id": scalars, "store": scalars, "background": scalars,
        "instructions": scalars, "max_output_tokens": st.integers(-1, 10) | scalars,
        "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(
            ["function", "web_search", "mcp"]) | scalars}), max_size=2) | json_values}))
    def responses(body: Any, extra: dict[str, Any]) -> None:
        body = {**body, **extra} if isinstance(body, dict) else body
        harness.request("POST", "/v1/responses", [auth, ctype], encode(body))

    @opts
    @given(body=bodies("messages", items), path=st.sampled_from(ANTHROPIC_PATHS),
           extra=st.fixed_dictionaries({}, optional={
               "system": json_values, "metadata": json_values, "thinking": json_values,
               "tools": json_values, "output_config": json_values}))
    def messages_api(body: Any, path: str, extra: dict[str, Any]) -> None:
        body = {**body, **extra} if isinstance(body, dict) else body
        harness.request("POST", path, [auth, ctype], encode(body))

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

    @opts
    @given(first=st.lists(good_message, min_size=1, max_size=3),
           conversation=st.none() | st.sampled_from(["c1", "c2"]),
           header_id=st.booleans(), streams=st.lists(st.booleans(), min_size=3, max_size=3),
           forms=st.lists(st.sampled_from(ASSISTANT_FORMS), min_size=2, max_size=2),
           corruptions=st.lists(st.sampled_from(CORRUPTIONS), min_size=2, max_size=2),
           temperature=st.sampled_from([None, 0.0, 0.9]),
           rendering=st.sampled_from(["", "", "", "<template v2>"]))
    def conversation(first: list[dict[str, Any]], conversation: str | None, header_id: bool,
                     streams: list[bool], forms: list[str], corruptions: list[Corruption],
                     temperature: float | None, rendering: str) -> None:
        """Three turns; P's chat template changes to ``rendering`` after the first."""
        harness.conv.cluster.preamble = ""
        hdrs = [auth, ctype]
        base: dict[str, Any] = {"model": "mock", "max_tokens": 6}
        if temperature is not None:
            base["temperature"] = temperature
        if conversation is not None and header_id:
            hdrs.append((b"x-session-id", conversation.encode()))
        elif conversation is not None:
            base["conversation_id"] = conversation
        messages = [SYSTEM, *first, {"role": "user", "content": "start"}]
        for turn in range(3):
            body = {**base, "messages": messages, "stream": streams[turn]}
            answer = harness.request("POST", "/v1/chat/completions", hdrs, encode(body),
                                     rig=harness.conv)
            if answer.status != 200 or turn == 2:
                return
            harness.deliver(corruptions[turn])
            harness.conv.cluster.preamble = rendering
            text = answer_text(answer, streams[turn])
            messages = [*resent(messages, text, forms[turn]),
                        {"role": "user", "content": f"next {turn}"}]

    @opts
    @given(report=json_values | st.fixed_dictionaries(
               {"turn_id": scalars | st.text(max_size=40)},
               optional={"kv_transfer_params": json_values,
                         "num_prompt_tokens": st.integers(-2, 10**6) | scalars,
                         "num_output_tokens": st.integers(-2, 10**6) | scalars})
           | st.lists(json_values, max_size=70),
           method=st.sampled_from(["POST", "POST", "GET", "PUT"]),
           path=st.sampled_from(["/internal/kv-report", "/health", "/v1/chat/completions",
                                 "/internal/kv-report/x"]),
           raw=st.none() | raw_bodies)
    def reports(report: Any, method: str, path: str, raw: bytes | None) -> None:
        harness.request(method, path, [JSON_TYPE], raw if raw is not None else encode(report),
                        internal=True)

    return [chat, completions, anything, headers_and_bytes, conversation, reports, responses,
            messages_api]


def test_fuzzed_requests_never_get_a_5xx() -> None:
    harness = Harness()
    try:
        for i, examples in enumerate((2200, 1800, 3600, 2500, 500, 800, 700, 700)):
            fuzz(harness, examples)[i]()
        decisions = harness.conv.ctx.stats.snapshot()["by_reason"]
    finally:
        harness.close()
    assert harness.count >= 10_000, harness.count
    statuses = harness.statuses
    assert statuses.get(200, 0) > 100  # plenty of requests were routed end to end
    for status in (400, 401, 404, 405, 413):
        assert statuses.get(status, 0) > 0, statuses
    # the conversations reached every kind of decision the guard makes in tokenize mode
    for reason in ("no_entry", "pull", "prefix_mismatch"):
        assert decisions[reason] > 0, decisions
    for outcome in ("matched", "late", "unknown_turn", "invalid", "mismatch_engine",
                    "mismatch_tokens"):
        assert harness.report_outcomes.get(outcome, 0) > 0, harness.report_outcomes
