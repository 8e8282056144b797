"""Replay a trace through the router on fake engines, time-scaled, and check ``kvrelay tune``.

``kvrelay bench replay --trace FILE --time-scale X --ttls 60,300,1200`` runs, for each TTL
``T`` (trace seconds), fresh fake engines and a fresh router, sends the trace's
conversations, and puts the measured follow-up hit rate (and pinned KV) beside what
``kvrelay tune``'s model predicts for the same trace (docs/tune.md, "Checking the model").

**Requests.** One conversation per trace session, sent with its own conversation id. Turn
1's prompt is a system message sized to the trace's ``input_length``; every later turn
re-sends the history (previous prompt + the answer the engine actually generated) plus a
user message sized so the prompt is ``input_length`` (or a one-line message when the trace's
prompt does not grow: the replay never sends less than the history). Answers are
``max_tokens = output_length`` (``ignore_eos``).

**Time.** Everything that is a duration in the trace is divided by ``X``: a conversation
starts ``(first arrival - trace start) / X`` after the run starts, and each follow-up is
sent ``gap / X`` after the previous answer ended, where ``gap`` is exactly what ``tune``
uses (arrival minus the previous arrival minus its modelled duration): the router sees the
trace's gaps, scaled, whatever the replayed turns' own durations.

**Scaled TTL.** The router's and D's clocks run in real seconds, so every setting that is a
duration is scaled too. With ``R`` the 5 s margin by which vLLM's reader (and the fake's)
declines D's blocks before their expiry, which cannot be scaled:

* D's ``decoder_kv_blocks_ttl`` and the router's ``--ttl-s``: ``T / X + R``;
* the router's ``ttl_safety_margin_s``: ``R + 10 / X`` and ``near_expiry_s``: ``15 / X``;

so the router pulls a follow-up whose gap is at most ``(T - 25) / X`` real seconds, as ``tune``
predicts for ``T`` with its default 25 s margin, and at that moment D still has more than
``R`` left (no read is declined). D keeps unpulled KV ``T / X + R`` real seconds:
``T + R * X`` in trace time, which the pinned-KV prediction for the fake D uses. The fake's
D report is sent at once (``--report-delay-s 0``) and ``--pull-cost-factor`` is tiny: the
replay checks the TTL model, not the cost model (``tune`` is run with the same factor).

**Pinned KV.** While a TTL runs, the router's ``/metrics`` (``kvrelay_router_retained_tokens``
summed over nodes, when the router exports it) and every fake D's
``vllm:kv_cache_usage_perc`` (x blocks x 128 tokens) are sampled; their time-weighted means
over the trace's span are compared with the model's (router view: an entry lives until its
conversation's next turn or the router's expiry; D view: block-rounded, ``T + R * X``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from kvrelay.bench.client import ChatClient, StatsDecisions
from kvrelay.bench.metrics import TurnRecord
from kvrelay.bench.progress import Progress
from kvrelay.bench.report import ModeRun
from kvrelay.bench.tokens import ChatMessage, CountTokens
from kvrelay.bench.workloads import (
    ConversationSpec,
    TurnSpec,
    Workload,
    WorkloadError,
    appending,
    fill_text,
    placeholder_answer,
)
from kvrelay.cluster.config import ClusterConfig
from kvrelay.cluster.fake_engines import FakeLatency
from kvrelay.core.conversation import DEFAULT_EXPIRY_SAFETY_MARGIN_S
from kvrelay.core.policy import PolicyConfig
from kvrelay.fakevllm.versions import VllmVersion
from kvrelay.tune.trace import TraceTurn

#: vLLM's (and the fake engine's) reader declines D's blocks this close to their expiry.
READER_MARGIN_S = 5.0
#: The router is told a pull always pays (the replay checks the TTL model only): fixed costs
#: it never learns from timings, under which any pull is cheaper than recomputing, and a pull
#: cost factor that the model's prediction applies too.
REPLAY_PULL_COST_FACTOR = 1e-6
REPLAY_FIXED_COSTS = "pull_fixed_s=1e-6,pull_s_per_token=1e-9"
FAKE_BLOCK_TOKENS = 128
RETAINED_GAUGE = "kvrelay_router_retained_tokens"
USAGE_GAUGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class ScaledSettings:
    """Real-time settings for trace TTL ``ttl_s`` at ``time_scale`` (module docstring)."""

    ttl_s: float
    time_scale: float
    engine_ttl_s: float
    ttl_safety_margin_s: float
    near_expiry_s: float

    @classmethod
    def for_ttl(cls, ttl_s: float, time_scale: float) -> ScaledSettings:
        if not ttl_s > 0 or not time_scale > 0:
            raise ValueError("TTL and time scale must be positive")
        return cls(
            ttl_s=ttl_s,
            time_scale=time_scale,
            engine_ttl_s=ttl_s / time_scale + READER_MARGIN_S,
            ttl_safety_margin_s=READER_MARGIN_S + DEFAULT_EXPIRY_SAFETY_MARGIN_S / time_scale,
            near_expiry_s=PolicyConfig().near_expiry_s / time_scale,
        )

    @property
    def d_pin_s(self) -> float:
        """How long (trace seconds) D keeps KV nobody pulled."""
        return self.engine_ttl_s * self.time_scale

    @property
    def router_expiry_s(self) -> float:
        """How long (trace seconds) after a turn the router forgets its entry."""
        return (self.engine_ttl_s - self.ttl_safety_margin_s) * self.time_scale


def conversations_of(turns: Sequence[TraceTurn]) -> list[list[TraceTurn]]:
    """The trace's sessions, in order of their first turn, each in time order."""
    by_key: dict[object, list[TraceTurn]] = {}
    for t in turns:
        by_key.setdefault(t.conversation, []).append(t)
    convs = [sorted(c, key=lambda t: t.at_s) for c in by_key.values()]
    convs.sort(key=lambda c: c[0].at_s)
    return convs


