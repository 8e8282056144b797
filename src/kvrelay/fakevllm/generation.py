"""One request through a fake engine: prefix cache, KV load, prefill, decode, finish.

``admit`` does what vLLM's scheduler and NixlConnector do before the first token: block
allocation for the prompt (``scheduler``: the request waits, first come first served, until
the blocks are there), local prefix-cache lookup, the connector's plan
(``connector.plan_kv``), the KV read over the in-process fabric (with the failure policy),
and the prefill. Each later token that crosses a block boundary takes one more block
(``Scheduler.grow``: kvrelay's retention releases first; else a running request is
preempted and recomputes when readmitted). ``admit`` returns
a ``Generation`` whose output is already determined by the effective context; the HTTP layer
streams it with ``tokens()`` and then calls ``finish()`` (hold/retain blocks, build the
response's ``kv_transfer_params``) or ``abort()``, and ``report()`` once the response is
complete (kvrelay's D-side report, see ``report``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from kvrelay.core.fingerprint import held_fingerprint
from kvrelay.core.guard import guard_params
from kvrelay.core.params import FINGERPRINT_KEY, GUARD_VERSION, RemoteBlocks
from kvrelay.core.report import report_body, report_target
from kvrelay.core.retention import RetainedTurn
from kvrelay.core.retention_sync import (
    RETAIN_S_KEY,
    RETAIN_VALUE_KEY,
    RETENTION_URL_KEY,
    RETURN_CURVE_KEY,
    clamp_retain_s,
)
from kvrelay.core.return_curve import decode_curve
from kvrelay.fakevllm.config import RequestRecord
from kvrelay.fakevllm.connector import KVPlan, kv_role, plan_kv
from kvrelay.fakevllm.engine import EngineState, FakeEngine
from kvrelay.fakevllm.kv import Hold, KVCacheFull, KVPeer, KVReadError, block_hashes
from kvrelay.fakevllm.model import generate_tokens
from kvrelay.fakevllm.report import ReportOutcome
from kvrelay.fakevllm.scheduler import Seat
from kvrelay.fakevllm.versions import with_registration_generation

#: vLLM's reader-side margin when declining a read of D's blocks that are about to expire.
KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S = 5.0


class KVLoadFailed(RuntimeError):
    """The KV read failed under ``kv_load_failure_policy: fail``: vLLM finishes the request
    with an error, which its API server turns into HTTP 500 (or an error chunk)."""


@dataclass(frozen=True)
class GenerationInput:
    """A parsed generation request."""

    endpoint: str
    request_id: str
    internal_request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: Mapping[str, object] | None
    seed: int | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Generation:
    """An admitted, prefilled request: output known, blocks allocated, not finished yet."""

    def __init__(
        self,
        engine: FakeEngine,
        state: EngineState,
        record: RequestRecord,
        seat: Seat,
        request_params: Mapping[str, object] | None,
    ) -> None:
        self.engine = engine
        self.state = state
        self.record = record
        self.seat = seat
        self.request_params = request_params
        self.external = 0
        self.output: list[int] = []
        self._done = False
        self._reported = False

    @property
    def blocks(self) -> list[int]:
        return self.seat.blocks

    @property
    def num_hit_blocks(self) -> int:
        return self.seat.num_hit_blocks

    async def tokens(self) -> AsyncIterator[int]:
        """Output tokens, the first at once (it comes out of prefill), then one per decode
        step (``decode_s_per_token`` + the ``slow_stream_s`` fault). Before each token the
        request's blocks must hold its KV (``_slot``)."""
        latency = self.engine.config.latency
        n = len(self.record.prompt_token_ids)
        for i, token in enumerate(self.output):
            delay = self.engine.faults.slow_stream_s + (latency.decode_s_per_token if i else 0.0)
            await self.engine.pause(delay)
            await self._slot(n + i)
            self.record.output_token_ids.append(token)
            yield token

    async def _slot(self, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` tokens (the step that samples the next token computes
        the KV of the previous one); after a preemption, recompute them when readmitted
        (and again if the request is preempted while it recomputes)."""
        while not self._done and self.engine.current_state is self.state:
            if not await self.state.scheduler.grow(self.seat, num_tokens):
                return
            self.record.num_preemptions = self.seat.num_preemptions
            st, bs = self.state, self.engine.config.block_size
            context = list(self.record.context_token_ids) + self.output
            first = self.seat.num_hit_blocks
            for i in range(first, num_tokens // bs):
                st.pool.write(self.seat.blocks[i], tuple(context[i * bs : (i + 1) * bs]))
            computed = num_tokens - first * bs
            self.record.computed_tokens += computed
            await self.engine.pause(self.engine.config.latency.prefill_s(computed, num_tokens))
            if not self.seat.preempted:
                return

    def finish(self) -> dict[str, object] | None:
        """Finish with ``length``: cache blocks, hold them as vLLM's ``request_finished``
        does, and return the response's ``kv_transfer_params`` (``None`` if none)."""
        if self._done:
            return self.record.kv_transfer_params
        self._done = True
        st, cfg, rec = self.state, self.engine.config, self.record
        st.scheduler.leave(self.seat)
        prompt = rec.prompt_token_ids
        bs = cfg.block_size
        num_computed = len(prompt) + len(self.output) - 1
        kv = list(rec.context_token_ids) + self.output[:-1]
        first_new = self.num_hit_blocks
        for i in range(first_new, len(self.blocks)):
            st.pool.write(self.blocks[i], tuple(kv[i * bs : (i + 1) * bs]))
        if cfg.enable_prefix_caching:
            all_tokens = list(prompt) + self.output
            for i, h in enumerate(block_hashes(all_tokens, bs, num_computed // bs)):
                if i >= first_new:
                    st.pool.cache(self.blocks[i], h)
        st.metrics.generation_tokens += len(self.output)
        st.metrics.record_finished("length")
        rec.finish_reason = "length"
        params: dict[str, object] | None = None
        if rec.kv_role == "prefill" or (rec.kv_role == "decode" and cfg.bidirectional_kv_xfer):
            on_p = rec.kv_role == "prefill"
            ttl = cfg.kv_lease_duration if on_p else cfg.decoder_kv_blocks_ttl
            now = self.engine.clock()
            expires_at = now + ttl
            managed = st.retention if not on_p else None
            deadline = expires_at
            if managed is not None:
                params_in = self.request_params or {}
                retain_s = clamp_retain_s(params_in.get(RETAIN_S_KEY), ttl)
                deadline = now + retain_s
                value = params_in.get(RETAIN_VALUE_KEY)
                url = params_in.get(RETENTION_URL_KEY)
                managed.retain(RetainedTurn(
                    request_id=rec.internal_request_id, num_blocks=len(self.blocks),
                    num_tokens=num_computed, retained_at_s=now, deadline_s=deadline,
                    value=_number(value),
                    curve=decode_curve(params_in.get(RETURN_CURVE_KEY)),
                    block_ids=tuple(self.blocks)),
                    url if isinstance(url, str) and url else None)
            st.holds.add(
                Hold(
                    rec.internal_request_id,
                    tuple(self.blocks),
                    num_computed,
                    deadline,
                    "prefill_lease" if on_p else "decode_ttl",
                    protect_reads=managed is not None,
                )
            )
            if managed is not None:
                managed.trim()
                if st.syncer is not None:
                    st.syncer.wake()
            kvrelay = cfg.kvrelay_connector
            params = RemoteBlocks(
                direction="prefill_to_decode" if on_p else "decode_to_prefill",
                block_ids=(tuple(self.blocks),),
                engine_id=st.engine_id,
                request_id=rec.internal_request_id,
                host=self.engine.side_channel_host,
                port=self.engine.side_channel_port,
                num_tokens=num_computed,
                tp_size=cfg.tp_size,
                dcp_size=cfg.dcp_size,
                pp_size=cfg.pp_size,
                remote_expiry_perf_counter_s=None if on_p else deadline,
                prefill_cached_tokens=(
                    rec.local_cache_hit_tokens + self.external if on_p else None
                ),
                guard_version=GUARD_VERSION if kvrelay else None,
                fingerprint=(
                    held_fingerprint(prompt, self.output, num_computed)
                    if kvrelay and not on_p else None
                ),
                block_size=bs if kvrelay and not on_p else None,
                verified_tokens=rec.verified_tokens if kvrelay and on_p else None,
                retention=None if on_p or not kvrelay else
                ("managed" if managed is not None else "stock"),
            ).to_json()
            if cfg.protocol.registration_generation:
                params = with_registration_generation(params, cfg.tp_size * cfg.pp_size)
        else:
            st.pool.free(self.blocks)
        rec.kv_transfer_params = params
        return params

    def abort(self, reason: str = "abort") -> None:
        """The request ended early (client gone, engine died): free blocks, hold nothing."""
        if self._done:
            return
        self._done = True
        self.state.scheduler.leave(self.seat)
        blocks, self.seat.blocks = self.seat.blocks, []
        self.state.pool.free(blocks)
        self.record.finish_reason = reason

    def report(self) -> None:
        """Send kvrelay's D-side report if the request's params ask for one; at most once,
        after ``finish()`` or ``abort()``, and never from a crashed engine."""
        if self._reported or not self._done:
            return
        self._reported = True
        target = report_target(self.request_params)
        if target is None or self.engine.current_state is not self.state:
            return
        url, turn_id = target
        rec = self.record
        body = report_body(
            turn_id, rec.kv_transfer_params, len(rec.prompt_token_ids), len(rec.output_token_ids)
        )
        rec.report = ReportOutcome(url, body)
        self.state.reporter.submit(rec.report)


def _number(value: object) -> float:
    """``kvrelay_retain_value`` as a float; 0 when absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value)


async def died_before_answering(engine: FakeEngine, gen: Generation, client: object) -> bool:
    """A non-streamed request under ``die_after_tokens``: produce ``k`` tokens, abort, report,
    reset the client's connection and return True (no answer is sent); False (nothing done)
    when the fault does not apply."""
    cut = engine.faults.cut_after(len(gen.output))
    if cut is None:
        return False
    produced = 0
    if cut:
        async for _ in gen.tokens():
            produced += 1
            if produced == cut:
                break
    gen.abort()
    gen.report()
    await engine.kill_connection(client)
    return True


async def admit(engine: FakeEngine, inp: GenerationInput) -> Generation:
    """Schedule, load KV and prefill one request. Waits for blocks (``scheduler``); raises
    ``KVLoadFailed`` (policy ``fail``), ``KVCacheFull`` (more blocks than the whole cache)
    or ``RuntimeError`` (engine not running)."""
    cfg = engine.config
    st = engine.state
    await engine.pause(cfg.latency.request_overhead_s)
    st.reap()
    prompt = inp.prompt_token_ids
    n, bs = len(prompt), cfg.block_size
    if _cdiv(n + inp.max_tokens - 1, bs) > st.pool.num_usable:
        raise KVCacheFull(
            f"{n} prompt + {inp.max_tokens} output tokens need "
            f"{_cdiv(n + inp.max_tokens - 1, bs)} KV blocks, the cache has {st.pool.num_usable}")
    # Full prompt blocks, hashed for the prefix cache; a hit covers at most n - 1 tokens.
    hashes = block_hashes(prompt, bs, n // bs) if cfg.enable_prefix_caching else []
    params = inp.kv_transfer_params
    if st.retention is not None and kv_role(params) == "decode" and params is not None:
        url = params.get(RETENTION_URL_KEY)
        if isinstance(url, str) and url:
            st.retention.add_url(url)
    seat = Seat(inp.internal_request_id, hashes[: (n - 1) // bs])
    await st.scheduler.admit(seat, n)
    if engine.current_state is not st:
        raise RuntimeError(f"fake engine {engine.name} restarted")
    hit_blocks = seat.blocks[: seat.num_hit_blocks]
    local_hit = len(hit_blocks) * bs
    guard = None
    if cfg.kvrelay_connector and params is not None and params.get(FINGERPRINT_KEY) is not None:
        guarded, guard = guard_params(
            params, prompt, threshold=cfg.kv_recompute_threshold, block_size=bs
        )
        params = guarded
    plan = plan_kv(
        params,
        n,
        local_hit,
        bidirectional=cfg.bidirectional_kv_xfer,
        recompute_threshold=cfg.kv_recompute_threshold,
    )
    record = RequestRecord(
        request_id=inp.request_id,
        internal_request_id=inp.internal_request_id,
        engine_id=st.engine_id,
        endpoint=inp.endpoint,
        kv_role=plan.role,
        prompt_token_ids=tuple(prompt),
        max_tokens=inp.max_tokens,
        plan=plan.reason,
        local_cache_hit_tokens=local_hit,
        guard=guard.reason if guard is not None else None,
        verified_tokens=guard.verified_tokens if guard is not None else None,
        request_kv_transfer_params=(
            dict(inp.kv_transfer_params) if inp.kv_transfer_params is not None else None
        ),
    )
    engine.add_record(record)
    gen = Generation(engine, st, record, seat, inp.kv_transfer_params)
    try:
        async with _prefill_slot(st):
            context = [t for b in hit_blocks for t in st.pool.read(b)]
            pulled = await _load(engine, st, record, plan, len(hit_blocks))
            gen.external = len(pulled)
            context.extend(pulled)
            context.extend(prompt[len(context) :])
            if local_hit + len(pulled) == n:
                context[-1] = prompt[-1]  # vLLM recomputes the last prompt token for logits
            computed = n - local_hit - len(pulled)
            record.computed_tokens = computed
            await engine.pause(cfg.latency.prefill_s(computed, n))
    except KVLoadFailed:
        gen.abort("error")
        gen.report()
        st.metrics.record_finished("error")
        raise
    except BaseException:
        gen.abort()
        gen.report()
        raise
    record.context_token_ids = tuple(context)
    st.metrics.record_prompt(n, local_hit, gen.external, cfg.enable_prefix_caching)
    for i in range(len(hit_blocks), n // bs):
        st.pool.write(gen.blocks[i], tuple(context[i * bs : (i + 1) * bs]))
        if hashes:
            st.pool.cache(gen.blocks[i], hashes[i])
    seed = cfg.seed if inp.seed is None else cfg.seed ^ (inp.seed * 0x9E3779B1)
    gen.output = generate_tokens(context, inp.max_tokens, seed, engine.model.answer_ids)
    seat.decoding = True
    return gen


@contextlib.asynccontextmanager
async def _prefill_slot(st: EngineState) -> AsyncIterator[None]:
    if st.prefill_slots is None:
        yield
        return
    st.prefill_waiting += 1
    try:
        await st.prefill_slots.acquire()
    finally:
        st.prefill_waiting -= 1
    try:
        yield
    finally:
        st.prefill_slots.release()


async def _load(
    engine: FakeEngine, st: EngineState, rec: RequestRecord, plan: KVPlan, num_hit_blocks: int
) -> list[int]:
    """Read the planned external tokens over the fabric; ``[]`` if none or recomputing."""
    src = plan.source
    if src is None:
        return []
    cfg = engine.config
    bs = cfg.block_size
    if plan.external_tokens == 0:
        # Nothing to read, but vLLM still notifies the holder, which frees its blocks. A
        # failed notification counts as a failed transfer; the request goes on.
        try:
            peer = engine.fabric.connect(src.host, src.port, src.engine_id)
        except KVReadError:
            st.metrics.nixl_failed_transfers += 1
            return []
        peer.notify_kv_done(src.request_id)
        rec.notified_engine = src.engine_id
        return []
    ext = plan.external_tokens
    local_hit = num_hit_blocks * bs
    num_local_blocks = _cdiv(local_hit + ext, bs) - num_hit_blocks
    group = src.block_ids[0]
    loop = asyncio.get_running_loop()
    started = loop.time()
    reading: KVPeer | None = None
    try:
        if len(group) < num_local_blocks:
            raise KVReadError(
                "block_mismatch",
                f"{num_local_blocks} blocks to load, the params list {len(group)}",
            )
        # vLLM end-trims the remote list to the local block count (_apply_prefix_caching).
        remote_ids = group[-num_local_blocks:]
        peer = engine.fabric.connect(src.host, src.port, src.engine_id)
        expiry = src.remote_expiry_perf_counter_s
        if (
            cfg.bidirectional_kv_xfer
            and expiry is not None
            and peer.kv_clock() + KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S >= expiry
        ):
            raise KVReadError("expired", f"{src.request_id} on {src.engine_id} has expired")
        peer.begin_read(src.request_id)
        reading = peer
        await engine.pause(cfg.latency.transfer_s(ext))
        peer = engine.fabric.connect(src.host, src.port, src.engine_id)
        result = peer.read_kv(src.request_id, remote_ids, st.engine_id)
        reading = None
    except KVReadError as exc:
        if exc.reason == "expired":
            st.metrics.nixl_kv_expired_reqs += 1
        else:
            st.metrics.nixl_failed_transfers += 1
        rec.load_failure = exc.reason
        if cfg.kv_load_failure_policy == "fail":
            raise KVLoadFailed(str(exc)) from exc
        rec.recomputed_after_failure = True
        return []
    finally:
        if reading is not None:
            reading.end_read(src.request_id)
    contents = result.contents
    flat: list[int] = []
    for content in contents:
        flat.extend(content[:bs])
        flat.extend([0] * (bs - min(len(content), bs)))  # never-written KV reads as zeros
    pulled = flat[:ext]
    st.metrics.record_transfer(
        loop.time() - started, len(remote_ids) * bs * cfg.kv_bytes_per_token
    )
    rec.pulled_tokens = ext
    rec.pulled_from_engine = src.engine_id
    rec.pulled_from_request = src.request_id
    rec.pulled_block_ids = tuple(remote_ids)
    rec.pulled_source_token_ids = tuple(pulled)
    rec.read_freed_blocks = result.freed
    return pulled
