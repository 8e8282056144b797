"""The Responses API with the router's response store on (``--response-store``): a
``previous_response_id`` expanded into the whole input before the turn is identified, and
``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``
(``router.input_items``).

**Expansion.** A request naming ``previous_response_id`` gets, as its ``input``, the stored
response's input items, then its output items, then the request's own input (a string input
is one user message), and loses ``previous_response_id``: P and D see a plain
whole-conversation request. The identity digests are taken over that expanded input, so it
is the same history the previous turn's entry was committed under, found id-free, and the
turn pulls as a re-sent history does. As OpenAI does, ``instructions`` and ``tools`` are the
request's own (not carried over).

**Bounded like a body.** The expanded request is what P and D receive and what the store
keeps next, so it is held to ``--max-body-bytes`` as a client's own body is: a stored
conversation plus the request larger than that is a 400 (``previous_response_id``), never a
body of any size built from a small request (nor a chain whose stored inputs grow without
bound).

**Keeping.** A request with ``store`` true or absent (OpenAI's default) gets a router-minted
id (``response_store.new_response_id``), sent to D as ``request_id``, and its response is
kept (``response_keeper.KeptResponse``) under the caller's tenant. ``store: false`` keeps
nothing.

**Misses.** An unknown, expired, deleted or another tenant's id is one answer whichever it
is (no oracle: the message does not say which): as ``previous_response_id``, OpenAI's 400
``previous_response_not_found`` (clients that read the code re-send the whole input); on
``/v1/responses/{id}``, a 404. A store that cannot answer is a 503. Without the store none
of this is routed: ``previous_response_id`` is the same 400 with a message saying the store
is off (``apis.responses``), and ``/v1/responses/{id}`` a 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

import msgspec

from kvrelay.router.asgi import Request, send_response
from kvrelay.router.auth import Authenticator
from kvrelay.router.errors import ClientError, RouterError, dumps
from kvrelay.router.input_items import listed_items, page, page_query
from kvrelay.router.request import (
    IdRules,
    TurnRequest,
    load_body,
    request_from_body,
)
from kvrelay.router.request_limits import RequestLimits
from kvrelay.router.response_keeper import KeptResponse
from kvrelay.router.response_store import (
    MAX_RESPONSE_ID_CHARS,
    ResponseStore,
    ResponseStoreUnavailable,
    StoredResponse,
    new_response_id,
)

RESPONSES_PREFIX = "/v1/responses/"
RESPONSE_ENDPOINT = "/v1/responses/{id}"
"""The ``endpoint`` label of ``GET`` / ``DELETE /v1/responses/{id}`` in ``requests_total``."""
INPUT_ITEMS = "input_items"
INPUT_ITEMS_ENDPOINT = "/v1/responses/{id}/input_items"
"""The ``endpoint`` label of ``GET /v1/responses/{id}/input_items`` (``router.input_items``)."""
NOT_FOUND = ("No response with this id is stored for this API key (unknown, expired or "
             "deleted)")
PREVIOUS = "previous_response_id"
PREVIOUS_NOT_FOUND = "previous_response_not_found"
"""OpenAI's 400 for a ``previous_response_id`` it does not hold: clients (Codex, gateways)
read this code and send the whole input instead."""
_DECODER = msgspec.json.Decoder()


class StoredResponses:
    """The response store's part of the Responses API for one router app (module
    docstring). ``inline_bytes``: larger bodies are parsed in a worker thread."""

    def __init__(
        self,
        store: ResponseStore,
        *,
        rules: IdRules,
        limits: RequestLimits,
        max_body_bytes: int,
        inline_bytes: int,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._rules = rules
        self._limits = limits
        self._max_body_bytes = max_body_bytes
        self._inline_bytes = inline_bytes
        self._on_error = on_error

    async def request(self, raw: bytes, headers: Mapping[str, str], tenant: str
                      ) -> TurnRequest:
        """A ``/v1/responses`` request, its ``previous_response_id`` expanded (module
        docstring); ``ClientError`` (400, 404) or ``RouterError`` (503)."""
        inline = len(raw) <= self._inline_bytes
        body = (load_body(raw, self._limits) if inline
                else await asyncio.to_thread(load_body, raw, self._limits))
        previous = body.pop("previous_response_id", None)
        if previous is not None and (not isinstance(previous, str) or not previous):
            raise ClientError("previous_response_id must be a non-empty string",
                              "previous_response_id")
        keep = body.get("store", True)
        if not isinstance(keep, bool):
            raise ClientError("store must be a boolean", "store")
        own = _input_items(body.get("input"), required=previous is None)
        items = own
        if previous is not None:
            stored = await self.get(tenant, previous, "previous_response_id")
            # an upper bound of the expanded body (the stored response's other fields too)
            expanded_bytes = stored.num_bytes + len(raw)
            if expanded_bytes > self._max_body_bytes:
                raise ClientError(
                    f"the conversation after previous_response_id is about {expanded_bytes} "
                    f"bytes, more than the router's body limit of {self._max_body_bytes} "
                    "bytes: start a new conversation", "previous_response_id")
            items = [*_stored_items(stored), *own]
            if len(items) > self._limits.max_messages:
                raise ClientError(
                    f"the conversation after previous_response_id has {len(items)} items, "
                    f"more than the router's limit of {self._limits.max_messages}", "input")
            body["input"] = items
        response_id = new_response_id() if keep else None
        if response_id is not None:
            body["request_id"] = response_id
        args = ("responses", body, headers, tenant, self._rules)
        req = (request_from_body(*args) if inline
               else await asyncio.to_thread(request_from_body, *args))
        if response_id is None and previous is None:
            return req
        kept = KeptResponse(store=self._store if keep else None, tenant=tenant,
                            response_id=response_id, previous_id=previous,
                            input_items=items, on_error=self._on_error)
        return msgspec.structs.replace(req, kept=kept)

    async def get(self, tenant: str, response_id: str, param: str | None) -> StoredResponse:
        """The tenant's stored response; ``ClientError`` 404 if there is none (module
        docstring), ``RouterError`` 503 if the store cannot answer."""
        stored = None
        if len(response_id) <= MAX_RESPONSE_ID_CHARS:
            try:
                stored = await self._store.get(tenant, response_id)
            except ResponseStoreUnavailable:
                raise RouterError(503, "the response store is unavailable") from None
        if stored is None and param == PREVIOUS:
            shown = f" '{response_id}'" if len(response_id) <= MAX_RESPONSE_ID_CHARS else ""
            raise ClientError(f"Previous response with id{shown} not found.", PREVIOUS,
                              code=PREVIOUS_NOT_FOUND)
        if stored is None:
            raise ClientError(NOT_FOUND, param, status=404)
        return stored

    async def input_items(self, tenant: str, response_id: str) -> list[dict[str, Any]]:
        """The tenant's stored response's input as listed (``router.input_items``); the
        same errors as ``get``."""
        stored = await self.get(tenant, response_id, None)
        if len(stored.input_json) <= self._inline_bytes:
            return listed_items(_input_list(stored))
        return await asyncio.to_thread(lambda: listed_items(_input_list(stored)))

    async def delete(self, tenant: str, response_id: str) -> None:
        """Forget the tenant's stored response; the same errors as ``get``."""
        deleted = False
        if len(response_id) <= MAX_RESPONSE_ID_CHARS:
            try:
                deleted = await self._store.delete(tenant, response_id)
            except ResponseStoreUnavailable:
                raise RouterError(503, "the response store is unavailable") from None
        if not deleted:
            raise ClientError(NOT_FOUND, status=404)


