"""A fake vLLM engine with NixlConnector (pull mode, bidirectional): state and lifecycle.

``FakeEngine`` owns one engine's KV cache, its held blocks, counters and request records and
its place on the in-process "NIXL" fabric (``kv``). The request path is built on top of it:
``generation`` (one request through the engine), ``requests`` (the OpenAI bodies it
accepts) and ``http`` (the API served on a ``Listener``). The engine knows its listener only
by that protocol, so nothing here imports the HTTP layer: ``http.http_listener`` is what
``cluster`` passes in. Lifecycle: ``start()``, ``stop()``, and the fault actions ``crash()``
(the process dies: listener gone, blocks gone, side channel unreachable) and ``restart()``
(crash, then start again on the same ports with a new engine id and empty caches and
counters, like a restarted vLLM process).

Most tests use ``FakeCluster`` instead of building engines by hand.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvrelay.fakevllm.config import FakeEngineConfig, RequestRecord
from kvrelay.fakevllm.faults import Faults
from kvrelay.fakevllm.kv import (
    BlockPool,
    FreedRead,
    Hold,
    HoldTable,
    KVFabric,
    KVReadError,
    KVReadResult,
)
from kvrelay.fakevllm.latency import Clock, Sleep
from kvrelay.fakevllm.metrics import EngineMetrics, render_metrics
from kvrelay.fakevllm.model import FakeModel
from kvrelay.fakevllm.report import Reporter
from kvrelay.fakevllm.retention import Retention
from kvrelay.fakevllm.scheduler import Scheduler
from kvrelay.fakevllm.sync import Syncer


class Listener(Protocol):
    """Where an engine serves its API (``server.HttpServer`` serving ``http.build_app``):
    ``port=0`` binds a free port on the first ``start`` and keeps it across restarts; ``stop``
    dies like a killed process (listener closed, connections reset, requests cancelled)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    async def start(self) -> int: ...

    async def stop(self) -> None: ...

    async def kill_connection(self, client: object) -> bool: ...


Listen = Callable[["FakeEngine"], Listener]
"""Makes an engine's listener (called once, by ``FakeEngine.__init__``)."""


@dataclass(frozen=True)
class Received:
    """A request body the engine's API read (generation, ``/tokenize``, ``/fake/faults``), as
    it arrived: what a router sent this engine."""

    method: str
    path: str
    body: bytes


class EngineState:
    """Everything a restart wipes: engine id, KV cache, holds, the block scheduler (waiting
    queue), kvrelay's retention and its sync, counters, prefill queue, pending reports."""

    def __init__(
        self, engine_id: str, config: FakeEngineConfig, clock: Clock, sleep: Sleep
    ) -> None:
        self.engine_id = engine_id
        self._clock = clock
        self.pool = BlockPool(
            config.num_gpu_blocks, config.block_size, config.enable_prefix_caching
        )
        self.holds = HoldTable(self.pool, clock, remember_expired=config.records_limit)
        self.retention: Retention | None = None
        self.syncer: Syncer | None = None
        if config.managed_retention:
            self.retention = Retention(
                self.pool, self.holds, clock, headroom=config.retention_headroom,
                bytes_per_block=config.kv_bytes_per_token * config.block_size)
            if config.retention_sync:
                self.syncer = Syncer(self.retention, engine_id, clock=clock, tick=self.reap,
                                     allowed_hosts=config.report_hosts)
        retention = self.retention
        self.scheduler = Scheduler(
            self.pool, tick=self.reap,
            relieve=retention.relieve if retention is not None else None,
            pending=retention.has_pending if retention is not None else None)
        self.freed_reads: deque[FreedRead] = deque(maxlen=config.records_limit)
        self.reporter = Reporter(config.report_hosts, config.report_delay_s, sleep)
        self.metrics = EngineMetrics()
        limit = config.latency.max_concurrent_prefills
        self.prefill_slots: asyncio.Semaphore | None = (
            asyncio.Semaphore(limit) if limit is not None else None
        )
        self.prefill_waiting = 0

    @property
    def running(self) -> int:
        """Requests holding blocks and running (``vllm:num_requests_running``)."""
        return self.scheduler.num_running

    @property
    def waiting(self) -> int:
        """Requests waiting for blocks or for a prefill slot (``vllm:num_requests_waiting``)."""
        return self.scheduler.num_waiting + self.prefill_waiting

    def reap(self) -> list[Hold]:
        """Release what expired: retained turns past their deadline (kvrelay's retention;
        asks a router left unanswered are given up), then holds past their lease or TTL.
        Both count as vLLM's expired send leases: a turn's deadline is its lease's end (the
        connector shortens the lease)."""
        if self.retention is not None:
            now = self._clock()
            released = self.retention.expire(now)
            self.metrics.nixl_kv_expired_reqs += len(released.request_ids)
            self.retention.time_out(now)
        expired = self.holds.reap()
        self.metrics.nixl_kv_expired_reqs += len(expired)
        return expired

    async def close(self) -> None:
        """The process died: nothing waits, syncs or reports any more."""
        self.scheduler.close()
        if self.syncer is not None:
            await self.syncer.close()
        await self.reporter.close()


