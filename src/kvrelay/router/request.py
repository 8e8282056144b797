"""A client's request: validated, identified by digests, and the API adapter that shapes it.

``parse_request`` turns the bytes of a request to one of the router's APIs into a
``TurnRequest`` or raises ``ClientError`` (400): bad input never reaches a node or crashes
the router. What every API shares is checked here: strict JSON (``apis.fields.load_json``),
a JSON object, no client ``kv_transfer_params`` (it would let a client make P read arbitrary
blocks), the conversation id. The rest is the API's adapter (``router.apis``): it reads the
body into one canonical history, which ``core.identity.identify`` digests in one call.

Conversation identity (``core.identity``): every request is identified by digests of its
canonical history within a scope. The end user (OpenAI's ``user``, Anthropic's
``metadata.user_id``: the adapter's ``end_user``), OpenAI's ``safety_identifier`` and vLLM's
``cache_salt`` narrow the scope and are forwarded to P and D unchanged (vLLM hashes
``cache_salt`` into its own prefix-cache keys); an explicit id narrows it further
(``IdRules``): the body's ``conversation_id`` (removed before forwarding), else the first
configured session header present, else the API's own hint (the session inside Anthropic's
``metadata.user_id``); a gateway header wins over all of them unless ``precedence`` is
``client``. Only an id *bound* to one caller (from a gateway header, or of a tenant
configured as one caller) may continue its scope's latest entry when no digest matches
(``RequestIdentity.explicit``): any other id can be sent by anyone, and the guard's proven
length would tell them how much of another's conversation matches a guess. OpenAI's
``prompt_cache_key`` is no conversation id (clients share one across requests with a common
prefix): it is forwarded and otherwise ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from kvrelay.core.identity import RequestIdentity, identify, scope_of
from kvrelay.router.apis import ADAPTERS
from kvrelay.router.apis.base import ApiAdapter, ApiRequest
from kvrelay.router.apis.fields import (
    JsonObject,
    carries_media,
    check_id,
    encode,
    load_json,
    optional,
)
from kvrelay.router.errors import ClientError
from kvrelay.router.request_limits import RequestLimits
from kvrelay.router.response_keeper import KeptResponse

Endpoint = Literal["chat", "completions", "responses", "messages"]
PATHS: Mapping[str, str] = {name: a.path for name, a in ADAPTERS.items()}

__all__ = ["PATHS", "Endpoint", "TurnRequest", "encode", "load_body", "parse_request",
           "request_from_body", "tokenize_body"]


class TurnRequest(msgspec.Struct, frozen=True):
    """A validated client turn.

    ``body`` is what gets forwarded (no ``conversation_id``); ``api`` what its adapter read
    from it. ``has_id``: the request named its conversation (its tag is then its scope's,
    ``core.conversation.id_tag``; without one it comes from the entry continued).
    ``kept``: what the Responses store does with this turn's response (``None``: nothing).
    """

    endpoint: str
    body: JsonObject
    tenant: str
    identity: RequestIdentity
    has_id: bool
    api: ApiRequest
    kept: KeptResponse | None = None

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
    endpoint: str,
    raw: bytes,
    headers: Mapping[str, str],
    tenant: str,
    rules: IdRules,
    limits: RequestLimits | None = None,
) -> TurnRequest:
    """Validate a client request (module docstring); ``ClientError`` if invalid, or if it
    carries more than ``limits`` allow (checked before anything is digested)."""
    return request_from_body(endpoint, load_body(raw, limits), headers, tenant, rules)


PARSE_INLINE_BYTES = 64 * 1024
"""Bodies up to this are parsed on the event loop (well under a millisecond; a thread hop
would cost more); larger ones in a worker thread, so the event loop keeps serving other
clients meanwhile (the interpreter switches threads every few ms) instead of stalling for
the whole parse."""


def load_body(raw: bytes, limits: RequestLimits | None = None) -> JsonObject:
    """A request body as a JSON object, within ``limits``; ``ClientError`` if not."""
    body = load_json(raw, limits)
    if not isinstance(body, dict):
        raise ClientError("The request body must be a JSON object")
    return body


def request_from_body(
    endpoint: str,
    body: JsonObject,
    headers: Mapping[str, str],
    tenant: str,
    rules: IdRules,
) -> TurnRequest:
    """``parse_request`` on a body already loaded (``load_body``); it is forwarded, so it is
    changed in place (``conversation_id`` taken out)."""
    adapter = ADAPTERS[endpoint]
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
    if conversation_id is None:
        conversation_id = adapter.conversation_hint(body, headers)
    gateway_id = next((headers[h] for h in rules.gateway_headers if headers.get(h)), None)
    bound = conversation_id is not None and rules.tenant_is_one_caller
    if gateway_id is not None and (conversation_id is None or rules.precedence == "gateway"):
        conversation_id, bound = gateway_id, True
    if conversation_id is not None:
        check_id(conversation_id)
    user = adapter.end_user(body)
    safety_identifier, cache_salt = (
        optional(body, name, str) for name in ("safety_identifier", "cache_salt"))
    api = adapter.parse(body)
    scope = scope_of(tenant, conversation_id, bound=bound, user=user,
                     safety_identifier=safety_identifier, cache_salt=cache_salt)
    return TurnRequest(
        endpoint=endpoint,
        body=body,
        tenant=tenant,
        identity=identify(scope, api.history, explicit=bound and not carries_media(body)),
        has_id=conversation_id is not None,
        api=api,
    )


def tokenize_body(req: TurnRequest) -> JsonObject | None:
    """The ``/tokenize`` body giving the prompt's exact engine token ids (chat template
    included); ``None`` when the client sent token ids already or the API has none."""
    return req.adapter.tokenize_body(req.body, req.api)