def trace_workload(
    turns: Sequence[TraceTurn],
    count: CountTokens,
    *,
    time_scale: float,
    decode_s_per_token: float = 0.0,
    max_conversations: int | None = None,
    salt: str = "",
    seed: int = 0,
) -> Workload:
    """The trace as a ``Workload`` (module docstring: requests and time)."""
    if not time_scale > 0:
        raise WorkloadError("--time-scale must be positive")
    convs = conversations_of(turns)[: max_conversations or None]
    if not convs:
        raise WorkloadError("the trace has no turns")
    t0 = convs[0][0].at_s
    specs: list[ConversationSpec] = []
    grown = 0
    answers: dict[int, str] = {}
    for index, conv in enumerate(convs):
        opening = f"[trace session {salt}-{seed}-{index}] "
        history: list[ChatMessage] = []
        turn_specs: list[TurnSpec] = []
        for k, t in enumerate(conv):
            if k == 0:
                build = appending((), "system", opening)
                message = build(_fill(build, count, t.input_tokens, index, k))[0]
                think = 0.0
            else:
                prev = conv[k - 1]
                out = max(1, prev.output_tokens)
                if out not in answers:
                    answers[out] = placeholder_answer(out, count)
                history.append({"role": "assistant", "content": answers[out]})
                build = appending(history, "user", "Next: ")
                if count(build("")) >= t.input_tokens:
                    grown += 1
                    message = build("go on.")[-1]
                else:
                    message = build(_fill(build, count, t.input_tokens, index, k))[-1]
                end = prev.at_s + prev.output_tokens * decode_s_per_token
                gap = t.gap_s if t.gap_s is not None else max(0.0, t.at_s - end)
                think = gap / time_scale
            history.append(message)
            turn_specs.append(TurnSpec((message,), max(1, t.output_tokens), think_s=think,
                                       target_tokens=t.input_tokens))
        specs.append(ConversationSpec(f"trace-{index}", tuple(turn_specs),
                                      start_s=(conv[0].at_s - t0) / time_scale))
    return Workload("replay", tuple(specs), concurrency=len(specs), params={
        "trace_conversations": len(specs), "time_scale": time_scale,
        "decode_s_per_token": decode_s_per_token, "prompts_longer_than_trace": grown,
        "salt": salt, "seed": seed,
    })


def _fill(
    build: Callable[[str], Sequence[ChatMessage]], count: CountTokens, target: int, index: int,
    k: int,
) -> str:
    try:
        return fill_text(build, count, target, random.Random(f"trace/{index}/{k}"))
    except WorkloadError:
        return ""


# -- sampling pinned KV during a run ------------------------------------------------------


