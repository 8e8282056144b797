"""Issue #12, defect 9: streams still open at the drain deadline end cleanly.

Two streams are held by D (every token waits on a ``HeldSleep`` step that is never released)
when the router gets SIGTERM with ``--drain-timeout-s 3``. Contract:

* each client gets an SSE error event (``data: {"error": ...}``), then ``data: [DONE]``, then
  a clean end of the chunked body (httpx reads it without error);
* during the drain ``GET /metrics`` answers 200 and the internal listener's
  ``/internal/kv-report`` still answers;
* the log has one line per cut stream containing "cut" and "drain deadline", and no
  "Traceback"; the router exits 0.

The drain has begun once the log has a new line mentioning "drain" (case-insensitive) after
the signal; ``/metrics`` and the report endpoint are then asked every 50 ms for a second
(the router before #12 closed its listener within 0.1 s of the signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import Awaitable
from pathlib import Path

import httpx
import pytest

from kvrelay.client.sse import line_chunks
from kvrelay.fakevllm import FakeCluster
from tests.component.fake_vllm_version import engine_config
from tests.component.router_process import HeldSleep, run_router, until

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "max_tokens": 12, "stream": True,
        "messages": [{"role": "user", "content": "Count slowly from one to twelve."}]}
#: Long enough that the probes of the drain's first second are all well inside it.
DRAIN_TIMEOUT_S = 3
CUT_LINE = re.compile(r"cut.*drain deadline|drain deadline.*cut", re.IGNORECASE)


async def attempt(request: Awaitable[httpx.Response]) -> str:
    """``"HTTP <status>"``, or the name of the transport error that stopped the request."""
    try:
        resp = await request
    except httpx.TransportError as exc:
        return type(exc).__name__
    return f"HTTP {resp.status_code}"


async def probe_during_drain(url: str, internal_url: str) -> tuple[set[str], set[str]]:
    """What ``GET /metrics`` and ``POST /internal/kv-report`` got, each asked every 50 ms
    for the first second of the drain (which lasts ``DRAIN_TIMEOUT_S``)."""
    metrics: set[str] = set()
    report: set[str] = set()
    loop = asyncio.get_running_loop()
    until_s = loop.time() + 1.0
    made_up = {"turn_id": "made-up", "kv_transfer_params": None,
               "num_prompt_tokens": 1, "num_output_tokens": 1}
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        while loop.time() < until_s:
            metrics.add(await attempt(c.get(url + "/metrics")))
            report.add(await attempt(c.post(internal_url + "/internal/kv-report", json=made_up)))
            await asyncio.sleep(0.05)
    return metrics, report


async def test_streams_open_at_the_drain_deadline_end_with_an_error_event(
    tmp_path: Path,
) -> None:
    sleep = HeldSleep()
    async with FakeCluster(1, 1, engine_config(report_delay_s=0.0), sleep=sleep) as cluster, \
            run_router(cluster, tmp_path, "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
                       internal=True) as router, \
            contextlib.AsyncExitStack() as stack:
        cluster.decode[0].faults.slow_stream_s = 0.01  # every token is a step of ``sleep``
        sleep.hold()
        streams = []
        for _ in range(2):
            client = await stack.enter_async_context(router.client())
            resp = await stack.enter_async_context(client.stream("POST", CHAT, json=BODY))
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            assert (await anext(lines)).startswith("data: {")  # the role chunk
            streams.append(lines)
        await until(lambda: sleep.held == 2, "both streams held by D")
        drain_lines = len(re.findall("drain", router.log(), re.IGNORECASE))

        router.signal(signal.SIGTERM)
        await until(lambda: len(re.findall("drain", router.log(), re.IGNORECASE)) > drain_lines,
                    "the router logs that it drains")
        metrics, report = await probe_during_drain(router.url, router.internal_url)

        ends: list[tuple[list[str], str | None]] = []
        for lines in streams:
            got: list[str] = []
            error: str | None = None
            try:
                got.extend([line async for line in lines if line])
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            ends.append((got, error))
        code = await router.wait_exit()
        log = router.log()

    for got, error in ends:
        events = list(line_chunks(got))
        assert error is None and got[-1:] == ["data: [DONE]"] and any(
            "error" in e for e in events), (
            f"a stream cut at the drain deadline ended with {error or 'no transport error'} "
            f"after {got}; expected an error event, data: [DONE] and a clean end")
    assert metrics == {"HTTP 200"}, f"GET /metrics during the drain: {metrics}"
    assert all(r.startswith("HTTP ") and int(r[5:]) < 500 for r in report), (
        f"POST /internal/kv-report during the drain: {report}")
    cut = [line for line in log.splitlines() if CUT_LINE.search(line)]
    assert len(cut) == 2, f"log lines about streams cut at the drain deadline: {cut}"
    assert "Traceback" not in log, log[log.index("Traceback"):][:2000]
    assert code == 0, f"the router exited with {code}"