def _asks_stream(request: Request) -> bool:
    """``GET /v1/responses/{id}?stream=true`` (the SDK's ``retrieve(..., stream=True)``):
    answered with JSON, the SDK would read no events and say nothing."""
    query = parse_qs(request.scope.get("query_string", b"").decode("latin-1"))
    return any(v.strip().lower() not in ("", "false", "0") for v in query.get("stream", ()))


def _input_items(value: object, *, required: bool) -> list[Any]:
    """The request's own input as items (a string is one user message); a value the adapter
    refuses is left for it to refuse (``required``: no previous response to add to)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return value
    if value is None and not required:
        return []
    raise ClientError("input must be a string or a non-empty list of items", "input")


def _input_list(stored: StoredResponse) -> list[Any]:
    items = _DECODER.decode(stored.input_json)
    return items if isinstance(items, list) else []


def _stored_items(stored: StoredResponse) -> list[Any]:
    """A stored response's input items, then its output items."""
    items = _DECODER.decode(stored.input_json)
    response = _DECODER.decode(stored.response_json)
    output = response.get("output") if isinstance(response, dict) else None
    return [*(items if isinstance(items, list) else ()),
            *(output if isinstance(output, list) else ())]


class ResponseRoutes:
    """``GET`` and ``DELETE /v1/responses/{id}`` (the ``asgi.Handler`` of that prefix):
    the client's key names the tenant whose response it may see. ``done(endpoint, status)``
    counts each answer under the one endpoint ``RESPONSE_ENDPOINT`` (never the id)."""

    def __init__(self, stored: StoredResponses, auth: Authenticator,
                 done: Callable[[str, int], None]) -> None:
        self._stored = stored
        self._auth = auth
        self._done = done

    async def __call__(self, request: Request) -> None:
        status = 500  # counted as such if what follows raises
        listing = request.path.endswith("/" + INPUT_ITEMS)
        try:
            status = await self._answer(request)
        finally:
            self._done(INPUT_ITEMS_ENDPOINT if listing else RESPONSE_ENDPOINT, status)

    async def _answer(self, request: Request) -> int:
        try:
            tenant = self._auth.tenant(request.headers)
            response_id, _, sub = request.path[len(RESPONSES_PREFIX):].partition("/")
            if not response_id or sub not in ("", INPUT_ITEMS) or "/" in sub:
                raise ClientError("Not found", status=404)
            if sub:
                if request.method != "GET":
                    raise ClientError("Not found", status=404)
                query = page_query(request.scope.get("query_string", b""))
                items = await self._stored.input_items(tenant, response_id)
                await send_response(request.send, 200, dumps(page(items, query)))
                return 200
            if request.method == "GET":
                if _asks_stream(request):
                    raise ClientError("stream is not supported when retrieving a stored "
                                      "response: GET it without stream", "stream")
                stored = await self._stored.get(tenant, response_id, None)
                await send_response(request.send, 200, stored.response_json)
                return 200
            await self._stored.delete(tenant, response_id)
            await send_response(request.send, 200, dumps(
                {"id": response_id, "object": "response", "deleted": True}))
            return 200
        except (ClientError, RouterError) as exc:
            await send_response(request.send, exc.status, exc.body(), headers=exc.headers)
            return exc.status
