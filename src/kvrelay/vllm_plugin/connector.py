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

Retention: D's retained turns accounted and released (``kvrelay.vllm_plugin.retention``)
    Each turn vLLM keeps on D for a P to read (``request_finished`` delays its free) is in
    the connector's ledger until vLLM frees it. Its retention time is the router's
    ``kvrelay_retain_s`` clamped to ``decoder_kv_blocks_ttl``; when shorter, the connector
    gives vLLM that deadline for this request and stamps it in the params it returns
    (``remote_blocks_expiry_time``), so vLLM's own TTL sweep frees it and P declines a read
    near it, as for the global TTL. Early releases go through the same sweep: the connector
    hands vLLM's scheduler an expiry in the past for the request (``_reqs_need_send``, sent
    to the worker, whose ``_reap_expired_send_leases`` frees it in that step). D releases
    (managed mode, ``kvrelay_retention``):

    * under pressure, when a waiting decode request does not fit
      (``get_num_new_matched_tokens`` answers ``None``: the scheduler skips it this step;
      it is sized as vLLM sizes it, beside its local prefix-cache hit: hit blocks another
      request holds, such as a system prompt every conversation shares, need no release,
      ``blocks_needed``) or a running one cannot grow (``has_pending_block_frees``
      answers ``True``: the scheduler waits instead of preempting), least valuable first,
      a release counting only the blocks no other request holds (``KVCacheBlock.ref_cnt``:
      turns share a system prompt, a conversation's history);
    * over ``kvrelay_retention_headroom``;
    * on the router's orders.

    Pressure and headroom releases are asked of the turn's router first and made only once
    it answers (``kvrelay.core.retention_sync``: P's read is invisible to D until it ends);
    a router that does not answer in time gets its turns back and D falls back to vLLM's own
    waiting and preemption. The sync thread (``kvrelay.vllm_plugin.retention_client``)
    talks to the routers; this class applies their answers on the scheduler thread.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import queue
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger

from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.guard import guard_params
from kvrelay.core.params import (
    FINGERPRINT_KEY,
    GUARD_VERSION,
    VERIFIED_TOKENS_KEY,
    RetentionMode,
    kvrelay_keys,
)
from kvrelay.core.report import (
    DEFAULT_REPORT_HOSTS,
    MAX_REPORTS_PER_POST,
    ReportHosts,
    report_body,
    report_posts,
    report_target,
)
from kvrelay.core.retention_sync import (
    RETAIN_S_KEY,
    RETAIN_VALUE_KEY,
    RETENTION_URL_KEY,
    RETURN_CURVE_KEY,
    clamp_retain_s,
)
from kvrelay.core.return_curve import ReturnCurve, decode_curve
from kvrelay.vllm_plugin.contract import fix_facts, installed_context
from kvrelay.vllm_plugin.fixes import FixFacts, FixPlan, FixSettings, plan_fixes
from kvrelay.vllm_plugin.retention import RetentionLedger, blocks_needed
from kvrelay.vllm_plugin.retention_client import Engine, RetentionSyncClient
from kvrelay.vllm_plugin.settings import (
    PROGRESS_DELAY_KEY,
    REPORT_HOSTS_KEY,
    RESTORE_AFFINITY_KEY,
    RETENTION_HEADROOM_KEY,
    RETENTION_KEY,
    retention_headroom,
    retention_mode,
)

# Under "vllm." so vLLM's logging configuration (handler, format, level) applies: a logger
# outside that namespace has no handler in a vLLM process and its info lines are dropped.
logger = init_logger(f"vllm.{__name__}")


class NixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's ``NixlConnector`` (pull mode) plus the CPU fixes in the module docstring."""

    _retention: _Retention | None = None
    """D's retention (scheduler role only; ``None`` in the worker)."""

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
        if not is_worker:
            mode = retention_mode(transfer_config.get_from_extra_config(RETENTION_KEY, "managed"))
            headroom = retention_headroom(
                transfer_config.get_from_extra_config(RETENTION_HEADROOM_KEY, 0.0))
            engine = Engine(engine_id=str(transfer_config.engine_id),
                            block_size=self._block_size,
                            bytes_per_block=_bytes_per_block(kv_cache_config),
                            num_blocks_total=int(getattr(kv_cache_config, "num_blocks", 0) or 0))
            self._retention = _Retention(
                RetentionLedger(managed=mode == "managed", headroom=headroom),
                RetentionSyncClient(hosts, engine, logger=logger), engine,
                num_kv_cache_groups=len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()))
            logger.info("kvrelay retention: %s, headroom %.2f", mode, headroom)

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
        if (
            self._retention is not None
            and params
            and params.get("do_remote_prefill")
            and self._retention.waits_for_release(request, num_computed_tokens)
        ):
            return None, False  # skipped this step: retained blocks are being freed for it
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished(request, block_ids)
        self._mark(request, params)
        self._retain(request, (block_ids,), delay, params)
        self._report(request, params)
        return delay, params

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        self._mark(request, params)
        self._retain(request, block_ids, delay, params)
        self._report(request, params)
        return delay, params

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if self._retention is not None:
            self._retention.block_pool = gpu_block_pool

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._retention is not None:
            self._retention.watermark_blocks = int(kv_cache_manager.watermark_blocks)

    def has_pending_block_frees(self) -> bool:
        """Asked by vLLM's scheduler before it preempts a running request for blocks."""
        return self._retention is not None and self._retention.frees_for_running()

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._retention is not None:
            self._retention.freed(connector_output.finished_sending or ())

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._retention is not None:
            scheduler = self.connector_scheduler
            for request_id in self._retention.step():
                # vLLM's TTL path: the worker takes this deadline for the request and its
                # expiry sweep frees the blocks in this step (module docstring).
                scheduler._reqs_need_send[request_id] = time.perf_counter() - 1.0
        return super().build_connector_meta(scheduler_output)

    def _retain(self, request: Any, block_ids: Any, delay: bool,
                params: dict[str, Any] | None) -> None:
        """Account a turn vLLM now keeps on D; give vLLM its own, shorter deadline."""
        if self._retention is None or not delay or not params or \
                not params.get("do_remote_decode"):
            return
        sent = request.kv_transfer_params or {}
        ttl_s = float(self.connector_scheduler.decoder_kv_blocks_ttl)
        managed = self._retention.ledger.managed
        retain_s = clamp_retain_s(sent.get(RETAIN_S_KEY), ttl_s) if managed else ttl_s
        now_s = time.perf_counter()
        if retain_s < ttl_s:
            deadline = now_s + retain_s
            self.connector_scheduler._reqs_need_send[request.request_id] = deadline
            params["remote_blocks_expiry_time"] = deadline
        self._retention.retain(
            request.request_id, num_blocks=sum(len(group) for group in block_ids),
            num_tokens=int(params.get("remote_num_tokens") or 0), now_s=now_s,
            retain_s=retain_s, value=sent.get(RETAIN_VALUE_KEY), url=sent.get(RETENTION_URL_KEY),
            curve=decode_curve(sent.get(RETURN_CURVE_KEY)),
            block_ids=tuple(int(b) for b in block_ids[0]) if len(block_ids) == 1 else ())

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
                                       block_size=self._block_size,
                                       retention=self._retention_mode()))
            return
        sent = request.kv_transfer_params or {}
        verified = sent.get(VERIFIED_TOKENS_KEY)
        params.update(kvrelay_keys(guard_version=GUARD_VERSION,
                                   verified_tokens=verified if isinstance(verified, int) else None))

    def _retention_mode(self) -> RetentionMode | None:
        """How this D keeps retained turns (``kvrelay_retention``); ``None`` off D."""
        if self._retention is None:
            return None
        return "managed" if self._retention.ledger.managed else "stock"

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


