"""N fake prefill and M fake decode engines in this process, on loopback ports.

    async with FakeCluster(num_prefill=1, num_decode=2, config=FakeEngineConfig()) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        ...  # talk HTTP to p.url / d.url; p.faults.hang = True; d.record(request_id)

Engines share one ``KVFabric`` (so D can pull from P and P from D), one ``FakeModel`` (the
first load in a process imports transformers, which takes seconds; later loads take
milliseconds; pass one in to share it) and one clock (pass a ``ManualClock`` to drive leases
and TTLs). Like kvrelay's real local cluster, P runs without prefix caching and D with it,
unless told otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from kvrelay.fakevllm.config import FakeEngineConfig, RequestRecord
from kvrelay.fakevllm.data_parallel import DataParallelFront
from kvrelay.fakevllm.engine import FakeEngine
from kvrelay.fakevllm.http import http_listener
from kvrelay.fakevllm.kv import KVFabric
from kvrelay.fakevllm.latency import Clock, Sleep
from kvrelay.fakevllm.model import FakeModel


class FakeCluster:
    """Start with ``async with`` (or ``await start()`` / ``await stop()``).

    ``base_port=None`` puts every engine on a free port; otherwise P ``i`` listens on
    ``base_port + i`` and D ``j`` on ``base_port + num_prefill + j``. Side channels are
    ``side_channel_base_port + k`` in the same order (skipping addresses already taken on a
    shared fabric). ``prefill_config`` / ``decode_config`` override ``config`` per role;
    when not given, ``config`` is used with ``enable_prefix_caching`` set from
    ``prefill_prefix_caching`` / ``decode_prefix_caching``.
    """

    def __init__(
        self,
        num_prefill: int = 1,
        num_decode: int = 1,
        config: FakeEngineConfig | None = None,
        *,
        prefill_config: FakeEngineConfig | None = None,
        decode_config: FakeEngineConfig | None = None,
        prefill_prefix_caching: bool = False,
        decode_prefix_caching: bool = True,
        model: FakeModel | None = None,
        model_dir: str | Path | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        fabric: KVFabric | None = None,
        host: str = "127.0.0.1",
        base_port: int | None = None,
        side_channel_base_port: int = 5600,
        decode_data_parallel: int = 1,
    ) -> None:
        if decode_data_parallel < 1:
            raise ValueError("decode_data_parallel must be at least 1")
        if num_prefill < 0 or num_decode < 0 or num_prefill + num_decode == 0:
            raise ValueError("a fake cluster needs at least one engine")
        base = config or FakeEngineConfig()
        self.prefill_config = prefill_config or replace(
            base, enable_prefix_caching=prefill_prefix_caching
        )
        self.decode_config = decode_config or replace(
            base, enable_prefix_caching=decode_prefix_caching
        )
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.model = model
        self.model_dir = model_dir
        self.clock = clock
        self.sleep = sleep
        self.fabric = fabric or KVFabric()
        self.host = host
        self.base_port = base_port
        self.side_channel_base_port = side_channel_base_port
        self.decode_data_parallel = decode_data_parallel
        self.prefill: list[FakeEngine] = []
        self.decode: list[FakeEngine] = []

    @property
    def engines(self) -> list[FakeEngine]:
        return [*self.prefill, *self.decode]

    @property
    def prefill_urls(self) -> list[str]:
        return [e.url for e in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        """One URL per D (the ranks of a data-parallel D share theirs)."""
        return list(dict.fromkeys(e.url for e in self.decode))

    @property
    def side_channels(self) -> list[str]:
        """``host:port`` of every engine's NIXL side channel (prefill first), as vLLM's
        ``remote_host``/``remote_port`` name them."""
        return [f"{e.side_channel_host}:{e.side_channel_port}" for e in self.engines]

    def describe(self) -> list[dict[str, object]]:
        """One line of facts per engine (name, url, engine id, side channel)."""
        return [e.describe() for e in self.engines]

    async def drain_reports(self) -> None:
        """Wait until every engine posted the D-side reports submitted so far."""
        for e in self.engines:
            await e.drain_reports()

    def engine(self, key: str) -> FakeEngine:
        """An engine by name (``prefill-0``), URL or current engine id."""
        for e in self.engines:
            if key in (e.name, e.url) or (e.running and e.engine_id == key):
                return e
        raise KeyError(key)

    def records(self, request_id: str) -> list[tuple[FakeEngine, RequestRecord]]:
        """Every engine's record of a request id (a router may reuse one id on P and D)."""
        out: list[tuple[FakeEngine, RequestRecord]] = []
        for e in self.engines:
            try:
                out.append((e, e.record(request_id)))
            except KeyError:
                continue
        return out

    async def start(self) -> FakeCluster:
        if self.engines:  # started before: bring stopped engines back (new engine ids)
            for e in self.engines:
                await e.start()
            return self
        if self.model is None:
            self.model = await asyncio.to_thread(FakeModel.load, self.model_dir)
        side_port = self.side_channel_base_port
        roles = [("prefill", self.num_prefill, self.prefill_config, self.prefill)]
        roles.append(("decode", self.num_decode, self.decode_config, self.decode))
        k = 0
        try:
            for role, count, cfg, bucket in roles:
                ranks = self.decode_data_parallel if role == "decode" else 1
                for i in range(count):
                    port = 0 if self.base_port is None else self.base_port + k
                    front = DataParallelFront(self.host, port, num_ranks=ranks,
                                              seed=_id_seed(cfg, role, i)) \
                        if ranks > 1 else None
                    for rank in range(ranks):
                        while self.fabric.is_taken(self.host, side_port):
                            side_port += 1
                        engine = FakeEngine(
                            f"{role}-{i}" if front is None else f"{role}-{i}.dp{rank}",
                            cfg,
                            self.model,
                            self.fabric,
                            http_listener(self.host, port) if front is None else front.listen(),
                            clock=self.clock,
                            sleep=self.sleep,
                            side_channel_host=self.host,
                            side_channel_port=side_port,
                            engine_ids=None if front is None
                            else functools.partial(front.engine_id, rank),
                        )
                        bucket.append(engine)
                        await engine.start()
                        side_port += 1
                    k += 1
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Stop every engine (abruptly: in-flight requests are cut)."""
        await asyncio.gather(*(e.stop() for e in self.engines), return_exceptions=True)

    async def __aenter__(self) -> FakeCluster:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _id_seed(config: FakeEngineConfig, role: str, index: int) -> str | None:
    """A data-parallel front's id seed: reproducible with ``deterministic_ids``, else random."""
    return f"{config.seed}:{role}-{index}:dp" if config.deterministic_ids else None
