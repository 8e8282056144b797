"""One Responses turn's part in the response store (``router.response_store``): the fields
the client's response must show and the response kept once D has answered.

P and D are always told ``store: false`` and never see ``previous_response_id`` (the router
expanded it into the input), so D's response snapshots say ``"store": false`` and
``"previous_response_id": null``. A ``KeptResponse`` puts back what the client asked for:
``id`` (the router-minted id, also sent to D as ``request_id``), ``store: true`` when the
response is kept, the client's ``previous_response_id``. It patches every snapshot of the
response (``response.created``, ``response.in_progress`` and the final event of a stream, or
the body), and ``commit`` keeps the final one, with the turn's whole input, when it
``completed`` or is ``incomplete`` (a failed response is not kept). ``commit`` runs before
the client gets the final event or the body, so a client that sends its next turn at once
finds the response, and so that a response the store could not keep (Redis down, too large)
says ``store: false`` in its final snapshot: a client never holds an id that was never kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from kvrelay.core.identity import ToolCall
from kvrelay.router.apis.base import StreamScanner
from kvrelay.router.apis.responses import FINAL_EVENTS, snapshot_of
from kvrelay.router.response_store import ResponseStore, StoredResponse
from kvrelay.router.sse import split_events

log = logging.getLogger("kvrelay.router")

_SNAPSHOTS = (b"event: response.created\n", b"event: response.in_progress\n")
_KEPT_STATUSES = frozenset({"completed", "incomplete"})
_ENCODER = msgspec.json.Encoder()


class KeptResponse:
    """What the store does with one turn's response (module docstring). ``store`` is
    ``None`` when the response is not kept (``store: false``, but a ``previous_response_id``
    to show); ``input_items`` is the turn's whole input as sent to P and D."""

    __slots__ = ("_final", "_input_items", "_lost", "_on_error", "_store", "previous_id",
                 "response_id", "tenant")

    def __init__(
        self,
        *,
        store: ResponseStore | None,
        tenant: str,
        response_id: str | None,
        previous_id: str | None,
        input_items: list[Any],
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self.tenant = tenant
        self.response_id = response_id
        self.previous_id = previous_id
        self._input_items = input_items
        self._on_error = on_error
        self._final: dict[str, Any] | None = None
        self._lost = False

    @property
    def keeps(self) -> bool:
        """Whether the response is kept (``store: true`` with the store on), until ``commit``
        finds the store could not keep it."""
        return self._store is not None and self.response_id is not None and not self._lost

    @property
    def lost(self) -> bool:
        """``commit`` tried to keep the response and the store did not."""
        return self._lost

    def patch(self, response: dict[str, Any], *, final: bool) -> None:
        """Set the fields the client asked for on a response object (in place); ``final``:
        it is the finished response (the body, or a stream's last snapshot)."""
        if self.response_id is not None:
            response["id"] = self.response_id
        response["store"] = self.keeps
        if self.previous_id is not None:
            response["previous_response_id"] = self.previous_id
        if final:
            self._final = response

    def scanner(self, inner: StreamScanner) -> StreamScanner:
        """``inner`` (the adapter's scanner) with every snapshot patched."""
        return _KeepingScan(inner, self)

    def patch_events(self, events: bytes) -> bytes:
        """``events`` (whole SSE events) with every response snapshot among them patched."""
        if not any(m in events for m in _SNAPSHOTS) and not any(
                m in events for m in FINAL_EVENTS):
            return events
        return b"".join(self._event(e) for e in split_events(events))

    async def commit(self) -> bool:
        """Keep the final response (module docstring); whether it was kept. When the store
        could not keep it, the final response (the body's object) says ``store: false``
        and ``keeps`` turns false: a stream's final event is patched again
        (``patch_events``) before it is sent."""
        final = self._final
        if not self.keeps or final is None or final.get("status") not in _KEPT_STATUSES:
            return False
        assert self._store is not None and self.response_id is not None
        stored = StoredResponse(_ENCODER.encode(self._input_items), _ENCODER.encode(final))
        kept = await self._store.put(self.tenant, self.response_id, stored)
        if not kept:
            log.info("response store: response not kept (store unavailable or too large)")
            if self._on_error is not None:
                self._on_error("response_put")
            self._lost = True
            final["store"] = False
        return kept

    def _event(self, event: bytes) -> bytes:
        final = event.startswith(FINAL_EVENTS)
        if not final and not event.startswith(_SNAPSHOTS):
            return event
        found = snapshot_of(event)
        if found is None:
            return event
        head, obj, response = found
        self.patch(response, final=final)
        return head + _ENCODER.encode(obj) + b"\n\n"


class _KeepingScan:
    """A ``StreamScanner`` that patches the snapshots its inner scanner passed on; what the
    inner one found is copied after every ``feed``."""

    def __init__(self, inner: StreamScanner, kept: KeptResponse) -> None:
        self._inner = inner
        self._kept = kept
        self._sync()

    def _sync(self) -> None:
        inner = self._inner
        self.done = inner.done
        self.error = inner.error
        self.params = inner.params
        self.params_seen = inner.params_seen
        self.prompt_token_ids = inner.prompt_token_ids
        self.output_token_ids = inner.output_token_ids

    def answer(self) -> tuple[str, list[ToolCall]]:
        return self._inner.answer()

    def cut(self, status: int, message: str) -> bytes:
        return self._inner.cut(status, message)

    def feed(self, events: bytes) -> bytes:
        out = self._inner.feed(events)
        self._sync()
        return self._kept.patch_events(out)
