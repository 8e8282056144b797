"""kvrelay's D-side report, as the fake engine sends it (see ``kvrelay.cluster.connector``).

vLLM 0.32 does not put ``kv_transfer_params`` on streamed chunks, so kvrelay's connector tells
the router which blocks D retained by POSTing, when a request finishes,
``{"turn_id", "kv_transfer_params", "num_prompt_tokens", "num_output_tokens"}`` to the
``kvrelay_report_url`` found in the request's ``kv_transfer_params`` (with
``kvrelay_turn_id``). ``kv_transfer_params`` in the report is D's retained params
(``do_remote_decode: true``), or ``null`` when nothing was retained (aborted request,
bidirectional transfer off). Only hosts in ``report_hosts`` (default: loopback) are contacted.

The real connector posts from a background thread about 100 ms after the last chunk; the fake
posts ``report_delay_s`` after the response completed (streamed: after ``data: [DONE]`` was
written; aborted: when the connection went away). A crashed engine sends nothing.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import httpx

from kvrelay.core.params import REPORT_TURN_KEY, REPORT_URL_KEY
from kvrelay.testing.fake_latency import Sleep


@dataclass
class ReportOutcome:
    """Where a report went, filled in as it happens: ``status`` is the receiver's HTTP
    status once posted, ``error`` why it was not (host not allowed, connection error)."""

    url: str
    body: dict[str, object]
    status: int | None = None
    error: str | None = None


def report_target(params: Mapping[str, object] | None) -> tuple[str, str] | None:
    """``(url, turn_id)`` when a request's params ask for a report, else ``None``."""
    if not params:
        return None
    url, turn_id = params.get(REPORT_URL_KEY), params.get(REPORT_TURN_KEY)
    if not url or not turn_id:
        return None
    return str(url), str(turn_id)


class Reporter:
    """Posts reports of one engine from detached tasks; ``close()`` drops pending ones."""

    def __init__(
        self, allowed_hosts: Collection[str], delay_s: float, sleep: Sleep = asyncio.sleep
    ) -> None:
        self._allowed = frozenset(allowed_hosts)
        self._delay_s = delay_s
        self._sleep = sleep
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, outcome: ReportOutcome) -> None:
        """Post ``outcome.body`` to ``outcome.url`` after the delay. A host outside
        ``allowed_hosts`` is not contacted (``outcome.error`` says so)."""
        host = urllib.parse.urlsplit(outcome.url).hostname or ""
        if host not in self._allowed:
            outcome.error = f"host {host!r} not in report_hosts"
            return
        task = asyncio.get_running_loop().create_task(self._post(outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait until every submitted report was posted (or failed)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel pending reports (the process died) and close the HTTP client."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _post(self, outcome: ReportOutcome) -> None:
        if self._delay_s > 0:
            await self._sleep(self._delay_s)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=2.0, trust_env=False)
        try:
            response = await self._client.post(outcome.url, json=outcome.body)
            outcome.status = response.status_code
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"

