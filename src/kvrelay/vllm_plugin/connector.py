"""kvrelay's drop-in ``NixlConnector``: vLLM's pull-mode NIXL connector with fixes and reports.

Loaded by vLLM through ``kv_transfer_config``::

    {"kv_connector": "NixlConnector",
     "kv_connector_module_path": "kvrelay.vllm_plugin.connector", ...}

The class keeps the name ``NixlConnector`` because vLLM's config and CPU platform code switch
behaviour on that name (``has_connector("NixlConnector")``). On GPUs only fix 3 and the
reports apply.

Fix 1: main-thread affinity (``kvrelay_restore_affinity``, default on)
    On the CPU platform, ``NixlBaseConnectorWorker.__init__`` calls
    ``os.sched_setaffinity(0, [last core of each NUMA node])`` to reserve a core for KV
    transfer. ``0`` is the *calling thread*: the worker's main thread, which runs the forward
    pass, ``start_load_kv`` and the worker's RPC loop, leaves its OpenMP core. With a prefill
    and a decode server on one NUMA node both main threads land on the same last core, next
    to one server's OpenMP threads, and starve: a D->P pull then sits in "KV fetch: 1 in
    progress" for minutes. We restore the main thread's previous affinity right after the
    worker is built. Threads NIXL/UCX start inside the constructor (progress, handshake
    listener) keep the reserved core, which is what vLLM intended.

Fix 2: UCX progress-thread delay (``kvrelay_nixl_progress_delay_us``, default 0 = vLLM's)
    The nixl Python API hard-codes ``pthrDelay = 0``: NIXL's progress thread busy-polls a
    whole core even when idle. On a 2-core host that core is a prefill core. A positive
    value is passed to the agent as its progress-thread delay in microseconds.

Fix 3: a failed D->P read is retried as a recompute, not as a read nobody performs
    With ``bidirectional_kv_xfer`` a P request carrying D's params loads D's blocks once
    (``update_state_after_alloc`` marks the params ``_remote_blocks_processed``). When that
    read fails (D declined it because its TTL passed, D restarted, the side channel is
    unreachable) and ``kv_load_failure_policy`` is ``recompute``, vLLM 0.32's scheduler frees
    the request's blocks and schedules it again; ``get_num_new_matched_tokens`` does not look
    at ``_remote_blocks_processed`` and asks for the same async load again, which
    ``update_state_after_alloc`` then never queues. The request waits in
    ``WAITING_FOR_REMOTE_KVS`` forever: a client hangs and P holds its blocks.
    (``scripts/repro_ttl_expired_read.py`` reproduces it.) We answer "nothing to load" for
    params already processed, so the retry computes the prompt on P.

Fixes 1-3 are proposals for upstream; docs/cpu-notes.md has the measurements.

Each fix runs only where its problem exists: at start-up the connector reads the installed
vLLM's and nixl's sources (``kvrelay.vllm_plugin.contract.fix_facts``, no import) and
``kvrelay.vllm_plugin.fixes.plan_fixes`` decides. Fixes 1-2 are off on GPU platforms
(vLLM re-pins on CPU only; the progress delay was only measured on CPU); fix 3 is off once
vLLM's pull scheduler checks ``_remote_blocks_processed`` itself. The decision and its reason
are logged once per process. ``make check-vllm VERSION=X`` checks that a vLLM release still
has every hook this class relies on (docs/vllm-versions.md).

The exact prefix guard, where the tokens are (``kvrelay.core.guard``)
    On D, ``request_finished`` adds to the retained params the fingerprint of the tokens D
    holds (``kvrelay_fingerprint``, from the engine's own prompt and output ids), D's block
    size and ``kvrelay_guard``. On P, before the scheduler asks how many tokens to load, a
    request carrying D's params with a fingerprint is checked against the engine's own
    ``prompt_token_ids``: only the verified prefix is loaded (the block list cut to match),
    below ``kv_recompute_threshold`` nothing (D is still notified and frees its blocks). P's
    answer carries ``kvrelay_verified_tokens`` and ``kvrelay_guard``. So the router never
    tokenizes and never needs D's token ids.

Report: D's retained params to the router (``kvrelay_report_url`` in a request's params)
    vLLM <= 0.32 does not put ``kv_transfer_params`` on the final chunk of a streamed
    response, so a router that streams from D never learns which blocks D retained. When a
    decode request's ``kv_transfer_params`` carry ``kvrelay_report_url`` and
    ``kvrelay_turn_id`` (the router adds them), this connector POSTs, from a background
    thread of the scheduler process, the report (``kvrelay.core.report``) to that URL when
    the request finishes. Only hosts allowed by ``kvrelay_report_hosts`` (default: loopback)
    are contacted, so a client that talks to D directly cannot make it call arbitrary
    addresses. Entries are host names, IP addresses or IP networks (``"10.244.0.0/16"``):
    router replicas that report their pod IP (one per replica, assigned by Kubernetes) are
    allowed by the pod network's CIDR (docs/deploy.md). Reports queued together are posted
    together (one JSON list), over one keep-alive connection.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import threading
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger

from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.guard import guard_params
from kvrelay.core.params import FINGERPRINT_KEY, GUARD_VERSION, VERIFIED_TOKENS_KEY, kvrelay_keys
from kvrelay.core.report import (
    DEFAULT_REPORT_HOSTS,
    MAX_REPORTS_PER_POST,
    ReportHosts,
    report_body,
    report_posts,
    report_target,
)
from kvrelay.vllm_plugin.contract import fix_facts, installed_context
from kvrelay.vllm_plugin.fixes import FixFacts, FixPlan, FixSettings, plan_fixes
from kvrelay.vllm_plugin.settings import PROGRESS_DELAY_KEY, REPORT_HOSTS_KEY, RESTORE_AFFINITY_KEY

# Under "vllm." so vLLM's logging configuration (handler, format, level) applies: a logger
# outside that namespace has no handler in a vLLM process and its info lines are dropped.
logger = init_logger(f"vllm.{__name__}")


class NixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's ``NixlConnector`` (pull mode) plus the CPU fixes in the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer_config = vllm_config.kv_transfer_config
        plan = _fix_plan(transfer_config)
        logger.info("kvrelay connector fixes: %s", plan.reason)
        self._skip_processed_pull = plan.skip_processed_pull
        is_worker = role == KVConnectorRole.WORKER
        saved = _thread_affinity() if (plan.restore_affinity and is_worker) else None
        with _nixl_progress_delay(plan.progress_delay_us if is_worker else 0):
            super().__init__(vllm_config, role, kv_cache_config)
        if saved is not None and _thread_affinity() != saved:
            logger.info(
                "kvrelay: NIXL worker moved the main thread to cores %s; restoring %s",
                sorted(_thread_affinity() or ()),
                sorted(saved),
            )
            os.sched_setaffinity(0, saved)
        hosts = transfer_config.get_from_extra_config(REPORT_HOSTS_KEY, DEFAULT_REPORT_HOSTS)
        self._reporter = _Reporter(hosts) if not is_worker else None
        self._block_size = int(vllm_config.cache_config.block_size)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if (
            self._skip_processed_pull
            and params
            and params.get("do_remote_decode")
            and params.get("_remote_blocks_processed")
        ):
            return 0, False
        if params and params.get(FINGERPRINT_KEY) is not None:
            self._guard(request, params)
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished(request, block_ids)
        self._mark(request, params)
        self._report(request, params)
        return delay, params

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        self._mark(request, params)
        self._report(request, params)
        return delay, params

    def _guard(self, request: Any, params: dict[str, Any]) -> None:
        """Cut a pull of D's blocks to the prefix proven equal to this engine's prompt."""
        scheduler = self.connector_scheduler
        threshold = int(getattr(scheduler, "kv_recompute_threshold", 0) or 0)
        guarded, check = guard_params(
            params, list(request.prompt_token_ids or ()), threshold=threshold,
            block_size=self._block_size,
        )
        params.clear()
        params.update(guarded)
        logger.debug("kvrelay guard %s: %s, verified %d, loading %d", request.request_id,
                     check.reason, check.verified_tokens, check.usable_tokens)

    def _mark(self, request: Any, params: dict[str, Any] | None) -> None:
        """kvrelay's keys on the params this node returns (module docstring)."""
        if not params:
            return
        if params.get("do_remote_decode"):
            held = int(params.get("remote_num_tokens") or 0)
            fingerprint = held_fingerprint(
                request.prompt_token_ids or (), request.output_token_ids, held
            )
            params.update(kvrelay_keys(guard_version=GUARD_VERSION, fingerprint=fingerprint,
                                       block_size=self._block_size))
            return
        sent = request.kv_transfer_params or {}
        verified = sent.get(VERIFIED_TOKENS_KEY)
        params.update(kvrelay_keys(guard_version=GUARD_VERSION,
                                   verified_tokens=verified if isinstance(verified, int) else None))

    def _report(self, request: Any, params: dict[str, Any] | None) -> None:
        target = report_target(request.kv_transfer_params)
        if self._reporter is None or target is None:
            return
        url, turn_id = target
        self._reporter.submit(
            url,
            report_body(
                turn_id, params, int(request.num_prompt_tokens), int(request.num_output_tokens),
            ),
        )