class FakeEngine:
    """One fake engine. P or D is only a label: like vLLM, roles follow each request's params.

    ``faults`` holds the runtime fault knobs; ``records`` the last ``records_limit`` requests
    (see ``RequestRecord``); ``record(id)`` finds one by response id or internal request id;
    ``freed_reads`` lists reads other engines made of blocks this engine had already freed.
    ``num_health_requests`` counts ``GET /health`` requests answered since the engine object
    was made (restarts included), so a test can tell how often a router probed it;
    ``received`` keeps the last ``records_limit`` request bodies it read (restarts included),
    so a test can tell what reached it (faulted and hung requests included).
    """

    def __init__(
        self,
        name: str,
        config: FakeEngineConfig,
        model: FakeModel,
        fabric: KVFabric,
        listen: Listen,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        side_channel_host: str = "127.0.0.1",
        side_channel_port: int = 5600,
        engine_ids: Callable[[], str] | None = None,
    ) -> None:
        self.name = name
        self._engine_ids = engine_ids
        self.config = config
        self.model = model
        self.fabric = fabric
        self.clock = clock
        self._sleep = sleep
        self.faults = Faults()
        self.num_health_requests = 0
        self.received: deque[Received] = deque(maxlen=config.records_limit)
        self.side_channel_host = side_channel_host
        self.side_channel_port = side_channel_port
        self.incarnation = 0
        # Engine and request ids: random like vLLM's (a restarted process must not reuse an
        # engine id), or reproducible with ``deterministic_ids``.
        id_seed = f"{config.seed}:{name}:{self.side_channel_host}:{side_channel_port}"
        self.rng = random.Random(id_seed if config.deterministic_ids else None)
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()
        self._record_alias: dict[str, str] = {}
        self._state: EngineState | None = None
        self._listener = listen(self)
        self._background: set[asyncio.Task[Any]] = set()

    # -- identity ---------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._listener.host

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._state is not None

    @property
    def current_state(self) -> EngineState | None:
        """The live state, or ``None`` while stopped (a request compares it with the state
        it started in to tell that the engine crashed or restarted meanwhile)."""
        return self._state

    @property
    def state(self) -> EngineState:
        """The live state; ``RuntimeError`` while the engine is stopped or crashed."""
        if self._state is None:
            raise RuntimeError(f"fake engine {self.name} is not running")
        return self._state

    @property
    def engine_id(self) -> str:
        """NixlConnector's engine id (a new one after every restart)."""
        return self.state.engine_id

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start serving (no-op if running). Every start after the first is a restart."""
        if self._state is not None:
            return
        engine_id = self._engine_ids() if self._engine_ids is not None \
            else str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        state = EngineState(engine_id, self.config, self.clock, self._sleep)
        self.fabric.register(self.side_channel_host, self.side_channel_port, self)
        self._state = state
        try:
            await self._listener.start()
        except BaseException:
            self._state = None
            self.fabric.unregister(self.side_channel_host, self.side_channel_port, self)
            raise
        self.incarnation += 1

    async def stop(self) -> None:
        """Stop serving and drop all state (same as ``crash``; the name says it is intended)."""
        await self.crash()

    async def crash(self) -> None:
        """Die now: reset connections, cancel requests, lose every block, leave the fabric,
        drop pending reports."""
        state, self._state = self._state, None
        self.fabric.unregister(self.side_channel_host, self.side_channel_port, self)
        await self._listener.stop()
        if state is not None:
            await state.close()

    async def restart(self) -> None:
        """Crash, then start again on the same ports with a new engine id."""
        await self.crash()
        await self.start()

    async def pause(self, seconds: float) -> None:
        """Wait out simulated latency (skips the event loop round-trip for 0)."""
        if seconds > 0:
            await self._sleep(seconds)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a coroutine detached from any request (survives the request's cancellation)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def kill_connection(self, client: object) -> bool:
        """Drop one client connection (the ``die_after_tokens`` fault)."""
        return await self._listener.kill_connection(client)

    # -- records ----------------------------------------------------------------------------

    def add_record(self, record: RequestRecord) -> None:
        self._records[record.request_id] = record
        self._record_alias[record.internal_request_id] = record.request_id
        while len(self._records) > self.config.records_limit:
            _, old = self._records.popitem(last=False)
            self._record_alias.pop(old.internal_request_id, None)

    @property
    def records(self) -> list[RequestRecord]:
        """Records of the latest requests, oldest first."""
        return list(self._records.values())

    def record(self, request_id: str) -> RequestRecord:
        """The record of a request by response id (``chatcmpl-...``) or internal request id
        (``remote_request_id``); ``KeyError`` if unknown or already dropped."""
        key = self._record_alias.get(request_id, request_id)
        return self._records[key]

    # -- KV peer (the side other engines read from) -----------------------------------------

    def kv_clock(self) -> float:
        return self.clock()

    def side_channel_reachable(self) -> bool:
        return self._state is not None and not self.faults.side_channel_unreachable

    def read_kv(self, request_id: str, block_ids: Sequence[int], reader: str) -> KVReadResult:
        state = self._state
        if state is None:
            raise KVReadError("unreachable", f"engine {self.name} is down")
        state.reap()
        self._check_readable(state, request_id)
        contents = tuple(state.pool.read(b) for b in block_ids)
        freed = not state.holds.release(request_id)
        if freed:
            # vLLM: "Potentially invalid KV blocks for unrecognized request ... were retrieved"
            state.metrics.nixl_notifications_after_expiry += 1
            state.freed_reads.append(
                FreedRead(request_id, tuple(block_ids), reader, contents, self.clock())
            )
        return KVReadResult(contents, freed)

    def begin_read(self, request_id: str) -> None:
        state = self._state
        if state is None:
            raise KVReadError("unreachable", f"engine {self.name} is down")
        state.reap()
        self._check_readable(state, request_id)
        state.holds.begin_read(request_id)

    def end_read(self, request_id: str) -> None:
        state = self._state
        if state is not None:
            state.holds.end_read(request_id)

    @staticmethod
    def _check_readable(state: EngineState, request_id: str) -> None:
        """Decline a read of blocks whose lease or TTL ran out, or that kvrelay's retention
        released (gone: declined as vLLM declines an expired lease)."""
        if state.holds.expired(request_id):
            raise KVReadError("expired", f"{request_id} on {state.engine_id} has expired")
        if state.holds.released(request_id):
            if state.retention is not None:
                state.retention.declined_reads += 1
            raise KVReadError("expired", f"{request_id} on {state.engine_id} was released")

    def notify_kv_done(self, request_id: str) -> None:
        state = self._state
        if state is None:
            return
        state.reap()
        if not state.holds.release(request_id):
            state.metrics.nixl_notifications_after_expiry += 1

    @property
    def freed_reads(self) -> list[FreedRead]:
        """Reads of blocks this engine no longer held for the request (latest last)."""
        return list(self.state.freed_reads)

    async def drain_reports(self) -> None:
        """Wait until every D-side report submitted so far was posted (tests)."""
        if self._state is not None:
            await self._state.reporter.drain()

    def held(self) -> list[Hold]:
        """Blocks currently held for remote reads (expired ones are released first)."""
        state = self.state
        state.reap()
        return state.holds.snapshot()

    # -- observability ----------------------------------------------------------------------

    @property
    def metrics(self) -> EngineMetrics:
        return self.state.metrics

    def metrics_text(self) -> str:
        state = self.state
        state.reap()
        return render_metrics(
            state.metrics,
            model_name=self.config.served_model_name,
            running=state.running,
            waiting=state.waiting,
            kv_cache_usage=state.pool.usage,
            num_preemptions=state.scheduler.num_preemptions,
            num_gpu_blocks=state.pool.num_blocks,
            block_size=state.pool.block_size,
        )

    def describe(self) -> dict[str, object]:
        """Addresses and identity, as printed by the CLI and served at ``/fake/info``."""
        return {
            "name": self.name,
            "url": self.url,
            "engine_id": self.engine_id if self._state is not None else None,
            "side_channel_host": self.side_channel_host,
            "side_channel_port": self.side_channel_port,
            "incarnation": self.incarnation,
        }