@dataclass
class PinnedSamples:
    """``(seconds since the run started, tokens)`` samples of the router's gauge (``None``
    values when it does not export it) and of the fake D's held blocks."""

    router: list[tuple[float, float | None]] = field(default_factory=list)
    decode: list[tuple[float, float]] = field(default_factory=list)

    def router_available(self) -> bool:
        return any(v is not None for _, v in self.router)


def gauge_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric ``name`` in a Prometheus exposition, ``None`` if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    total: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total = (total or 0.0) + float(sample.value)
    return total


def time_weighted_mean(samples: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Mean over ``[start, end]`` of a sampled step function (each sample holds until the
    next), from the first sample on; ``nan`` without a sample before ``end``."""
    points = sorted((t, v) for t, v in samples if t < end)
    if not points or end <= start:
        return math.nan
    total = 0.0
    for i, (t, v) in enumerate(points):
        nxt = points[i + 1][0] if i + 1 < len(points) else end
        lo, hi = max(t, start), min(nxt, end)
        if hi > lo:
            total += v * (hi - lo)
    covered = end - max(start, points[0][0])
    return total / covered if covered > 0 else math.nan


async def sample_pinned(
    router_url: str, decode_urls: Sequence[str], num_blocks: int, started: float,
    samples: PinnedSamples, stop: asyncio.Event, interval_s: float,
    transport: Any = None,
) -> None:
    """Sample the gauges every ``interval_s`` until ``stop`` is set (``transport``: an
    ``httpx`` transport, for tests)."""
    import httpx

    async with httpx.AsyncClient(timeout=5.0, transport=transport) as http:
        while not stop.is_set():
            now = time.perf_counter() - started
            router: float | None = None
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await http.get(f"{router_url}/metrics")
                if resp.status_code == 200:
                    router = gauge_sum(resp.text, RETAINED_GAUGE)
            samples.router.append((now, router))
            held = 0.0
            for url in decode_urls:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    resp = await http.get(f"{url}/metrics")
                    usage = gauge_sum(resp.text, USAGE_GAUGE) if resp.status_code == 200 else None
                    held += (usage or 0.0) * (num_blocks - 1) * FAKE_BLOCK_TOKENS
            samples.decode.append((now, held))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


# -- one TTL ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayOptions:
    """How the runs are done (see ``run_trace_replay``)."""

    time_scale: float
    latency: FakeLatency = "fast"
    vllm_version: VllmVersion = "0.32"
    num_gpu_blocks: int = 1 << 16
    sample_interval_s: float = 0.25
    tenant: str = "default"
    id_prefix: str = ""
    extra_body: dict[str, object] | None = None
    timeout_s: float = 300.0
    progress: TextIO | None = None
    router_args: tuple[str, ...] = ()


@dataclass
class TtlRun:
    settings: ScaledSettings
    run: ModeRun
    samples: PinnedSamples


def run_ttl(
    workload: Workload, settings: ScaledSettings, base: ClusterConfig, run_dir: Path,
    options: ReplayOptions,
) -> TtlRun:
    """Fresh fake engines and router at ``settings``, the workload through them."""
    from kvrelay.cluster.config import router_command
    from kvrelay.cluster.fake_engines import fake_engine_options, fake_engine_process
    from kvrelay.cluster.launcher import ServiceProcess, free_port, free_port_block

    nodes = base.num_prefill + base.num_decode
    config = replace(base, base_port=free_port_block(nodes), bidirectional=True,
                     prefill_prefix_caching=False, decode_prefix_caching=True)
    engines = fake_engine_options(config, options.latency, ttl_s=settings.engine_ttl_s,
                                  num_gpu_blocks=options.num_gpu_blocks, report_delay_s=0.0,
                                  vllm_version=options.vllm_version)
    urls = engines.urls
    run_dir.mkdir(parents=True, exist_ok=True)
    router_toml = run_dir / "router.toml"
    router_toml.write_text(f"ttl_safety_margin_s = {settings.ttl_safety_margin_s!r}\n")
    port = free_port(config.host)
    router_url = f"http://{config.host}:{port}"
    prefill, decode = urls[: config.num_prefill], urls[config.num_prefill :]
    router_cmd = router_command(
        prefill, decode, host=config.host, port=port, ttl_s=settings.engine_ttl_s,
        kv_recompute_threshold=config.kv_recompute_threshold, internal_port=0,
        python=config.python,
        extra=["--log-level", "warning", "--config", str(router_toml),
               "--near-expiry-s", repr(settings.near_expiry_s),
               "--pull-cost-factor", repr(REPLAY_PULL_COST_FACTOR),
               "--fixed-costs", REPLAY_FIXED_COSTS, *options.router_args],
    )
    mode = f"ttl-{settings.ttl_s:g}s"
    info = {"ttl_s": settings.ttl_s, "time_scale": settings.time_scale,
            "engine_ttl_s": settings.engine_ttl_s,
            "ttl_safety_margin_s": settings.ttl_safety_margin_s,
            "near_expiry_s": settings.near_expiry_s, "num_prefill": config.num_prefill,
            "num_decode": config.num_decode, "run_dir": str(run_dir)}
    with fake_engine_process(engines, run_dir / "fake-engine.log", config.python), \
         ServiceProcess("router", router_cmd, [f"{router_url}/stats"],
                        run_dir / "router.log", 60.0):
        run, samples = asyncio.run(_bench(workload, mode, router_url, decode,
                                          engines.served_model_name, options, info))
    return TtlRun(settings, run, samples)


async def _bench(
    workload: Workload, mode: str, router_url: str, decode_urls: Sequence[str], model: str,
    options: ReplayOptions, info: dict[str, Any],
) -> tuple[ModeRun, PinnedSamples]:
    from kvrelay.bench.execute import run_workload

    samples = PinnedSamples()
    stop = asyncio.Event()
    started = time.perf_counter()
    sampler = asyncio.create_task(sample_pinned(
        router_url, decode_urls, options.num_gpu_blocks, started, samples, stop,
        options.sample_interval_s))
    progress = Progress(mode, workload.num_turns, options.progress)
    try:
        async with ChatClient(router_url, model, timeout_s=options.timeout_s,
                              stats=StatsDecisions(options.tenant),
                              extra_body=options.extra_body) as client:
            records = await run_workload(workload, client, mode=mode,
                                         id_prefix=f"{options.id_prefix}{mode}-",
                                         on_turn=progress.update)
    finally:
        progress.close()
        stop.set()
        await sampler
    return ModeRun(mode, records, {**info, "router_url": router_url, "model": model}), samples


# -- comparison with tune ----------------------------------------------------------------


@dataclass(frozen=True)
class TtlComparison:
    """One TTL's measured and predicted values (rates in [0, 1], tokens time-weighted)."""

    ttl_s: float
    followups: int
    measured_hit_rate: float | None
    predicted_hit_rate: float | None
    predicted_pull_rate: float | None
    failed_turns: int
    measured_router_tokens: float | None
    predicted_router_tokens: float
    measured_decode_tokens: float | None
    predicted_decode_tokens: float

    @property
    def hit_rate_error_pp(self) -> float | None:
        if self.measured_hit_rate is None or self.predicted_pull_rate is None:
            return None
        return 100 * (self.measured_hit_rate - self.predicted_pull_rate)

    def to_json(self) -> dict[str, object]:
        out = {k: (None if isinstance(v, float) and math.isnan(v) else v)
               for k, v in vars(self).items()}
        out["hit_rate_error_pp"] = self.hit_rate_error_pp
        return out


def measured_hit_rate(records: Sequence[TurnRecord]) -> tuple[int, float | None, int]:
    """Follow-ups (succeeded turns >= 2), the share P served from D's KV, failed turns."""
    followups = [r for r in records if r.turn >= 2 and r.succeeded]
    failed = sum(1 for r in records if not r.succeeded)
    if not followups:
        return 0, None, failed
    pulled = sum(1 for r in followups if r.action == "pull" and (r.reused_tokens or 0) > 0)
    return len(followups), pulled / len(followups), failed


def compare(
    runs: Sequence[TtlRun], turns: Sequence[TraceTurn], *, decode_s_per_token: float,
    threshold_tokens: int,
) -> list[TtlComparison]:
    """Measured vs ``tune``'s predictions for each run (module docstring)."""
    from kvrelay.tune.model import ModelParams, RetentionModel
    from kvrelay.tune.retention import RetentionBuilder

    def model(tokens_of: Callable[[TraceTurn], int] | None) -> RetentionModel:
        builder = RetentionBuilder(decode_s_per_token=decode_s_per_token)
        for t in sorted(turns, key=lambda t: t.at_s):
            builder.add(t if tokens_of is None else replace(t, retained_tokens=tokens_of(t)))
        params = ModelParams(kv_bytes_per_token=1.0, threshold_tokens=threshold_tokens,
                             pull_cost_factor=REPLAY_PULL_COST_FACTOR)
        return RetentionModel(builder.finish(), params)

    plain = model(None)
    held = model(lambda t: max(0, t.input_tokens + t.output_tokens - 1))
    blocks = model(lambda t: -(-max(0, t.input_tokens + t.output_tokens - 1)
                               // FAKE_BLOCK_TOKENS) * FAKE_BLOCK_TOKENS)
    span_real = (plain.last_at_s - plain.first_at_s)
    out: list[TtlComparison] = []
    for r in runs:
        s = r.settings
        point = plain.at(s.ttl_s)
        followups, rate, failed = measured_hit_rate(r.run.records)
        window = span_real / s.time_scale
        router = (time_weighted_mean([(t, v) for t, v in r.samples.router if v is not None],
                                     0.0, window) if r.samples.router_available() else None)
        decode = time_weighted_mean(r.samples.decode, 0.0, window) if r.samples.decode else None
        out.append(TtlComparison(
            ttl_s=s.ttl_s, followups=followups, measured_hit_rate=rate,
            predicted_hit_rate=point.hit_rate, predicted_pull_rate=point.pull_rate,
            failed_turns=failed,
            measured_router_tokens=router,
            predicted_router_tokens=held.mean_entry_tokens(s.router_expiry_s),
            measured_decode_tokens=decode,
            predicted_decode_tokens=blocks.mean_pinned_tokens(s.ttl_s, pin_s=s.d_pin_s),
        ))
    return out


def comparison_markdown(rows: Sequence[TtlComparison], time_scale: float) -> list[str]:
    lines = [
        f"## Replay vs `kvrelay tune` (time scale {time_scale:g})",
        "",
        "Hit rate: follow-ups P served from D's KV (measured) vs `tune`'s pull rate for the "
        "same trace and TTL. Pinned: time-weighted mean over the trace's span, all D's, in "
        "tokens (router: `" + RETAINED_GAUGE + "`; D: the fake D's held blocks x 128).",
        "",
        "| TTL (trace s) | follow-ups | measured hit rate | predicted | error (pp) | failed "
        "turns | router retained measured | predicted | D held measured | predicted | "
        "D error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in rows:
        d_err = (None if c.measured_decode_tokens is None or not c.predicted_decode_tokens
                 or math.isnan(c.measured_decode_tokens)
                 else 100 * (c.measured_decode_tokens / c.predicted_decode_tokens - 1))
        lines.append(
            f"| {c.ttl_s:g} | {c.followups} | {_pct(c.measured_hit_rate)} | "
            f"{_pct(c.predicted_pull_rate)} | {_num(c.hit_rate_error_pp, '+.2f')} | "
            f"{c.failed_turns} | {_num(c.measured_router_tokens, ',.0f', 'not exported')} | "
            f"{c.predicted_router_tokens:,.0f} | {_num(c.measured_decode_tokens, ',.0f')} | "
            f"{c.predicted_decode_tokens:,.0f} | {_num(d_err, '+.1f')}"
            f"{'' if d_err is None else '%'} |"
        )
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None, fmt: str, missing: str = "-") -> str:
    return missing if x is None or math.isnan(x) else format(x, fmt)


def run_trace_replay(
    workload: Workload, ttls_s: Sequence[float], base: ClusterConfig, run_dir: Path,
    options: ReplayOptions,
) -> list[TtlRun]:
    """One run per TTL, one after another (module docstring)."""
    out: list[TtlRun] = []
    for ttl in ttls_s:
        settings = ScaledSettings.for_ttl(ttl, options.time_scale)
        print(f"ttl {ttl:g} s (trace) at time scale {options.time_scale:g}: engines "
              f"{settings.engine_ttl_s:.3f} s, router margin "
              f"{settings.ttl_safety_margin_s:.3f} + {settings.near_expiry_s:.3f} s",
              file=options.progress or sys.stderr, flush=True)
        out.append(run_ttl(workload, settings, base, run_dir / f"ttl-{ttl:g}s", options))
    return out
