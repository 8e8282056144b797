"""kvrelay's D-side report, as the fake engine sends it (see ``kvrelay.vllm_plugin.connector``).

vLLM 0.32 does not put ``kv_transfer_params`` on streamed chunks, so kvrelay's connector tells
the router which blocks D retained by POSTing, when a request finishes,
``{"turn_id", "kv_transfer_params", "num_prompt_tokens", "num_output_tokens"}`` to the
``kvrelay_report_url`` found in the request's ``kv_transfer_params`` (with
``kvrelay_turn_id``). ``kv_transfer_params`` in the report is D's retained params
(``do_remote_decode: true``), or ``null`` when nothing was retained (aborted request,
bidirectional transfer off). Only hosts in ``report_hosts`` (default: loopback) are contacted.
The connector reports on vLLM 0.33 too, where the final streamed chunk also carries the params,
so the fake does the same whatever its ``vllm_version``.

The real connector posts from a background thread about 100 ms after the last chunk; the fake
posts ``report_delay_s`` after the response completed (streamed: after ``data: [DONE]`` was
written; aborted: when the connection went away). A crashed engine sends nothing. Like the
connector, reports that are due while a post is in flight go out together in the next one
(a JSON list, ``core.report``), over one keep-alive connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass

import aiohttp
import msgspec

from kvrelay.core.report import ReportHosts, report_posts
from kvrelay.fakevllm.latency import Sleep


@dataclass
class ReportOutcome:
    """Where a report went, filled in as it happens: ``status`` is the receiver's HTTP
    status once posted, ``error`` why it was not (host not allowed, connection error)."""

    url: str
    body: dict[str, object]
    status: int | None = None
    error: str | None = None


class Reporter:
    """Posts reports of one engine (module docstring); ``close()`` drops pending ones."""

    def __init__(
        self, allowed_hosts: Collection[str], delay_s: float, sleep: Sleep = asyncio.sleep
    ) -> None:
        self._allowed = ReportHosts(allowed_hosts)
        self._delay_s = delay_s
        self._sleep = sleep
        self._session: aiohttp.ClientSession | None = None
        self._waiting: set[asyncio.Task[None]] = set()
        self._due: list[ReportOutcome] = []
        self._poster: asyncio.Task[None] | None = None

    def submit(self, outcome: ReportOutcome) -> None:
        """Post ``outcome.body`` to ``outcome.url`` after the delay. A host outside
        ``allowed_hosts`` is not contacted (``outcome.error`` says so)."""
        host = urllib.parse.urlsplit(outcome.url).hostname or ""
        if not self._allowed.allows(host):
            outcome.error = f"host {host!r} not in report_hosts"
            return
        if self._delay_s <= 0:
            self._enqueue(outcome)
            return
        task = asyncio.get_running_loop().create_task(self._later(outcome))
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def drain(self) -> None:
        """Wait until every submitted report was posted (or failed)."""
        while self._waiting or self._poster is not None:
            if self._waiting:
                await asyncio.gather(*list(self._waiting), return_exceptions=True)
            poster = self._poster
            if poster is not None:
                await asyncio.gather(poster, return_exceptions=True)

    async def close(self) -> None:
        """Cancel pending reports (the process died) and close the HTTP client."""
        tasks = [*self._waiting, *([self._poster] if self._poster else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._due.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _later(self, outcome: ReportOutcome) -> None:
        await self._sleep(self._delay_s)
        self._enqueue(outcome)

    def _enqueue(self, outcome: ReportOutcome) -> None:
        self._due.append(outcome)
        if self._poster is None:
            self._poster = asyncio.get_running_loop().create_task(self._post_due())

    async def _post_due(self) -> None:
        try:
            while self._due:
                url = self._due[0].url
                due = [o for o in self._due if o.url == url]
                self._due = [o for o in self._due if o.url != url]
                encoded = [msgspec.json.encode(o.body) for o in due]
                start = 0
                for body, count in report_posts(encoded):
                    await self._post(url, body, due[start : start + count])
                    start += count
        finally:
            self._poster = None

    async def _post(self, url: str, body: bytes, batch: list[ReportOutcome]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=2.0), trust_env=False)
        try:
            async with self._session.post(
                url, data=body, headers={"Content-Type": "application/json"},
            ) as response:
                with contextlib.suppress(aiohttp.ClientError):
                    await response.read()
                for outcome in batch:
                    outcome.status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            for outcome in batch:
                outcome.error = f"{type(exc).__name__}: {exc}"
