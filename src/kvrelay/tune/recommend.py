"""The recommendations: a TTL, a recompute threshold and the D memory for a target hit rate.

Rules (pure functions of the model's predictions; docs/tune.md):

* **TTL under a budget** (``--kv-budget-gib`` per D): of the grid TTLs whose pinned KV stays
  within the budget on every D (``peak``, or ``p95`` with ``--budget-stat p95``), the one
  that saves the most prefill time; ties (same time saved and pulls) go to the shorter TTL.
  A bigger budget admits more TTLs, so it never recommends a shorter one.
* **TTL without a budget** (the knee): the shortest grid TTL that saves at least
  ``knee_fraction`` (0.9) of what an unlimited TTL would save; past it, each extra second of
  TTL pins memory for ever fewer late follow-ups. Longer gaps push it to longer TTLs. When
  no pull pays at all, the same rule runs on the hit count.
* **Threshold**: the smallest reuse (tokens) whose pull the cost model predicts no slower
  than recomputing it (``pull_s * pull_cost_factor <= prefill_s``, the router's rule).
  Prefill is convex in the tokens and a pull linear, so once a pull pays it pays for every
  larger reuse: a binary search finds the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvrelay.tune.model import ModelParams, TtlPoint

BudgetStat = Literal["peak", "p95"]
DEFAULT_KNEE_FRACTION = 0.9


@dataclass(frozen=True)
class Recommendation:
    """The recommended TTL (``None``: nothing fits) and why."""

    ttl_s: float | None
    rule: Literal["budget", "knee"]
    reasoning: tuple[str, ...]
    budget_gib: float | None = None
    budget_stat: BudgetStat = "peak"

    def to_json(self) -> dict[str, object]:
        return {"ttl_s": self.ttl_s, "rule": self.rule, "reasoning": list(self.reasoning),
                "budget_gib": self.budget_gib, "budget_stat": self.budget_stat}


def pinned_gib(point: TtlPoint, stat: BudgetStat) -> float:
    """The most pinned KV on any D at ``point`` by ``stat``."""
    return point.peak_gib if stat == "peak" else point.p95_gib


def recommend_ttl(
    points: Sequence[TtlPoint],
    ceiling: TtlPoint,
    *,
    budget_gib: float | None = None,
    budget_stat: BudgetStat = "peak",
    knee_fraction: float = DEFAULT_KNEE_FRACTION,
) -> Recommendation:
    """The TTL the module docstring's rules pick from ``points`` (any order)."""
    if not points:
        raise ValueError("no TTL to choose from")
    if not 0 < knee_fraction <= 1:
        raise ValueError("knee_fraction must be in (0, 1]")
    grid = sorted(points, key=lambda p: p.ttl_s)
    if budget_gib is not None:
        return _under_budget(grid, ceiling, budget_gib, budget_stat)
    return _knee(grid, ceiling, knee_fraction)


def _under_budget(
    grid: list[TtlPoint], ceiling: TtlPoint, budget: float, stat: BudgetStat
) -> Recommendation:
    fits = [p for p in grid if pinned_gib(p, stat) <= budget]
    if not fits:
        low = grid[0]
        return Recommendation(None, "budget", (
            f"No TTL of the grid fits {budget:g} GiB per D: even {format_ttl(low.ttl_s)} pins "
            f"{pinned_gib(low, stat):.2f} GiB ({stat}) on the busiest D.",
            "Give D more memory for retention, try shorter TTLs (--ttls), or spread the "
            "conversations over more D's (--decode).",
        ), budget, stat)
    best = max(fits, key=lambda p: (p.time_saved_s, p.pulls, -p.ttl_s))
    lines = [
        f"TTL {format_ttl(best.ttl_s)} saves the most prefill time within {budget:g} GiB per D "
        f"({stat}): {best.time_saved_s:.1f} s ({_share(best.time_saved_s, ceiling)} of what an "
        f"unlimited TTL would save), hit rate {_pct(best.hit_rate)}, pinned {stat} "
        f"{pinned_gib(best, stat):.2f} GiB on the busiest D.",
    ]
    longer = [p for p in grid if p.ttl_s > best.ttl_s]
    if longer:
        nxt = longer[0]
        if pinned_gib(nxt, stat) > budget:
            lines.append(
                f"The next TTL, {format_ttl(nxt.ttl_s)}, would pin {pinned_gib(nxt, stat):.2f} GiB "
                f"({stat}), over the budget, for {_delta(nxt.time_saved_s - best.time_saved_s)} "
                "more saved."
            )
        else:
            lines.append(f"Longer TTLs up to {format_ttl(longer[-1].ttl_s)} save no more.")
    return Recommendation(best.ttl_s, "budget", tuple(lines), budget, stat)


def _knee(grid: list[TtlPoint], ceiling: TtlPoint, fraction: float) -> Recommendation:
    by_time = ceiling.time_saved_s > 0
    total = ceiling.time_saved_s if by_time else float(ceiling.hits)
    measure = "prefill time saved" if by_time else "follow-up hits (no pull pays)"

    def value(p: TtlPoint) -> float:
        return p.time_saved_s if by_time else float(p.hits)

    if total <= 0:
        return Recommendation(None, "knee", (
            "No follow-up can reuse retained KV in this trace (no follow-ups, or none after "
            "a turn that retained KV): retention only pins memory.",
        ))
    reached = [p for p in grid if value(p) >= fraction * total]
    if not reached:
        top = grid[-1]
        return Recommendation(top.ttl_s, "knee", (
            f"Even the longest TTL of the grid, {format_ttl(top.ttl_s)}, reaches only "
            f"{value(top) / total:.0%} of the {measure} of an unlimited TTL (target "
            f"{fraction:.0%}); extend --ttls to find the knee.",
        ))
    best = reached[0]
    lines = [
        f"TTL {format_ttl(best.ttl_s)} is the shortest TTL of the grid reaching "
        f"{fraction:.0%} of the {measure} an unlimited TTL would give "
        f"({value(best) / total:.1%}): hit rate {_pct(best.hit_rate)}, "
        f"{best.time_saved_s:.1f} s of prefill saved, pinned peak {best.peak_gib:.2f} GiB "
        f"(p95 {best.p95_gib:.2f} GiB) on the busiest D.",
    ]
    longer = [p for p in grid if p.ttl_s > best.ttl_s]
    if longer:
        top = longer[-1]
        more = (value(top) - value(best)) / total
        lines.append(f"Going to {format_ttl(top.ttl_s)} would add {more:.1%} of the {measure} "
                     f"for a pinned peak of {top.peak_gib:.2f} GiB.")
    return Recommendation(best.ttl_s, "knee", tuple(lines))


def pull_threshold(params: ModelParams, max_tokens: int = 1 << 22) -> int | None:
    """The smallest reuse whose pull pays (module docstring); ``None`` if none up to
    ``max_tokens`` does."""
    if not params.pull_pays(max_tokens):
        return None
    lo, hi = 1, max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if params.pull_pays(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def format_ttl(ttl_s: float) -> str:
    """A TTL for people: 90 s, 5 min, 2 h."""
    if ttl_s >= 3600 and ttl_s % 3600 == 0:
        return f"{ttl_s / 3600:g} h"
    if ttl_s >= 120 and ttl_s % 60 == 0:
        return f"{ttl_s / 60:g} min"
    return f"{ttl_s:g} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _share(saved: float, ceiling: TtlPoint) -> str:
    return f"{saved / ceiling.time_saved_s:.0%}" if ceiling.time_saved_s > 0 else "-"


def _delta(seconds: float) -> str:
    return f"{seconds:.1f} s"
