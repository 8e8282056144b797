"""Failure handling against a scripted mock cluster: retries, error translation (messages
name the role that failed, never a node), mid-stream errors, and bad client input (always a
4xx OpenAI error, never a 500)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvrelay.client.sse import sse_events
from kvrelay.core.consequences import ANSWERED_READ_GRACE_S, SPENT_READ_GRACE_S
from tests.component.router_mock import MockCluster
from tests.component.router_rig import Chat, Rig, assert_no_internal_fields

LONG = "a question that is long enough to pull " + "y" * 60


def assert_openai_error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if status >= 500:  # the router's own words (a node's 4xx passes through as it is)
        assert_names_no_node(err["message"])
    return dict(err)


def assert_names_no_node(message: str) -> None:
    for secret in ("prefill-", "decode-", ".test", "http", "engine-", "Error("):
        assert secret not in message, message


def assert_not_the_nodes_fault(rig: Rig, node_id: str) -> None:
    """A node's 4xx is the client's fault: not an upstream error, the node stays up."""
    state = rig.ctx.nodes.state(node_id)
    assert state is not None and state.up
    assert "upstream_errors_total{" not in rig.ctx.metrics.render().decode()
    admin = rig.ctx.nodes.describe(admin=True)
    assert [n["last_error"] for n in admin if n["id"] == node_id] == [None]


async def make(num_prefill: int = 1, num_decode: int = 1, **settings: Any) -> Rig:
    return Rig(MockCluster(num_prefill, num_decode), settings)


# -- P failures ---------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["connect", ("status", 503)])
async def test_a_pull_p_never_received_is_the_same_pull_on_another_p(fault: Any) -> None:
    """P refused the connection (or answered 503: nothing scheduled): D's blocks are
    untouched, so the other P pulls them."""
    rig = await make(num_prefill=2)
    try:
        chat = Chat(rig, "c")
        await chat.turn(LONG)  # turn 1 on the least loaded P: prefill-0
        p0, p1 = rig.cluster.node("prefill-0"), rig.cluster.node("prefill-1")
        p0.faults.append(fault)
        resp, _ = await chat.turn("next")
        assert resp.status_code == 200
        last = await rig.last_decision()
        assert (last["action"], last["reason"], last["retries"]) == ("pull", "pull", 1)
        assert last["prefill_node"] == "prefill-1"
        sent0 = p0.generation_requests()[-1]["kv_transfer_params"]
        sent1 = p1.generation_requests()[-1]["kv_transfer_params"]
        assert sent1["remote_block_ids"] and sent1 == sent0  # the same pull
        assert len(rig.cluster.reads) == 1 and rig.cluster.reads[0].correct
        assert int(resp.headers["x-kvrelay-reused-tokens"]) == rig.cluster.reads[0].num_tokens
        entry = await chat.entry()
        assert entry is not None and entry.turn == 2 and len(rig.ctx.index) == 1
        assert rig.ctx.nodes.state("prefill-0").up is (fault != "connect")  # type: ignore[union-attr]
    finally:
        await rig.close()


@pytest.mark.parametrize("fault", ["timeout", "reset", ("status", 500)])
async def test_a_pull_p_may_have_read_is_recomputed_on_another_p(fault: Any) -> None:
    """P got the pull and failed: it may have read D's blocks (which frees them), so the
    entry stays spent and the other P recomputes (``prefill_failed``)."""
    rig = await make(num_prefill=2)
    try:
        chat = Chat(rig, "c")
        await chat.turn(LONG)
        first = await chat.entry()
        assert first is not None
        p0, p1 = rig.cluster.node("prefill-0"), rig.cluster.node("prefill-1")
        p0.faults.append(fault)
        resp, _ = await chat.turn("next")
        assert resp.status_code == 200
        last = await rig.last_decision()
        assert (last["action"], last["reason"], last["decided"]) == (
            "recompute", "prefill_failed", "pull/pull")
        assert (last["retries"], last["prefill_node"], last["reused_tokens"]) == (
            1, "prefill-1", 0)
        assert resp.headers["x-kvrelay-reused-tokens"] == "0"
        assert p0.generation_requests()[-1]["kv_transfer_params"]["remote_block_ids"]
        assert p1.generation_requests()[-1]["kv_transfer_params"] == {"do_remote_decode": True}
        # the pull's entry stays consumed; the retried turn left a new one
        entry = await chat.entry()
        assert entry is not None and entry.turn == 2 and len(rig.ctx.index) == 1
        assert rig.ctx.metrics.retries.labels("prefill")._value.get() == 1
        # the failed pull's read of turn 1 stays open for the grace, then D may free it
        # (it stayed open for good: D's asks under pressure waited for D's TTL)
        # (P answered: 1 s; no answer: 10 s, until P has surely aborted the request)
        grace_s = ANSWERED_READ_GRACE_S if isinstance(fault, tuple) else SPENT_READ_GRACE_S
        asked = (first.decode_node_id, first.decode_engine_id, [first.request_id])
        rig.clock.advance(grace_s - 0.1)
        assert await rig.ctx.index.release_requested(*asked) == ()
        rig.clock.advance(0.2)
        assert await rig.ctx.index.release_requested(*asked) == (first.request_id,)
    finally:
        await rig.close()


async def test_single_p_failure_retries_same_p_once() -> None:
    rig = await make()
    try:
        p0 = rig.cluster.node("prefill-0")
        p0.faults.append(("status", 503))
        resp, _ = await Chat(rig, "c").turn(LONG)
        assert resp.status_code == 200
        assert len(p0.generation_requests()) == 2
        assert rig.ctx.metrics.retries.labels("prefill")._value.get() == 1
    finally:
        await rig.close()


@pytest.mark.parametrize(
    ("fault", "status", "message"),
    [(("status", 500), 502, "the prefill node failed"),
     (("status", 503), 503, "the prefill node is at capacity; retry later"),
     ("connect", 503, "the prefill node is unreachable"),
     ("timeout", 504, "the prefill node timed out"),
     ("bad_json", 502, "the prefill node sent an invalid response"),
     ("reset", 502, "the prefill node closed the connection")],
)
async def test_p_failing_twice_is_an_openai_error(fault: Any, status: int, message: str) -> None:
    rig = await make()
    try:
        rig.cluster.node("prefill-0").faults.extend([fault, fault])
        resp, _ = await Chat(rig, "c").turn(LONG)
        assert assert_openai_error(resp, status)["message"] == message
        assert resp.headers.get("retry-after") == ("1" if status == 503 else None)
        assert len(rig.cluster.node("decode-0").generation_requests()) == 0
        assert (await rig.last_decision())["outcome"] == f"error_{status}"
    finally:
        await rig.close()


async def test_p_4xx_is_passed_through_without_retry() -> None:
    rig = await make(num_prefill=2)
    try:
        rig.cluster.node("prefill-0").faults.append(("status", 400))
        resp, _ = await Chat(rig, None).turn(LONG)
        err = assert_openai_error(resp, 400)
        assert err["message"] == "mock error 400"
        assert len(rig.cluster.node("prefill-0").generation_requests()) == 1
        assert len(rig.cluster.node("prefill-1").generation_requests()) == 0
        assert_not_the_nodes_fault(rig, "prefill-0")
    finally:
        await rig.close()


async def test_unknown_model_404_passed_through() -> None:
    rig = await make()
    try:
        resp = await rig.post("/v1/chat/completions", {
            "model": "missing", "messages": [{"role": "user", "content": "hi"}]})
        err = assert_openai_error(resp, 404)
        assert err["param"] == "model" and "does not exist" in err["message"]
    finally:
        await rig.close()


async def test_no_prefill_up_is_503() -> None:
    rig = await make()
    try:
        await rig.ctx.nodes.mark_down("prefill-0", "test")
        assert_openai_error((await Chat(rig, "c").turn(LONG))[0], 503)
    finally:
        await rig.close()


# -- D failures before the first byte -----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fault", ["connect", ("status", 503)])
async def test_d_failure_before_start_reuses_p_params_on_other_d(
    fault: Any, stream: bool
) -> None:
    rig = await make(num_decode=2)
    try:
        d0, d1 = rig.cluster.node("decode-0"), rig.cluster.node("decode-1")
        d0.faults.append(fault)
        resp, text = await Chat(rig, "c", stream=stream).turn(LONG)
        assert resp.status_code == 200 and len(text) == 8
        assert len(rig.cluster.node("prefill-0").generation_requests()) == 1
        sent0 = d0.generation_requests()[0]["kv_transfer_params"]
        sent1 = d1.generation_requests()[0]["kv_transfer_params"]
        assert sent0["remote_request_id"] == sent1["remote_request_id"]  # same P params
        if stream:  # each D request has its own turn id (bound to that D)
            assert sent0["kvrelay_turn_id"] != sent1["kvrelay_turn_id"]
        else:  # non-streamed answers carry D's params: no report asked
            assert "kvrelay_turn_id" not in sent0 and "kvrelay_turn_id" not in sent1
        last = await rig.last_decision()
        assert (last["decode_node"], last["retries"]) == ("decode-1", 1)
        kind = "connect" if fault == "connect" else "capacity"  # HTTP 503: at capacity
        errors = rig.ctx.metrics.upstream_errors.labels("decode-0", kind)._value.get()
        assert errors == 1
        await rig.settle()
        entry = await Chat(rig, "c", messages=[
            {"role": "user", "content": LONG}, {"role": "assistant", "content": text}]).entry()
        assert entry is not None and entry.decode_node_id == "decode-1"
        assert rig.cluster.report_results == ([{"outcome": "matched"}] if stream else [])
    finally:
        await rig.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fault", ["timeout", "reset"])
async def test_d_failure_after_send_prefills_again(fault: str, stream: bool) -> None:
    """D may have read P's blocks: P's params are spent, so P computes the turn again."""
    rig = await make(num_decode=2)
    try:
        rig.cluster.node("decode-0").faults.append(fault)
        resp, _ = await Chat(rig, "c", stream=stream).turn(LONG)
        assert resp.status_code == 200
        p_bodies = rig.cluster.node("prefill-0").generation_requests()
        assert len(p_bodies) == 2
        sent1 = rig.cluster.node("decode-1").generation_requests()[0]["kv_transfer_params"]
        sent0 = rig.cluster.node("decode-0").generation_requests()[0]["kv_transfer_params"]
        assert sent0["remote_request_id"] != sent1["remote_request_id"]
    finally:
        await rig.close()


@pytest.mark.parametrize("conversation_id", ["c", None])
@pytest.mark.parametrize("fault", ["timeout", "reset", ("status", 500)])
async def test_d_failure_after_a_pull_recomputes_and_never_reads_d_again(
    fault: Any, conversation_id: str | None
) -> None:
    """Turn 2 pulled turn 1's KV from D0 into P, then D0 failed after receiving P's params:
    P computes the turn afresh for D1; D0's old blocks are never read a second time."""
    rig = await make(num_decode=2)
    try:
        chat = Chat(rig, conversation_id)
        await chat.turn(LONG)
        held = await chat.entry()
        assert held is not None
        d0 = rig.cluster.node(held.decode_node_id)  # turn 2 goes back to it (affinity)
        d0.faults.append(fault)
        resp, _ = await chat.turn("next")
        assert resp.status_code == 200
        last = await rig.last_decision()
        # decided as a pull, carried out as a recompute: reported as that (probe 14, K7)
        assert (last["decided"], last["action"], last["reason"], last["retries"]) == (
            "pull/pull", "recompute", "decode_failed", 1)
        assert last["decode_node"] != d0.node_id and last["reused_tokens"] == 0
        p_params = [b["kv_transfer_params"]
                    for b in rig.cluster.node("prefill-0").generation_requests()]
        assert p_params[1]["remote_block_ids"]  # the pull
        assert p_params[2] == {"do_remote_decode": True}  # then a recompute
        assert len(rig.cluster.reads) == 1
        assert not rig.cluster.double_reads and not rig.cluster.wrong_reuses
        entry = await chat.entry()
        assert entry is not None and entry.decode_node_id == last["decode_node"]
    finally:
        await rig.close()


