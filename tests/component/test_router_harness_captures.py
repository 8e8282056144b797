"""What Codex CLI and Claude Code really send, replayed through the router in front of fake
vLLM P/D engines: every follow-up turn pulls, with the harness's session ids and without.

``tests/data/harness/*_session.json`` are trimmed captures of three-turn sessions
(``scripts/harness_proxy.py`` in front of the router; each file's ``how`` says how they
were made). A turn re-sends the answers of the turns before it as the harness received
them; the replay's fake D answers differently from the capture's (the prompts were
trimmed), so each captured answer is replaced by the replay's answer of that turn before
the turn is sent, exactly where the harness put it. What the captures exercise:

* Codex: ``namespace`` and ``web_search`` tools among its function tools, ``developer``
  items, ``session-id`` / ``thread-id`` headers and ``prompt_cache_key``;
* Claude Code: a ``system`` message inside ``messages``, the ``x-anthropic-billing-header``
  text in ``system`` (its ``cc_version`` suffix differs between sessions; vLLM leaves it
  out of the prompt; the replay gives every turn a new one), ``cache_control`` markers that
  move, a user
  message sent as one text block on one turn and as a plain string on the next,
  ``metadata.user_id`` holding the session, ``POST /v1/messages?beta=true``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvrelay.client.prometheus import external_kv_tokens, parse_prometheus
from tests.component.router_fake import ENGINE_CONFIG, routed
from tests.component.router_rig import walk_keys

HARNESS = Path(__file__).parents[1] / "data" / "harness"
SESSIONS = {"codex": "codex_session.json", "claude_code": "claude_code_session.json"}
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{:03x}; cc_entrypoint=sdk-cli;"
SESSION_HEADERS = ("session-id", "thread-id", "x-claude-code-session-id")


def load(name: str) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = json.loads((HARNESS / SESSIONS[name]).read_text())["turns"]
    return turns


def substitute(value: Any, answers: dict[str, str]) -> Any:
    """``value`` with every string that is a captured answer replaced by the replay's."""
    if isinstance(value, str):
        return answers.get(value, value)
    if isinstance(value, list):
        return [substitute(v, answers) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, answers) for k, v in value.items()}
    return value


def streamed_answer(text: str) -> tuple[str, dict[str, Any]]:
    """The answer text and the final usage of a Responses or Messages stream."""
    parts: list[str] = []
    usage: dict[str, Any] = {}
    for block in text.split("\n\n"):
        _, _, data = block.partition("data: ")
        if not data:
            continue
        event = json.loads(data)
        kind = event.get("type")
        if kind == "response.output_text.delta":
            parts.append(event["delta"])
        elif kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
            parts.append(event["delta"]["text"])
        elif kind == "response.completed":
            usage = event["response"]["usage"]
        elif kind == "message_delta":
            usage = event["usage"]
    return "".join(parts), usage


def cached_tokens(usage: dict[str, Any]) -> int:
    if "input_tokens_details" in usage:
        return int(usage["input_tokens_details"]["cached_tokens"])
    return int(usage["cache_read_input_tokens"])


def without_ids(turn: dict[str, Any]) -> dict[str, Any]:
    """The turn with none of the harness's session ids: no session headers, no
    ``prompt_cache_key``, no ``metadata``."""
    headers = {k: v for k, v in turn["headers"].items() if k not in SESSION_HEADERS}
    body = {k: v for k, v in turn["body"].items() if k not in ("prompt_cache_key", "metadata")}
    return {**turn, "headers": headers, "body": body}


@pytest.mark.parametrize("with_ids", [True, False])
@pytest.mark.parametrize("name", list(SESSIONS))
async def test_a_captured_harness_session_pulls_on_every_follow_up(
    name: str, with_ids: bool
) -> None:
    turns = load(name)
    assert len(turns) == 3
    config = replace(ENGINE_CONFIG, max_model_len=131072)
    async with routed(engine_config=config) as r:
        p = r.cluster.prefill[0]
        answers: dict[str, str] = {}
        async with r.client() as c:
            for number, captured in enumerate(turns):
                turn = captured if with_ids else without_ids(captured)
                body = substitute(turn["body"], answers)
                if isinstance(body.get("system"), list):
                    body["system"][0]["text"] = BILLING.format(number)
                resp = await c.post(turn["path"], json=body, headers=turn["headers"])
                assert resp.status_code == 200, resp.text
                assert "kv_transfer_params" not in resp.text and "kvrelay_" not in resp.text
                text, usage = streamed_answer(resp.text)
                assert text
                answers[captured["answer"]] = text
                decision = await r.last_decision()
                if number == 0:
                    assert decision["reason"] == "no_entry"
                    assert cached_tokens(usage) == 0
                else:
                    assert decision["reason"] == "pull", decision
                    assert p.records[-1].pulled_tokens == decision["reused_tokens"] > 0
                    assert p.records[-1].pulled_matches_prompt
                    assert cached_tokens(usage) == decision["reused_tokens"]
                await r.settle()
        decisions = (await r.stats())["decisions"]["recent"]
        assert len({x["key"] for x in decisions}) == 1
        metrics = parse_prometheus(p.metrics_text())
        assert external_kv_tokens(metrics) == sum(x["reused_tokens"] for x in decisions)


def test_the_captures_hold_what_the_harnesses_send() -> None:
    """The shapes the router must accept and see through (module docstring), so that the
    replay above exercises them; and no secret in the files."""
    codex = load("codex")
    kinds = {t["type"] for t in codex[0]["body"]["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    assert all(t["path"] == "/v1/responses" and t["headers"]["session-id"] for t in codex)
    claude = load("claude_code")
    assert all(t["path"] == "/v1/messages?beta=true" for t in claude)
    billing = [t["body"]["system"][0]["text"] for t in claude]
    assert all(b.startswith("x-anthropic-billing-header") for b in billing)
    assert any(m["role"] == "system" for m in claude[0]["body"]["messages"])
    second_user = [m["content"] for m in claude[2]["body"]["messages"] if m["role"] == "user"]
    first_send = [m["content"] for m in claude[1]["body"]["messages"] if m["role"] == "user"]
    assert isinstance(first_send[-1], list) and len(first_send[-1]) == 1
    assert second_user[1] == first_send[-1][0]["text"]  # one text block, then a string
    for turn in codex + claude:
        for key, value in walk_keys(turn):
            assert key.lower() not in ("authorization", "x-api-key", "cookie"), key
            assert not (isinstance(value, str) and value.startswith(("sk-", "Bearer "))), key


async def test_the_root_answers_claude_codes_probe() -> None:
    """Claude Code sends ``HEAD /`` before its first request: 200 without a body (and
    ``GET /`` says only that this is kvrelay's router); other methods are a 405."""
    async with routed() as r, r.client() as c:
        head = await c.head("/")
        assert head.status_code == 200 and head.content == b""
        get = await c.get("/")
        assert get.status_code == 200 and get.json() == {"object": "kvrelay.router"}
        post = await c.post("/", json={})
        assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
