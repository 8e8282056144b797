"""What an API adapter is: the one place where a client API differs from the others.

The turn (plan, P, D, commit), the guard and the policy are one for every API. What differs
is behind ``ApiAdapter``:

* ``conversation_hint`` / ``end_user`` / ``parse``: a client body read into an
  ``ApiRequest``: the canonical history core digests in one call (``core.identity.History``),
  the stream flag, the output budget, the API's own conversation hint (the session inside
  Anthropic's ``metadata.user_id``; OpenAI's ``prompt_cache_key`` is none) and its end user
  (OpenAI's ``user``, Anthropic's ``metadata.user_id``), which narrows the scope;
* ``tokenize_body``, ``prefill_body``, ``decode_body``: the bodies sent to P and D (on
  vLLM's own endpoint for the API, so P and D render the same prompt);
* ``prefill_answer``: D's params and the prompt length from P's answer;
* ``scanner`` / ``rewrite_body``: D's answer as the client gets it: a per-request scanner of
  a stream that finds what the turn needs (D's params, the answer the next turn carries)
  and rewrites only what must change (the usage's cached tokens, router-internal fields);
* ``error``: the router's own errors in the API's error shape (a cut stream's: the
  scanner's ``cut``).

Adapters are stateless; one instance per API (``router.apis.ADAPTERS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import msgspec

from kvrelay.core.identity import History, ToolCall
from kvrelay.router.apis.fields import JsonObject
from kvrelay.router.errors import ClientError, RouterError
from kvrelay.router.sse import Rewrite


class ApiRequest(msgspec.Struct, frozen=True):
    """A client body as its adapter read it (``ApiAdapter.parse``).

    ``include_usage``: the stream carries a usage event the router may rewrite;
    ``wants_token_ids``: the client asked for token ids itself; ``max_output_tokens``: the
    output budget D's report is checked against; ``prompt_token_ids``: a completions prompt
    given as ids.
    """

    history: History
    stream: bool
    include_usage: bool
    wants_token_ids: bool
    max_output_tokens: int | None
    prompt_token_ids: tuple[int, ...] | None = None


class DecodeRead(msgspec.Struct, frozen=True):
    """What the router read from D's non-streamed answer: D's params (``None`` if it sent
    none), the answer (text and tool calls, as the API carries them), token ids when the
    router asked for them."""

    params: object
    text: str
    calls: list[ToolCall]
    prompt_token_ids: list[int] | None
    output_token_ids: list[int]


class StreamScanner(Protocol):
    """Watches one relayed stream. ``feed`` takes complete events and returns the bytes to
    send; ``done`` is set by the API's end-of-stream event, ``error`` by an error event;
    ``params`` / ``params_seen``: D's retained params if the stream carries them."""

    done: bool
    error: object
    params: object
    params_seen: bool
    prompt_token_ids: list[int] | None
    output_token_ids: list[int]

    def feed(self, events: bytes) -> bytes: ...

    def answer(self) -> tuple[str, list[ToolCall]]: ...

    def cut(self, status: int, message: str) -> bytes:
        """The events that end this stream when the router must cut it (D failed, the
        drain), in the API's shape, after the events already relayed."""
        ...


class ApiAdapter(Protocol):
    """One client API (module docstring). ``endpoint`` is its name in metrics and logs,
    ``path`` vLLM's endpoint for it (on P and D); ``tokenizable``: whether P's
    ``/tokenize`` renders its prompt (needed to guard a pull for a stock P);
    ``stream_family``: APIs whose streams carry D's params alike (learned per D)."""

    endpoint: str
    path: str
    tokenizable: bool
    stream_family: str

    def end_user(self, body: JsonObject) -> str | None:
        """The end user the request names (OpenAI's ``user``, Anthropic's
        ``metadata.user_id``): it narrows the scope (``core.identity.scope_of``)."""
        ...

    def conversation_hint(self, body: JsonObject, headers: Mapping[str, str]) -> str | None:
        """The API's own conversation id in the body, if any (after ``conversation_id`` and
        the configured session headers)."""
        ...

    def parse(self, body: JsonObject) -> ApiRequest:
        """Validate what the router relies on; ``ClientError`` if bad."""
        ...

    def tokenize_body(self, body: JsonObject, req: ApiRequest) -> JsonObject | None:
        """P's ``/tokenize`` body for the prompt's exact ids; ``None`` when the ids are
        known already or the API cannot be tokenized there."""
        ...

    def prefill_body(self, body: JsonObject, params: Mapping[str, object]) -> bytes: ...

    def decode_body(
        self, body: JsonObject, params: Mapping[str, object], *, token_ids: bool
    ) -> bytes: ...

    def prefill_answer(self, raw: bytes) -> tuple[dict[str, object] | None, int]:
        """P's ``kv_transfer_params`` and prompt length (0: not reported); raises
        ``msgspec.DecodeError`` / ``ValidationError`` on a malformed answer."""
        ...

    def scanner(self, rewrite: Rewrite) -> StreamScanner: ...

    def rewrite_body(self, obj: JsonObject, rewrite: Rewrite) -> DecodeRead:
        """D's non-streamed answer, changed in place; what the router read from it."""
        ...

    def error(self, exc: ClientError | RouterError) -> bytes:
        """The body of an error the router answers, in the API's shape."""
        ...