async def test_streamed_d_dying_before_first_event_is_retried() -> None:
    rig = await make(num_decode=2)
    try:
        rig.cluster.node("decode-0").faults.append(("die_after", 0))
        resp = await rig.post("/v1/completions", {
            "prompt": LONG, "max_tokens": 8, "stream": True, "conversation_id": "c"})
        events = sse_events(resp.text)
        assert resp.status_code == 200 and events[-1] == "[DONE]"
        assert all("error" not in e for e in events if isinstance(e, dict))
        assert (await rig.last_decision())["decode_node"] == "decode-1"
    finally:
        await rig.close()


@pytest.mark.parametrize(
    ("fault", "status", "message"),
    [("connect", 503, "the decode node is unreachable"),
     (("status", 500), 502, "the decode node failed"),
     (("status", 503), 503, "the decode node is at capacity; retry later"),
     ("timeout", 504, "the decode node timed out")],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_single_d_failure_is_an_openai_error(
    fault: Any, status: int, message: str, stream: bool
) -> None:
    rig = await make()
    try:
        rig.cluster.node("decode-0").faults.append(fault)
        resp, _ = await Chat(rig, "c", stream=stream).turn(LONG)
        assert assert_openai_error(resp, status)["message"] == message
        assert resp.headers.get("retry-after") == ("1" if status == 503 else None)
        assert len(rig.ctx.desk) == 0 and len(rig.ctx.index) == 0
        assert (await rig.last_decision())["outcome"] == f"error_{status}"
    finally:
        await rig.close()


async def test_d_4xx_passed_through() -> None:
    rig = await make(num_decode=2)
    try:
        rig.cluster.node("decode-0").faults.append(("status", 422))
        resp, _ = await Chat(rig, "c").turn(LONG)
        assert assert_openai_error(resp, 422)["message"] == "mock error 422"
        assert len(rig.cluster.node("decode-1").generation_requests()) == 0
        assert_not_the_nodes_fault(rig, "decode-0")
    finally:
        await rig.close()


# -- D failures mid-stream ----------------------------------------------------------------


async def test_d_dying_mid_stream_ends_with_error_event_and_drops_entry() -> None:
    rig = await make(num_decode=2)
    try:
        chat = Chat(rig, "c", stream=True)
        await chat.turn(LONG)
        await rig.settle()
        assert len(rig.ctx.index) == 1
        rig.cluster.node("decode-0").faults.append(("die_after", 3))
        rig.cluster.node("decode-1").faults.append(("die_after", 3))
        resp, _ = await chat.turn("next")
        events = sse_events(resp.text)
        assert resp.status_code == 200
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == 502 and set(err) == {"message", "type", "param", "code"}
        assert err["message"] == "the decode node failed mid-stream"
        assert sum(1 for e in events[:-2] if e["choices"][0].get("delta", {}).get("content")) \
            == 3
        assert_no_internal_fields(events)
        # the pull spent turn 1's entry; the failed turn left none
        assert len(rig.ctx.index) == 0 and len(rig.ctx.desk) == 0
        assert (await rig.last_decision())["outcome"] == "failed_mid_stream"
        assert len(rig.cluster.reads) == 1 and not rig.cluster.wrong_reuses
    finally:
        await rig.close()


async def test_d_error_event_passed_through_and_no_entry() -> None:
    rig = await make()
    try:
        rig.cluster.node("decode-0").faults.append("error_event")
        resp, _ = await Chat(rig, "c", stream=True).turn(LONG)
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
        await rig.settle()
        assert len(rig.ctx.index) == 0 and len(rig.ctx.desk) == 0
        assert (await rig.last_decision())["outcome"] == "error_event"
        assert rig.ctx.metrics.upstream_errors.labels("decode-0", "error_event")._value.get() \
            == 1
    finally:
        await rig.close()


# -- client input -------------------------------------------------------------------------

BAD_BODIES: list[tuple[str, Any, str | None]] = [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", b"\xff\xfe", None),
    ("/v1/chat/completions", [1, 2], None),
    ("/v1/chat/completions", "just a string", None),
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": "5"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "conversation_id": 7}, "conversation_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "conversation_id": ""}, "conversation_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "model": 3}, "model"),
    ("/v1/completions", {"model": "m"}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": {"x": 1}}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": 3}, "stream_options"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
async def test_bad_client_input_is_400(path: str, body: Any, param: str | None) -> None:
    rig = await make()
    try:
        resp = await rig.post(path, body if isinstance(body, bytes) else json.dumps(body),
                              headers={"content-type": "application/json"})
        err = assert_openai_error(resp, 400)
        assert err["param"] == param
        assert err["type"] == "BadRequestError" and err["code"] == 400
        assert not rig.cluster.node("prefill-0").requests  # nothing reached a node
    finally:
        await rig.close()


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "float", "str", "list", "dict"]
    kind = rng.choice(kinds if depth < 3 else kinds[:5])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 2**40])
    if kind == "float":
        return rng.choice([0.5, -2.0, 1e30])
    if kind == "str":
        return rng.choice(["", "x", "user", "\u00e9\u4e2d", "[DONE]"])
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["messages", "prompt", "model", "stream", "max_tokens", "n", "conversation_id",
            "role", "content", "stream_options", "return_token_ids", "tools"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def _mutated_body(rng: random.Random, chat: bool) -> Any:
    """A valid body with one to three fields replaced, removed or added at random."""
    body: dict[str, Any] = (
        {"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        if chat else {"model": "mock", "prompt": "hello", "max_tokens": 4}
    )
    if rng.random() < 0.5:
        body["conversation_id"] = "fuzz"
    keys = ["messages", "prompt", "model", "stream", "max_tokens", "n", "conversation_id",
            "stream_options", "return_token_ids", "tools", "max_completion_tokens"]
    for _ in range(rng.randrange(4)):
        action = rng.random()
        if action < 0.2 and body:
            body.pop(rng.choice(sorted(body)))
        elif action < 0.4 and chat:
            body["messages"] = [rng.choice([_random_json(rng), {"role": _random_json(rng)},
                                            {"role": "user", "content": _random_json(rng)}])]
        else:
            body[rng.choice(keys)] = _random_json(rng)
    return body if rng.random() < 0.95 else _random_json(rng)


async def test_fuzzed_client_bodies_never_get_a_500() -> None:
    rig = await make()
    rng = random.Random(1234)
    p0 = rig.cluster.node("prefill-0")
    try:
        outcomes: set[tuple[int, bool]] = set()
        for i in range(400):
            p0.requests.clear()
            chat = i % 2 == 0
            body = _mutated_body(rng, chat)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            resp = await rig.post(path, json.dumps(body))
            assert resp.status_code < 500, (body, resp.text)
            if resp.status_code >= 400:
                assert_openai_error(resp, resp.status_code)
            outcomes.add((resp.status_code, bool(p0.requests)))
        # router-side 400s, node-side 400s passed through, and successes all happened
        assert {(400, False), (400, True), (200, True)} <= outcomes, outcomes
    finally:
        await rig.close()