class _Reporter:
    """Posts reports from one daemon thread so the scheduler never waits on the network.

    Reports queued while a post is in flight go out together in the next post (a JSON list,
    ``kvrelay.core.report``), over one keep-alive connection per router address."""

    def __init__(self, allowed_hosts: Iterable[str]) -> None:
        self._allowed_hosts = ReportHosts(allowed_hosts)
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(maxsize=10_000)
        self._thread: threading.Thread | None = None
        self._failures = 0

    def submit(self, url: str, report: dict[str, Any]) -> None:
        host = urllib.parse.urlsplit(url).hostname or ""
        if not self._allowed_hosts.allows(host):
            logger.warning("kvrelay: not reporting to %s: host not in %s", host, REPORT_HOSTS_KEY)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvrelay-report", daemon=True)
            self._thread.start()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait((url, report))

    def _run(self) -> None:
        connections: dict[tuple[str, str], http.client.HTTPConnection] = {}
        while True:
            due = [self._queue.get()]
            while len(due) < 4 * MAX_REPORTS_PER_POST:
                try:
                    due.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            by_url: dict[str, list[bytes]] = {}
            for url, report in due:
                by_url.setdefault(url, []).append(json.dumps(report).encode())
            for url, encoded in by_url.items():
                for body, _ in report_posts(encoded):
                    self._post(connections, url, body)

    def _post(
        self, connections: dict[tuple[str, str], http.client.HTTPConnection], url: str,
        body: bytes,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        path = parts.path or "/"
        for attempt in (0, 1):
            conn = connections.get(key)
            if conn is None:
                kind = http.client.HTTPSConnection if parts.scheme == "https" else \
                    http.client.HTTPConnection
                conn = connections[key] = kind(parts.netloc, timeout=2.0)
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                conn.getresponse().read()
                return
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                connections.pop(key, None)
                if attempt == 0 and isinstance(
                    exc, http.client.RemoteDisconnected | BrokenPipeError | ConnectionResetError
                ):
                    continue  # the router closed an idle keep-alive connection: reconnect
                self._failures += 1
                if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                    logger.warning("kvrelay: report to %s failed (%d so far): %s",
                                   url, self._failures, exc)
                return


def _fix_plan(transfer_config: Any) -> FixPlan:
    """The fixes this process runs: the operator's switches, narrowed to what this node's
    vLLM and nixl need (every fix stays on where their sources cannot be read)."""
    from vllm.platforms import current_platform

    settings = FixSettings(
        restore_affinity=bool(transfer_config.get_from_extra_config(RESTORE_AFFINITY_KEY, True)),
        progress_delay_us=int(transfer_config.get_from_extra_config(PROGRESS_DELAY_KEY, 0)),
    )
    device_type = str(current_platform.device_type)
    try:
        facts = fix_facts(installed_context(), device_type)
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError) as exc:
        logger.warning("kvrelay: cannot read vLLM's sources (%s); every fix stays on", exc)
        facts = FixFacts(device_type, None, None, None)
    return plan_fixes(facts, settings)


def _thread_affinity() -> set[int] | None:
    if not hasattr(os, "sched_getaffinity"):
        return None
    return set(os.sched_getaffinity(0))


@contextlib.contextmanager
def _nixl_progress_delay(delay_us: int) -> Iterator[None]:
    """Within the block, NIXL agents are created with progress-thread delay ``delay_us``.

    ``nixl_agent.__init__`` builds a ``nixlAgentConfig`` and overwrites ``pthrDelay`` with 0
    before handing it to the ``nixlAgent`` binding; we wrap that binding for the duration of
    the connector's construction, in this process only.
    """
    if delay_us <= 0:
        yield
        return
    import importlib

    api = importlib.import_module("nixl._api")
    bindings = getattr(api, "nixlBind", None)
    real_agent = getattr(bindings, "nixlAgent", None)
    if bindings is None or real_agent is None:
        logger.warning("kvrelay: cannot set NIXL progress delay on this nixl version")
        yield
        return

    def agent_with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real_agent(name, config)

    bindings.nixlAgent = agent_with_delay
    try:
        yield
    finally:
        bindings.nixlAgent = real_agent