class _Retention:
    """The connector's retention on the scheduler thread: the ledger, vLLM's block pool, and
    the sync thread's client (module docstring, "Retention")."""

    def __init__(self, ledger: RetentionLedger, client: RetentionSyncClient,
                 engine: Engine, *, num_kv_cache_groups: int = 1) -> None:
        self.ledger = ledger
        self.client = client
        self.engine = engine
        self.num_kv_cache_groups = num_kv_cache_groups
        self.block_pool: Any = None
        self.watermark_blocks = 0

    def _free_blocks(self) -> int:
        return int(self.block_pool.get_num_free_blocks()) if self.block_pool is not None else 0

    def retain(self, request_id: str, *, num_blocks: int, num_tokens: int, now_s: float,
               retain_s: float, value: object, url: object,
               curve: ReturnCurve | None = None, block_ids: tuple[int, ...] = ()) -> None:
        known_url = url if isinstance(url, str) and self.client.add_url(url) else None
        worth = float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value) else 0.0
        self.ledger.retain(request_id, num_blocks=num_blocks, num_tokens=num_tokens,
                           now_s=now_s, retain_s=retain_s, value=worth, url=known_url,
                           curve=curve,
                           block_ids=block_ids if self.num_kv_cache_groups == 1 else ())
        self._publish(urgent=False)

    def _holders(self) -> _PoolHolders | None:
        """D's holder counts for shared blocks (``core.retention``, "Shared blocks"); with
        several KV cache groups, none (a turn's blocks all count)."""
        if self.block_pool is None or self.num_kv_cache_groups != 1:
            return None
        return _PoolHolders(self.block_pool.blocks)

    def waits_for_release(self, request: Any, num_computed_tokens: int) -> bool:
        """Whether a waiting request should wait for retained blocks being freed for it
        (asking for them when it does not fit). ``num_computed_tokens``: its local
        prefix-cache hit, as vLLM's scheduler found it (``get_num_new_matched_tokens``)."""
        if self.block_pool is None or not self.ledger.managed:
            return False
        now_s = time.perf_counter()
        self._apply_orders()
        num_tokens, block_size = int(request.num_tokens), self.engine.block_size
        num_hit_blocks = max(0, int(num_computed_tokens)) // block_size
        free = self._free_blocks()
        needed = blocks_needed(num_tokens, block_size, self.watermark_blocks,
                               num_hit_blocks=num_hit_blocks)
        if needed > free:  # counting every hit block as free ones: look closer
            needed = blocks_needed(num_tokens, block_size, self.watermark_blocks,
                                   num_hit_blocks=num_hit_blocks,
                                   num_free_hit_blocks=self._free_hits(request, num_hit_blocks))
        if needed <= free or needed > self.engine.num_blocks_total:
            return False
        release = self.ledger.ask_under_pressure(num_blocks_free=free,
                                                 num_blocks_needed=needed, now_s=now_s,
                                                 holders=self._holders())
        if release.request_ids:
            logger.info("kvrelay: request %s needs %d blocks, %d free: asking to release %s",
                        request.request_id, needed, free,
                        self.ledger.describe(release.request_ids, now_s))
            self._publish(urgent=True)
        return self.ledger.has_pending()

    def _free_hits(self, request: Any, num_hit_blocks: int) -> int | None:
        """Of a waiting request's first ``num_hit_blocks`` blocks (its local prefix-cache
        hit), how many sit in vLLM's free queue (reference count 0): admitting the request
        takes those off it. ``None`` (count them all) with several KV cache groups, whose
        blocks this does not look up."""
        if num_hit_blocks <= 0:
            return 0
        if self.num_kv_cache_groups != 1:
            return None
        hashes = list(request.block_hashes[:num_hit_blocks])
        free = num_hit_blocks - len(hashes)
        for block_hash in hashes:
            blocks = self.block_pool.get_cached_block(block_hash, [0])
            if not blocks or blocks[0].ref_cnt == 0:
                free += 1
        return free

    def frees_for_running(self) -> bool:
        """``has_pending_block_frees``: a running request cannot grow; ask for the least
        valuable retained turn unless a release is already under way."""
        if self.block_pool is None or not self.ledger.managed:
            return False
        self._apply_orders()
        if self.ledger.has_pending():
            return True
        free = self._free_blocks()
        now_s = time.perf_counter()
        release = self.ledger.ask_under_pressure(num_blocks_free=free,
                                                 num_blocks_needed=free + 1, now_s=now_s,
                                                 holders=self._holders())
        if not release.request_ids:
            return False
        logger.info("kvrelay: a running request needs a block: asking to release %s",
                    self.ledger.describe(release.request_ids, now_s))
        self._publish(urgent=True)
        return True

    def freed(self, request_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks (``finished_sending``)."""
        now_s = time.perf_counter()
        changed = False
        for request_id in request_ids:
            if request_id not in self.ledger:
                continue
            changed = True
            released = self.ledger.freed(request_id, now_s)
            if released is not None:
                logger.info("kvrelay: released retained request %s (%s)", request_id,
                            released.cause)
        if changed:
            self._publish(urgent=False)

    def step(self) -> list[str]:
        """Once per scheduler step: apply the routers' answers, give back turns no router
        answered for, ask over headroom; the ids to free now."""
        now_s = time.perf_counter()
        self._apply_orders()
        for request_id in self.ledger.time_out(now_s):
            logger.warning("kvrelay: no router answered the release of %s in time; kept",
                           request_id)
        asked = self.ledger.ask_over_headroom(num_blocks_total=self.engine.num_blocks_total,
                                              now_s=now_s, holders=self._holders())
        due = self.ledger.take_to_free()
        self._publish(urgent=bool(asked.request_ids))
        return due

    def _apply_orders(self) -> None:
        for answer in self.client.take_orders():
            self.ledger.take_curves(answer.orders.turn_curves)
            self.ledger.confirmed(answer.url, answer.orders.dropped)
            self.ledger.ordered(answer.orders.release)

    def _publish(self, *, urgent: bool) -> None:
        self.client.publish(self.ledger.view(self._free_blocks()), self.ledger.take_released(),
                            urgent=urgent)


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


class _PoolHolders:
    """``core.retention.BlockHolders`` read from vLLM's block pool, block by block as a
    release looks at them: ``KVCacheBlock.ref_cnt`` (vLLM does not count the null block's
    holders: it is never freed)."""

    NEVER_FREED = 1 << 30

    def __init__(self, blocks: Sequence[Any]) -> None:
        self._blocks = blocks

    def get(self, block_id: int, default: int, /) -> int:
        if not 0 <= block_id < len(self._blocks):
            return default
        block = self._blocks[block_id]
        return self.NEVER_FREED if block.is_null else int(block.ref_cnt)


def _bytes_per_block(kv_cache_config: Any) -> int:
    """KV bytes one block holds across layers (0 when the config does not tell)."""
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or ()
    total = sum(int(getattr(tensor, "size", 0) or 0) for tensor in tensors)
    return total // num_blocks if num_blocks > 0 else 0


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
