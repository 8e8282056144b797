"""Which conversation id a request has, and whether it is bound to one caller
(``router.request.IdRules``, issue #23 finding 2)."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.identity import scope_of
from kvrelay.router.config import ConfigError, RouterConfig, build_config
from kvrelay.router.request import IdRules, TurnRequest, parse_request

MESSAGES = [{"role": "user", "content": "hi"}]
RULES = IdRules(("x-session-id",), ("x-gw",))


def parse(rules: IdRules, headers: dict[str, str], **body: object) -> TurnRequest:
    raw = json.dumps({"model": "m", "messages": MESSAGES, **body}).encode()
    return parse_request("chat", raw, headers, "t", rules)


@pytest.mark.parametrize(("rules", "headers", "body", "scope"), [
    (RULES, {}, {"prompt_cache_key": "k"}, scope_of("t")),  # no id at all
    (RULES, {"x-session-id": "s"}, {}, scope_of("t", "s")),
    (RULES, {"x-session-id": "s"}, {"conversation_id": "b"}, scope_of("t", "b")),
    (RULES, {"x-gw": "g", "x-session-id": "s"}, {"conversation_id": "b"},
     scope_of("t", "g", bound=True)),
    (IdRules(("x-session-id",), ("x-gw",), "client"), {"x-gw": "g"},
     {"conversation_id": "b"}, scope_of("t", "b")),
    (IdRules(("x-session-id",), ("x-gw",), "client"), {"x-gw": "g"}, {},
     scope_of("t", "g", bound=True)),
    (IdRules(("x-session-id",), tenant_is_one_caller=True), {}, {"conversation_id": "b"},
     scope_of("t", "b", bound=True)),
])
def test_the_id_and_its_binding(
    rules: IdRules, headers: dict[str, str], body: dict[str, object], scope: bytes,
) -> None:
    req = parse(rules, headers, **body)
    assert req.identity.scope == scope
    bound = scope in (scope_of("t", "g", bound=True), scope_of("t", "b", bound=True))
    assert req.identity.explicit is bound  # only a bound id may continue its latest entry
    assert req.body.get("prompt_cache_key") == body.get("prompt_cache_key")  # forwarded


def test_id_settings_are_checked() -> None:
    base = {"prefill": ["http://p:1"], "decode": ["http://d:2"]}
    with pytest.raises(ConfigError, match="both"):
        build_config({**base, "gateway_id_headers": ["x-session-id"]})
    with pytest.raises(ConfigError, match="API keys"):
        build_config({**base, "tenant_is_one_caller": True})
    with pytest.raises(ConfigError, match="id_precedence"):
        build_config({**base, "id_precedence": "whoever"})
    cfg = build_config({**base, "gateway_id_headers": "X-Gw, x-user", "id_precedence": "client",
                        "tenant_is_one_caller": "yes", "api_keys": "a:K"})
    assert isinstance(cfg, RouterConfig)
    assert cfg.id_rules == IdRules(cfg.session_headers, ("x-gw", "x-user"), "client", True)


IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize(("endpoint", "body"), [
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": IMAGE}}]}]}),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}),
    # parts vLLM reads as media by their keys: no type, or a uuid whatever the type
    ("chat", {"messages": [{"role": "user", "content": [{"image_url": IMAGE}]}]}),
    ("chat", {"messages": [{"role": "user", "content": [
        {"video_url": {"url": "https://example.com/v.mp4"}}]}]}),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "uuid": "u1", "text": "x", "image_url": {"url": IMAGE}}]}]}),
    ("responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": IMAGE}]}]}),
    ("responses", {"input": [  # a tool's output as content parts
        {"type": "function_call", "call_id": "c", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": IMAGE}]}]}),
    ("messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [  # nested in a tool result
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]}]}),
])
def test_a_history_with_media_never_continues_a_bound_ids_latest_entry(
    endpoint: str, body: dict[str, object],
) -> None:
    """The engine renders equal-sized images as equal placeholder token ids, so the guard's
    token proof cannot tell image A's KV from image B's: a bound id's history that holds
    media continues only an entry its digests match (probe 5, finding 1)."""
    rules = IdRules(("x-session-id",), ("x-gw",))
    raw = json.dumps({"model": "m", **body}).encode()
    req = parse_request(endpoint, raw, {"x-gw": "g"}, "t", rules)
    assert req.identity.scope == scope_of("t", "g", bound=True)
    assert req.identity.explicit is False
    text_only = json.dumps({"model": "m", "max_tokens": 8, "messages": MESSAGES}
                           if endpoint != "responses" else {"model": "m", "input": "hi"})
    assert parse_request(endpoint, text_only.encode(), {"x-gw": "g"}, "t",
                         rules).identity.explicit is True
