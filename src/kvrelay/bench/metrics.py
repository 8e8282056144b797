"""Per-request records and what a benchmark reports about them (pure functions).

Definitions used throughout the reports:

* a turn *succeeded* when its ``error`` is ``None`` and it has a TTFT;
* distributions (``Dist``) are over succeeded turns; percentiles interpolate linearly
  between order statistics (numpy's default);
* ``hit_rate``: among succeeded turns numbered >= 2 whose decision is known, the fraction the
  router served with ``pull``; ``reuse_rate`` also counts ``direct``. ``None`` when no decision
  is known (a server that reports none);
* per context length, the *measured* turns only (the sweep's follow-ups);
* comparisons divide the p50 TTFTs of two modes: ``recompute/pull`` (how much slower the
  one-way baseline is) and ``pull/local`` (how far pull is from the local-cache lower bound).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TurnRecord:
    """One request of a benchmark run, as measured by the client (times in seconds)."""

    mode: str
    workload: str
    conversation_id: str
    turn: int
    context_tokens: int | None
    target_tokens: int
    measured: bool
    think_s: float
    sent_at_s: float
    prompt_tokens: int | None
    completion_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    action: str | None
    reason: str | None
    reused_tokens: int | None
    decision_source: str | None
    error: str | None
    released_cause: str | None = None
    """For reason ``released``: why D freed the blocks (pressure, headroom, router)."""
    tool_call: bool = False
    """The turn forced its answer to be a tool call (``TurnSpec.tool_call``)."""
    made_tool_call: bool = False
    """The answer was a tool call (a forced one cut off by ``max_tokens`` is not)."""
    after_tool_call: bool = False
    """The turn continued a tool call: the previous turn's answer was one (the harness came
    back with the tool's result); else it followed a reply to the user (or it is turn 1)."""

    @property
    def succeeded(self) -> bool:
        return self.error is None and self.ttft_s is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TurnRecord:
        """The record ``to_json`` wrote; a field missing from ``data`` is ``None``, or its
        default when it has one (records written before it existed)."""
        values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)
                                  if f.name in data or f.default is MISSING}
        return cls(**values)


@dataclass(frozen=True)
class Dist:
    """Summary of a sample."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist | None:
        xs = sorted(values)
        if not xs:
            return None
        return cls(len(xs), math.fsum(xs) / len(xs), percentile(xs, 50), percentile(xs, 90),
                   percentile(xs, 99), xs[0], xs[-1])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; ``ValueError`` if empty."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class ModeSummary:
    """What one mode's run amounts to (see the module docstring for each definition)."""

    mode: str
    workload: str
    turns: int
    errors: int
    ttft: Dist | None
    ttft_later_turns: Dist | None
    tpot: Dist | None
    e2e: Dist | None
    ttft_by_turn: dict[int, float]
    ttft_by_context: dict[int, Dist]
    hit_rate: float | None
    reuse_rate: float | None
    decided_later_turns: int
    actions: dict[str, int]
    reasons: dict[str, int]
    reused_tokens_mean: float | None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ttft_by_turn"] = {str(k): v for k, v in self.ttft_by_turn.items()}
        out["ttft_by_context"] = {str(k): asdict(v) for k, v in self.ttft_by_context.items()}
        return out


def summarize(mode: str, workload: str, records: Sequence[TurnRecord]) -> ModeSummary:
    """The ``ModeSummary`` of ``records`` (all of one mode and workload)."""
    ok = [r for r in records if r.succeeded]
    later = [r for r in ok if r.turn >= 2]
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(_ttft(r))
    by_context: dict[int, list[float]] = {}
    for r in ok:
        if r.measured and r.context_tokens is not None:
            by_context.setdefault(r.context_tokens, []).append(_ttft(r))
    decided = [r for r in later if r.action is not None]
    actions = Counter(r.action for r in ok if r.action is not None)
    reasons = Counter(r.reason for r in ok if r.reason is not None)
    reused = [r.reused_tokens for r in decided if r.reused_tokens is not None]
    return ModeSummary(
        mode=mode,
        workload=workload,
        turns=len(records),
        errors=sum(1 for r in records if not r.succeeded),
        ttft=Dist.of(_ttft(r) for r in ok),
        ttft_later_turns=Dist.of(_ttft(r) for r in later),
        tpot=Dist.of(r.tpot_s for r in ok if r.tpot_s is not None),
        e2e=Dist.of(r.e2e_s for r in ok),
        ttft_by_turn={t: math.fsum(v) / len(v) for t, v in sorted(by_turn.items())},
        ttft_by_context={c: d for c, v in sorted(by_context.items()) if (d := Dist.of(v))},
        hit_rate=_fraction(decided, ("pull",)),
        reuse_rate=_fraction(decided, ("pull", "direct")),
        decided_later_turns=len(decided),
        actions=dict(sorted(actions.items())),
        reasons=dict(sorted(reasons.items())),
        reused_tokens_mean=math.fsum(reused) / len(reused) if reused else None,
    )


def _ttft(r: TurnRecord) -> float:
    assert r.ttft_s is not None
    return r.ttft_s


def _fraction(records: Sequence[TurnRecord], actions: tuple[str, ...]) -> float | None:
    if not records:
        return None
    return sum(1 for r in records if r.action in actions) / len(records)


@dataclass(frozen=True)
class Comparison:
    """``numerator`` mode's p50 TTFT divided by ``denominator``'s: per context length
    (measured turns) and over all turns numbered >= 2 (``overall``)."""

    numerator: str
    denominator: str
    by_context: dict[int, float]
    overall: float | None

    @property
    def label(self) -> str:
        return f"{self.numerator}/{self.denominator}"

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "numerator": self.numerator,
                "denominator": self.denominator, "overall": self.overall,
                "by_context": {str(k): v for k, v in self.by_context.items()}}


#: The ratios the issue asks for, when both modes ran.
STANDARD_RATIOS: tuple[tuple[str, str], ...] = (("recompute", "pull"), ("pull", "local"))


def compare(
    summaries: Mapping[str, ModeSummary],
    pairs: Sequence[tuple[str, str]] = STANDARD_RATIOS,
) -> list[Comparison]:
    """The ``pairs`` ratios whose two modes are both in ``summaries``."""
    out: list[Comparison] = []
    for num, den in pairs:
        a, b = summaries.get(num), summaries.get(den)
        if a is None or b is None:
            continue
        by_context = {
            c: a.ttft_by_context[c].p50 / b.ttft_by_context[c].p50
            for c in sorted(set(a.ttft_by_context) & set(b.ttft_by_context))
            if b.ttft_by_context[c].p50 > 0
        }
        overall = None
        if a.ttft_later_turns and b.ttft_later_turns and b.ttft_later_turns.p50 > 0:
            overall = a.ttft_later_turns.p50 / b.ttft_later_turns.p50
        out.append(Comparison(num, den, by_context, overall))
    return out
