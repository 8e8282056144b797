"""``kvrelay tune`` end to end, minus the command line: load, model, recommend.

``load_retentions`` reads one or more files of one format (``trace``) into retentions
(``retention``), showing progress by bytes on long inputs. Turns must reach the builder in
time order within each conversation; a file that is not (or several files given out of
order, e.g. rotated turn logs) is read a second time into memory and sorted by arrival.
``analyze`` runs the model over the TTL grid and makes the recommendations
(``recommend``); ``TuneResult`` is what the report and the charts are drawn from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvrelay.tune.costsource import CostValues
from kvrelay.tune.kvbytes import KvSize
from kvrelay.tune.model import ModelParams, PinnedSeries, RetentionModel, TtlPoint
from kvrelay.tune.recommend import (
    DEFAULT_KNEE_FRACTION,
    BudgetStat,
    Recommendation,
    pull_threshold,
    recommend_ttl,
)
from kvrelay.tune.retention import RetentionBuilder, Retentions
from kvrelay.tune.trace import (
    DEFAULT_BLOCK_TOKENS,
    TraceFormatError,
    TraceOrderError,
    TraceTurn,
    detect_format,
    read_turns,
)

DEFAULT_TTLS_S: tuple[float, ...] = (
    30, 45, 60, 90, 120, 180, 300, 480, 600, 900, 1200, 1800, 2700, 3600, 7200,
)
#: Inputs smaller than this are read without a progress line.
PROGRESS_MIN_BYTES = 8 << 20


@dataclass(frozen=True)
class TraceSource:
    """Which files to read and how (``trace.read_turns``, ``retention.RetentionBuilder``)."""

    paths: tuple[Path, ...]
    fmt: str = "auto"
    time_unit_s: float | None = None
    block_tokens: int | None = None
    num_decode: int = 1
    decode_s_per_token: float = 0.0


@dataclass(frozen=True)
class LoadedTrace:
    retentions: Retentions
    fmt: str
    sorted_in_memory: bool


def load_retentions(source: TraceSource, progress: TextIO | None = None) -> LoadedTrace:
    """Read ``source`` into retentions (module docstring)."""
    if not source.paths:
        raise TraceFormatError("no input file")
    formats = {detect_format(p) if source.fmt == "auto" else source.fmt for p in source.paths}
    if len(formats) > 1:
        raise TraceFormatError(f"the inputs mix formats {sorted(formats)}")
    fmt = formats.pop()
    if len(source.paths) > 1 and fmt != "turnlog":
        raise TraceFormatError("several input files are read only for turn logs (rotated "
                               "files); concatenate a split trace into one file")
    block = source.block_tokens or DEFAULT_BLOCK_TOKENS.get(fmt, 16)
    if fmt == "csv":
        block = source.block_tokens or _csv_block_tokens(source.paths[0])

    def builder() -> RetentionBuilder:
        return RetentionBuilder(num_decode=source.num_decode,
                                decode_s_per_token=source.decode_s_per_token, block_tokens=block)

    try:
        b = builder().add_all(_turns(source, fmt, block, progress, "read trace", False))
        return LoadedTrace(b.finish(), fmt, False)
    except TraceOrderError:
        turns = list(_turns(source, fmt, block, progress, "read again to sort", True))
        turns.sort(key=lambda t: t.at_s)  # across files
        return LoadedTrace(builder().add_all(turns).finish(), fmt, True)


def _turns(
    source: TraceSource, fmt: str, block: int, progress: TextIO | None, label: str,
    sort: bool,
) -> Iterator[TraceTurn]:
    from kvrelay.display.progress import WorkProgress

    sizes = [p.stat().st_size if p.exists() else 0 for p in source.paths]
    total = sum(sizes)
    bar = (WorkProgress(label, total, "MB", progress, scale=1e6)
           if progress is not None and total >= PROGRESS_MIN_BYTES else None)
    done_before = 0
    try:
        for path, size in zip(source.paths, sizes, strict=True):
            offset = done_before

            def on_bytes(n: int, offset: int = offset) -> None:
                if bar is not None:
                    bar.advance_to(offset + n)

            yield from read_turns(path, fmt, time_unit_s=source.time_unit_s,
                                  block_tokens=block, on_bytes=on_bytes, sort=sort)
            done_before += size
    finally:
        if bar is not None:
            bar.close()


def _csv_block_tokens(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        header = f.readline()
    return DEFAULT_BLOCK_TOKENS["chat" if "chat_id" in header else "mooncake"]


@dataclass(frozen=True)
class Provision:
    """The shortest TTL reaching ``target_hit_rate`` and what it pins (``point``)."""

    target_hit_rate: float
    ttl_s: float | None
    point: TtlPoint | None


@dataclass(frozen=True)
class TuneResult:
    """Everything ``kvrelay tune`` reports (``report`` and ``charts`` draw it)."""

    fmt: str
    inputs: tuple[str, ...]
    num_turns: int
    num_conversations: int
    span_s: float
    gap_percentiles: dict[str, float]
    kv: KvSize
    costs: CostValues
    params: ModelParams
    num_decode_nodes: int
    points: tuple[TtlPoint, ...]
    ceiling: TtlPoint
    recommendation: Recommendation
    threshold_tokens: int | None
    provision: Provision | None
    series: PinnedSeries | None
    knee_fraction: float = DEFAULT_KNEE_FRACTION
    notes: tuple[str, ...] = field(default_factory=tuple)

    def point(self, ttl_s: float) -> TtlPoint | None:
        return next((p for p in self.points if p.ttl_s == ttl_s), None)

    def to_json(self) -> dict[str, object]:
        return {
            "format": self.fmt,
            "inputs": list(self.inputs),
            "turns": self.num_turns,
            "conversations": self.num_conversations,
            "followups": self.ceiling.followups,
            "span_s": self.span_s,
            "gap_percentiles_s": self.gap_percentiles,
            "kv_bytes_per_token": self.kv.bytes_per_token,
            "kv_formula": self.kv.formula,
            "costs": self.costs.to_json(),
            "model": {
                "router_margin_s": self.params.router_margin_s,
                "threshold_tokens": self.params.threshold_tokens,
                "pull_cost_factor": self.params.pull_cost_factor,
                "decode_nodes": self.num_decode_nodes,
                "knee_fraction": self.knee_fraction,
            },
            "ttls": [p.to_json() for p in self.points],
            "unlimited_ttl": {k: v for k, v in self.ceiling.to_json().items()
                              if k in ("hits", "pulls", "hit_rate", "pull_rate",
                                       "tokens_reused", "time_saved_s")},
            "recommendation": self.recommendation.to_json(),
            "threshold_tokens": self.threshold_tokens,
            "provision": None if self.provision is None else {
                "target_hit_rate": self.provision.target_hit_rate,
                "ttl_s": self.provision.ttl_s,
                "at_ttl": None if self.provision.point is None else self.provision.point.to_json(),
            },
            "pinned_over_time": None if self.series is None else {
                "ttl_s": self.series.ttl_s, "t_s": list(self.series.t_s),
                "gib": {n: list(v) for n, v in zip(self.series.nodes, self.series.gib,
                                                    strict=True)},
            },
            "notes": list(self.notes),
        }


def analyze(
    loaded: LoadedTrace,
    *,
    inputs: Sequence[str],
    kv: KvSize,
    costs: CostValues,
    params: ModelParams,
    ttls_s: Sequence[float] = DEFAULT_TTLS_S,
    budget_gib: float | None = None,
    budget_stat: BudgetStat = "peak",
    knee_fraction: float = DEFAULT_KNEE_FRACTION,
    target_hit_rate: float | None = 0.9,
    series_bins: int = 400,
) -> TuneResult:
    """Run the model over ``ttls_s`` and recommend (see ``recommend``)."""
    if not ttls_s or any(not (t > 0 and math.isfinite(t)) for t in ttls_s):
        raise ValueError("TTLs must be positive, finite seconds")
    if budget_gib is not None and budget_gib <= 0:
        raise ValueError("the KV budget must be positive")
    retentions = loaded.retentions
    model = RetentionModel(retentions, params)
    points = tuple(model.sweep(sorted(set(ttls_s))))
    ceiling = model.ceiling()
    rec = recommend_ttl(points, ceiling, budget_gib=budget_gib, budget_stat=budget_stat,
                        knee_fraction=knee_fraction)
    provision = None
    if target_hit_rate is not None:
        ttl = model.ttl_for_hit_rate(target_hit_rate)
        provision = Provision(target_hit_rate, ttl, model.at(ttl) if ttl is not None else None)
    series = model.series(rec.ttl_s, series_bins) if rec.ttl_s is not None else None
    notes: list[str] = []
    if loaded.sorted_in_memory:
        notes.append("The input was not in time order within each conversation; it was sorted "
                     "in memory.")
    return TuneResult(
        fmt=loaded.fmt,
        inputs=tuple(inputs),
        num_turns=retentions.num_turns,
        num_conversations=retentions.num_conversations,
        span_s=retentions.last_at_s - retentions.first_at_s,
        gap_percentiles=model.gap_percentiles(),
        kv=kv,
        costs=costs,
        params=params,
        num_decode_nodes=len(retentions.decode_names),
        points=points,
        ceiling=ceiling,
        recommendation=rec,
        threshold_tokens=pull_threshold(params),
        provision=provision,
        series=series,
        knee_fraction=knee_fraction,
        notes=tuple(notes),
    )
