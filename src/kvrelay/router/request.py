"""A client's request: validated, identified by digests, and the API adapter that shapes it.

``parse_request`` turns the bytes of a request to one of the router's APIs into a
``TurnRequest`` or raises ``ClientError`` (400): bad input never reaches a node or crashes
the router. What every API shares is checked here: strict JSON (``apis.fields.load_json``),
a JSON object, no client ``kv_transfer_params`` (it would let a client make P read arbitrary
blocks), the conversation id. The rest is the API's adapter (``router.apis``): it reads the
body into one canonical history, which ``core.identity.identify`` digests in one call.

Conversation identity (``core.identity``): every request is identified by digests of its
canonical history within a scope; an explicit id narrows the scope: the body's
``conversation_id`` (removed before forwarding), else the first configured session header
present, else the API's own hint in the body (OpenAI's ``prompt_cache_key``, kept in the
body; Anthropic's ``metadata.user_id`` session).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from kvrelay.core.conversation import conversation_tag
from kvrelay.core.identity import RequestIdentity, identify, scope_of
from kvrelay.router.apis import ADAPTERS
from kvrelay.router.apis.base import ApiAdapter, ApiRequest
from kvrelay.router.apis.fields import JsonObject, check_id, encode, load_json
from kvrelay.router.errors import ClientError
from kvrelay.router.request_limits import RequestLimits

Endpoint = Literal["chat", "completions", "responses", "messages"]
PATHS: Mapping[str, str] = {name: a.path for name, a in ADAPTERS.items()}

__all__ = ["PATHS", "Endpoint", "TurnRequest", "encode", "parse_request", "tokenize_body"]


class TurnRequest(msgspec.Struct, frozen=True):
    """A validated client turn.

    ``body`` is what gets forwarded (no ``conversation_id``); ``api`` what its adapter read
    from it. ``conversation`` is the explicit id's tag, ``None`` when the client sent none
    (the tag then comes from the entry continued).
    """

    endpoint: str
    body: JsonObject
    tenant: str
    identity: RequestIdentity
    conversation: str | None
    api: ApiRequest

    @property
    def adapter(self) -> ApiAdapter:
        return ADAPTERS[self.endpoint]

    @property
    def path(self) -> str:
        return self.adapter.path

    @property
    def stream(self) -> bool:
        return self.api.stream

    @property
    def include_usage(self) -> bool:
        return self.api.include_usage

    @property
    def wants_token_ids(self) -> bool:
        return self.api.wants_token_ids

    @property
    def max_output_tokens(self) -> int | None:
        return self.api.max_output_tokens

    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None:
        return self.api.prompt_token_ids

    @property
    def num_bytes(self) -> int:
        """The size of what the identity hashed (for token estimates)."""
        return self.identity.prompt_bytes


def parse_request(
    endpoint: str,
    raw: bytes,
    headers: Mapping[str, str],
    tenant: str,
    session_headers: Sequence[str],
    limits: RequestLimits | None = None,
) -> TurnRequest:
    """Validate a client request (module docstring); ``ClientError`` if invalid, or if it
    carries more than ``limits`` allow (checked before anything is digested)."""
    adapter = ADAPTERS[endpoint]
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
        conversation_id = next((headers[h] for h in session_headers if headers.get(h)), None)
    if conversation_id is None:
        conversation_id = adapter.conversation_hint(body, headers)
    if conversation_id is not None:
        check_id(conversation_id)
    api = adapter.parse(body)
    scope = scope_of(tenant, conversation_id)
    return TurnRequest(
        endpoint=endpoint,
        body=body,
        tenant=tenant,
        identity=identify(scope, api.history, explicit=conversation_id is not None),
        conversation=(
            conversation_tag(tenant.encode("utf-8"), conversation_id.encode("utf-8"))
            if conversation_id is not None else None
        ),
        api=api,
    )


def tokenize_body(req: TurnRequest) -> JsonObject | None:
    """The ``/tokenize`` body giving the prompt's exact engine token ids (chat template
    included); ``None`` when the client sent token ids already or the API has none."""
    return req.adapter.tokenize_body(req.body, req.api)
