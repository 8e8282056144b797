"""Client request validation and the bodies the router sends to P, D and ``/tokenize``.

``parse_turn`` turns a client request into a ``TurnRequest`` or raises ``ClientError`` (400):
it never lets bad input reach a node or crash the router. It checks only what the router
itself relies on (JSON object, ``messages``/``prompt`` shape, ``stream``, ``max_tokens``,
``n``, ``conversation_id``); everything else is forwarded for vLLM to judge.

Conversation identity, first found wins: body ``conversation_id`` (stripped before
forwarding), header ``X-Conversation-ID``, header ``X-Session-ID``. ``kv_transfer_params``
from a client is refused: it would let a client make P read arbitrary blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvrelay.core.conversation import ConversationKey
from kvrelay.router.errors import ClientError

Endpoint = Literal["chat", "completions"]
PATHS: Mapping[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

REPORT_URL_KEY = "kvrelay_report_url"
REPORT_TURN_KEY = "kvrelay_turn_id"
MAX_CONVERSATION_ID_BYTES = 256
ID_HEADERS = ("x-conversation-id", "x-session-id")

#: Chat fields that change what the chat template renders, copied to ``/tokenize``.
_TOKENIZE_CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
)


@dataclass(frozen=True)
class TurnRequest:
    """A validated client turn. ``body`` is what gets forwarded (no ``conversation_id``);
    ``prompt_token_ids`` is set when the client sent token ids as the prompt."""

    endpoint: Endpoint
    body: Mapping[str, Any]
    key: ConversationKey | None
    stream: bool
    wants_token_ids: bool
    prompt_token_ids: tuple[int, ...] | None
    approx_prompt_tokens: int

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]


def parse_turn(
    endpoint: Endpoint, raw: bytes, headers: Mapping[str, str], tenant: str
) -> TurnRequest:
    """Validate a client request (see the module docstring); ``ClientError`` if invalid."""
    body = load_json(raw)
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
        lowered = {k.lower(): v for k, v in headers.items()}
        conversation_id = next((lowered[h] for h in ID_HEADERS if lowered.get(h)), None)
    if conversation_id is not None:
        _check_id(conversation_id)
    _optional(body, "model", str)
    _optional(body, "stream", bool)
    _optional(body, "stream_options", dict)
    _optional(body, "return_token_ids", bool)
    for name in ("max_tokens", "max_completion_tokens"):
        value = _optional(body, name, int)
        if value is not None and value < 1:
            raise ClientError(f"{name} must be at least 1", name)
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise ClientError("n > 1 is not supported by the P/D router", "n")
    prompt_ids: tuple[int, ...] | None = None
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ClientError("messages must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise ClientError("every message must be an object", "messages")
        approx = len(raw) // 4 + 1
    else:
        prompt_ids, approx = _check_prompt(body, len(raw))
    return TurnRequest(
        endpoint=endpoint,
        body=body,
        key=ConversationKey(tenant, conversation_id) if conversation_id else None,
        stream=bool(body.get("stream")),
        wants_token_ids=bool(body.get("return_token_ids")),
        prompt_token_ids=prompt_ids,
        approx_prompt_tokens=approx,
    )


def tokenize_body(req: TurnRequest) -> dict[str, Any] | None:
    """The ``/tokenize`` body giving the prompt's exact engine token ids (chat template
    included); ``None`` when the client sent token ids already."""
    if req.prompt_token_ids is not None:
        return None
    if req.endpoint == "chat":
        return {k: req.body[k] for k in _TOKENIZE_CHAT_FIELDS if k in req.body}
    prompt = req.body["prompt"]
    out: dict[str, Any] = {"prompt": prompt[0] if isinstance(prompt, list) else prompt}
    for k in ("model", "add_special_tokens"):
        if k in req.body:
            out[k] = req.body[k]
    return out


def prefill_body(req: TurnRequest, kv_transfer_params: Mapping[str, object]) -> dict[str, Any]:
    """P's request: the client's body computing one token, not streamed, with params."""
    body = dict(req.body)
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("return_token_ids", None)
    body.pop("min_tokens", None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def decode_body(
    req: TurnRequest,
    kv_transfer_params: Mapping[str, object],
    *,
    report_url: str | None,
    turn_id: str | None,
) -> dict[str, Any]:
    """D's request: the client's body plus params, the report keys (inside the params, where
    kvrelay's connector reads them) and ``return_token_ids`` when an entry is wanted."""
    body = dict(req.body)
    params = dict(kv_transfer_params)
    if report_url is not None and turn_id is not None:
        params[REPORT_URL_KEY] = report_url
        params[REPORT_TURN_KEY] = turn_id
        body["return_token_ids"] = True
    body["kv_transfer_params"] = params
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def load_json(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no ``NaN``/``Infinity``, no lone surrogates (all of which would
    fail later, when the body is forwarded), bounded nesting; ``ClientError`` 400 if not."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ClientError("Invalid JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ClientError(f"Invalid JSON body: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ClientError("Invalid JSON body: unpaired UTF-16 surrogate") from None
        except RecursionError:
            raise ClientError("Invalid JSON body: nested too deeply") from None
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


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


def _check_prompt(body: Mapping[str, Any], raw_len: int) -> tuple[tuple[int, ...] | None, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ClientError("batched prompts are not supported by the P/D router", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ClientError("prompt must not be empty", "prompt")
        return None, raw_len // 4 + 1
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt), len(prompt)
    raise ClientError("prompt must be a string or a list of token ids", "prompt")
