"""OpenAI-style error bodies, and the router's two error types.

Every error the router answers has the body ``{"error": {"message", "type", "param", "code"}}``
(``code`` is the HTTP status, as vLLM does, except for an error OpenAI names with a code its
clients act on: ``previous_response_not_found``), so the unmodified ``openai`` SDK raises its usual
``APIStatusError`` subclasses. ``ClientError`` is bad client input (always 4xx, never a 500);
``RouterError`` is anything else the router answers itself (no capacity, upstream failure).
Upstream 4xx answers are passed through with their own status and message. Messages the
router writes itself never name a node, a URL or an exception: they say which role failed
and how (``upstream.UpstreamError.to_router_error``).

Bodies are bytes (``msgspec`` JSON); ``asgi.send_json`` sends them.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

import msgspec

_ENCODER = msgspec.json.Encoder()

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The ``type`` string for an HTTP status (``BadRequestError`` style, as vLLM names them)."""
    known = _TYPES.get(status)
    if known is not None:
        return known
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return phrase.replace(" ", "").replace("-", "") + "Error"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, object]:
    """``{"error": {"message", "type", "param", "code"}}`` for ``status``; ``code`` is the
    status unless an error OpenAI names gives its own (``previous_response_not_found``)."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status if code is None else code}}


def error_json(status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    """The encoded OpenAI-style error body."""
    return dumps(error_body(status, message, param, code))


_ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
}
MESSAGES_PATH = "/v1/messages"


def anthropic_error_json(status: int, message: str) -> bytes:
    """Anthropic's error body (``{"type": "error", "error": {"type", "message"}}``)."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return dumps({"type": "error", "error": {"type": kind, "message": message}})


def refusal_json(path: str, status: int, message: str) -> bytes:
    """A refusal the router writes before any API's handler has the request (no such path,
    a wrong method): Anthropic's shape under the Messages API's path (its clients read only
    that), else OpenAI's."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return anthropic_error_json(status, message)
    return error_json(status, message)


def dumps(obj: object) -> bytes:
    """Compact JSON bytes (non-ASCII kept, like vLLM's pydantic dumps)."""
    return _ENCODER.encode(obj)


def passthrough_error_body(status: int, upstream: object) -> dict[str, object]:
    """An upstream 4xx body as an OpenAI-style error: kept if it already is one (vLLM's
    ``ErrorResponse``), else wrapped with a generic message."""
    if isinstance(upstream, Mapping):
        err = upstream.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            param = err.get("param")
            out = error_body(status, str(err["message"]), param if isinstance(param, str) else None)
            if isinstance(err.get("type"), str):
                out["error"]["type"] = err["type"]  # type: ignore[index]
            return out
        # vLLM's older/FastAPI error shapes: {"message": ...} or {"detail": ...}
        for field in ("message", "detail"):
            if isinstance(upstream.get(field), str):
                return error_body(status, str(upstream[field]))
    return error_body(status, f"upstream answered HTTP {status}")


class ClientError(Exception):
    """Bad client input: answered with ``status`` (4xx) and an OpenAI error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        headers: Mapping[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.headers = dict(headers or {})
        self.code = code

    def body(self) -> bytes:
        return error_json(self.status, self.message, self.param, self.code)


class RouterError(Exception):
    """A failure the router answers itself (502/503/504, or a passed-through upstream 4xx
    when ``body`` is set). Every 503 carries ``Retry-After`` (1 s unless given): it is
    capacity or a node coming back, and clients that honour it back off instead of
    hammering."""

    def __init__(
        self,
        status: int,
        message: str,
        body: Mapping[str, object] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.passthrough = body
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", "1")

    def to_body(self) -> dict[str, object]:
        if self.passthrough is not None:
            return dict(self.passthrough)
        return error_body(self.status, self.message)

    def body(self) -> bytes:
        return dumps(self.to_body())
