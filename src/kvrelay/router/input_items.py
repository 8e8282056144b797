"""``GET /v1/responses/{id}/input_items``: the input a stored response was made from, listed
as OpenAI lists it (the SDKs' ``client.responses.input_items.list(id)``).

The response store keeps each response's whole input as P and D saw it: a
``previous_response_id`` expanded into the earlier inputs and outputs, then the request's own
(``stored_responses``). Before, this path was a 404, so a client that lists what a response
was made from failed where OpenAI answers.

* **The page.** ``{"object": "list", "data", "first_id", "last_id", "has_more"}``; ``order``
  ``desc`` (OpenAI's default: newest first) or ``asc``; ``limit`` 1-100 (default 20);
  ``after`` the id of the item the page starts after (an id not in the list: an empty page,
  as a cursor past the end). ``include`` is accepted and adds nothing: the store keeps no
  search results, images or logprobs to add. A bad value is a 400 naming the parameter.
* **The items.** Items the client sent in the easy form (``{"role", "content": "text"}``)
  are listed typed, as OpenAI lists them: ``{"type": "message", "role", "content": [parts]}``
  with ``input_text`` parts (``output_text`` for an assistant's). An item without an id (the
  client's own input, a tool's output) gets one derived from its place in the input and its
  content, so a cursor names the same item in every call, and the later responses of a
  ``previous_response_id`` chain list it under the same id; items with an id (earlier
  outputs) keep it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs

import msgspec

from kvrelay.router.errors import ClientError

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
_ID_PREFIX = {"message": "msg", "function_call_output": "fco", "function_call": "fc"}


class PageQuery(msgspec.Struct, frozen=True):
    """What one list call asks for (module docstring, "The page")."""

    limit: int = DEFAULT_LIMIT
    order: str = "desc"
    after: str | None = None


def page_query(query_string: bytes) -> PageQuery:
    """The call's query string as a ``PageQuery``; ``ClientError`` (400) for a bad value."""
    query = parse_qs(query_string.decode("latin-1"), keep_blank_values=True)
    limit = _one(query, "limit")
    order = _one(query, "order") or "desc"
    if order not in ("asc", "desc"):
        raise ClientError("order must be 'asc' or 'desc'", "order")
    number = DEFAULT_LIMIT
    if limit is not None:
        try:
            number = int(limit)
        except ValueError:
            number = 0
        if not 1 <= number <= MAX_LIMIT:
            raise ClientError(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    return PageQuery(limit=number, order=order, after=_one(query, "after") or None)


def _one(query: Mapping[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise ClientError(f"{name} is given more than once", name)
    return values[0]


def listed_items(items: Sequence[Any]) -> list[dict[str, Any]]:
    """A stored input as OpenAI lists it (module docstring, "The items"), oldest first."""
    return [_listed(i, item) for i, item in enumerate(items) if isinstance(item, dict)]


def _listed(index: int, item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "type" not in out and "role" in out:
        out["type"] = "message"
    if out.get("type") == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": out["content"]}
        if kind == "output_text":
            part["annotations"] = []
        out["content"] = [part]
    if not isinstance(out.get("id"), str) or not out["id"]:
        digest = hashlib.blake2b(f"{index}:".encode() + msgspec.json.encode(item),
                                 digest_size=16).hexdigest()
        out["id"] = f"{_ID_PREFIX.get(str(out.get('type')), 'item')}_{digest}"
    return out


def page(items: list[dict[str, Any]], query: PageQuery) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as OpenAI's list object."""
    ordered = items if query.order == "asc" else items[::-1]
    start = 0
    if query.after is not None:
        ids = [item["id"] for item in ordered]
        start = ids.index(query.after) + 1 if query.after in ids else len(ordered)
    data = ordered[start:start + query.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(data) < len(ordered),
    }
