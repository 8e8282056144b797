"""kvrelay's drop-in ``NixlConnector``: vLLM's pull-mode NIXL connector with CPU fixes.

Loaded by vLLM through ``kv_transfer_config``::

    {"kv_connector": "NixlConnector",
     "kv_connector_module_path": "kvrelay.cluster.connector", ...}

The class keeps the name ``NixlConnector`` because vLLM's config and CPU platform code switch
behaviour on that name (``has_connector("NixlConnector")``). It changes nothing on GPUs.

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

Report: D's retained params to the router (``kvrelay_report_url`` in a request's params)
    vLLM <= 0.32 does not put ``kv_transfer_params`` on the final chunk of a streamed
    response, so a router that streams from D never learns which blocks D retained. When a
    decode request's ``kv_transfer_params`` carry ``kvrelay_report_url`` and
    ``kvrelay_turn_id`` (the router adds them), this connector POSTs, from a background
    thread of the scheduler process, ``{"turn_id", "kv_transfer_params", "num_prompt_tokens",
    "num_output_tokens"}`` to that URL when the request finishes. Only hosts allowed by
    ``kvrelay_report_hosts`` (default: loopback) are contacted, so a client that talks to D
    directly cannot make it call arbitrary addresses. Entries are host names, IP addresses
    or IP networks (``"10.244.0.0/16"``): router replicas that report their pod IP (one per
    replica, assigned by Kubernetes) are allowed by the pod network's CIDR (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import queue
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger

logger = init_logger(__name__)

RESTORE_AFFINITY_KEY = "kvrelay_restore_affinity"
PROGRESS_DELAY_KEY = "kvrelay_nixl_progress_delay_us"
REPORT_URL_KEY = "kvrelay_report_url"
REPORT_TURN_KEY = "kvrelay_turn_id"
REPORT_HOSTS_KEY = "kvrelay_report_hosts"
DEFAULT_REPORT_HOSTS = ("127.0.0.1", "localhost", "::1")


class NixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's ``NixlConnector`` (pull mode) plus the CPU fixes in the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer_config = vllm_config.kv_transfer_config
        restore = bool(transfer_config.get_from_extra_config(RESTORE_AFFINITY_KEY, True))
        delay_us = int(transfer_config.get_from_extra_config(PROGRESS_DELAY_KEY, 0))
        is_worker = role == KVConnectorRole.WORKER
        saved = _thread_affinity() if (restore and is_worker) else None
        with _nixl_progress_delay(delay_us if is_worker else 0):
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

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            return 0, False
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished(request, block_ids)
        self._report(request, params)
        return delay, params

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        self._report(request, params)
        return delay, params

    def _report(self, request: Any, params: dict[str, Any] | None) -> None:
        sent = request.kv_transfer_params or {}
        url, turn_id = sent.get(REPORT_URL_KEY), sent.get(REPORT_TURN_KEY)
        if self._reporter is None or not url or not turn_id:
            return
        self._reporter.submit(
            str(url),
            {
                "turn_id": str(turn_id),
                "kv_transfer_params": params if params and params.get("do_remote_decode") else None,
                "num_prompt_tokens": int(request.num_prompt_tokens),
                "num_output_tokens": int(request.num_output_tokens),
            },
        )


class ReportHosts:
    """Which hosts reports may go to: exact names or addresses, and IP networks."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            entry = str(entry).strip()
            if "/" in entry:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            else:
                self.names.add(entry.lower())

    def allows(self, host: str) -> bool:
        if host.lower() in self.names:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return str(address) in self.names or any(address in net for net in self.networks)


class _Reporter:
    """Posts reports from one daemon thread so the scheduler never waits on the network."""

    def __init__(self, allowed_hosts: Iterable[str]) -> None:
        self._allowed_hosts = ReportHosts(allowed_hosts)
        self._queue: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=10_000)
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
            self._queue.put_nowait((url, json.dumps(report).encode()))

    def _run(self) -> None:
        while True:
            url, body = self._queue.get()
            req = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=2.0) as resp:
                    resp.read()
            except OSError as exc:
                self._failures += 1
                if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                    logger.warning("kvrelay: report to %s failed (%d so far): %s",
                                   url, self._failures, exc)


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
