"""PNG charts of a ``kvrelay tune`` result (matplotlib, Agg, the bench charts' house style).

* ``tune_hit_rate_vs_ttl.png``: follow-up hit rate and pull rate (left axis, %) and pinned KV
  on the busiest D, peak and p95 (right axis, GiB), against D's TTL on a log axis; the
  recommended TTL as a vertical line, the budget (if any) as a horizontal one.
* ``tune_time_saved_vs_ttl.png``: predicted prefill time saved against TTL, with what an
  unlimited TTL would save (and the knee fraction of it) as horizontal lines.
* ``tune_pinned_over_time.png``: pinned KV per D over the trace at the recommended TTL (the
  highest level in each time bin), with the budget.
"""

from __future__ import annotations

from pathlib import Path

from kvrelay.display.figures import finish_figure, new_figure
from kvrelay.tune.analyze import TuneResult
from kvrelay.tune.model import PinnedSeries
from kvrelay.tune.recommend import format_ttl


def write_charts(result: TuneResult, out_dir: Path) -> list[Path]:
    """Draw the charts that apply to ``result`` into ``out_dir``; returns their paths."""
    out = [hit_rate_vs_ttl(result, out_dir / "tune_hit_rate_vs_ttl.png"),
           time_saved_vs_ttl(result, out_dir / "tune_time_saved_vs_ttl.png")]
    if result.series is not None:
        out.append(pinned_over_time(result.series, result.recommendation.budget_gib,
                                    out_dir / "tune_pinned_over_time.png"))
    return out


def hit_rate_vs_ttl(result: TuneResult, path: Path) -> Path:
    fig, ax = new_figure()
    ttls = [p.ttl_s for p in result.points]
    ax.plot(ttls, [100 * (p.hit_rate or 0) for p in result.points], "o-", label="hit rate")
    ax.plot(ttls, [100 * (p.pull_rate or 0) for p in result.points], "s--", label="pull rate")
    ax.set_xscale("log")
    ax.set_xlabel("D's TTL (decoder_kv_blocks_ttl, s, log scale)")
    ax.set_ylabel("follow-ups (%)")
    ax.set_ylim(0, 105)
    mem = ax.twinx()
    mem.plot(ttls, [p.peak_gib for p in result.points], "^-", color="tab:red",
             label="pinned peak (busiest D)")
    mem.plot(ttls, [p.p95_gib for p in result.points], "v:", color="tab:purple",
             label="pinned p95 (busiest D)")
    budget = result.recommendation.budget_gib
    if budget is not None:
        mem.axhline(budget, color="tab:red", linestyle="-.", alpha=0.6,
                    label=f"budget {budget:g} GiB")
    mem.set_ylabel("pinned KV per D (GiB)")
    mem.set_ylim(bottom=0)
    rec = result.recommendation.ttl_s
    if rec is not None:
        ax.axvline(rec, color="gray", linestyle="--", alpha=0.7)
        ax.annotate(f"recommended {format_ttl(rec)}", (rec, 0.5), xytext=(4, 0),
                    xycoords=ax.get_xaxis_transform(), textcoords="offset points",
                    fontsize=8, color="gray")
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = mem.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=8, loc="lower right")
    ax.set_title("Follow-up hit rate and pinned D memory vs TTL")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def time_saved_vs_ttl(result: TuneResult, path: Path) -> Path:
    fig, ax = new_figure()
    ttls = [p.ttl_s for p in result.points]
    ax.plot(ttls, [p.time_saved_s for p in result.points], "o-", label="prefill time saved")
    ceiling = result.ceiling.time_saved_s
    if ceiling > 0:
        ax.axhline(ceiling, color="gray", linestyle=":", label="unlimited TTL")
        ax.axhline(result.knee_fraction * ceiling, color="gray", linestyle="--", alpha=0.6,
                   label=f"{result.knee_fraction:.0%} of unlimited")
    rec = result.recommendation.ttl_s
    if rec is not None:
        ax.axvline(rec, color="tab:green", linestyle="--", alpha=0.7,
                   label=f"recommended {format_ttl(rec)}")
    ax.set_xscale("log")
    ax.set_xlabel("D's TTL (s, log scale)")
    ax.set_ylabel("predicted P time saved (s)")
    finish_figure(fig, ax, path, "Predicted prefill time saved vs TTL")
    return path


def pinned_over_time(series: PinnedSeries, budget: float | None, path: Path) -> Path:
    fig, ax = new_figure()
    hours = max(series.t_s, default=0.0) >= 3 * 3600
    scale, unit = (3600.0, "h") if hours else (60.0, "min")
    xs = [t / scale for t in series.t_s]
    for node, gib in zip(series.nodes, series.gib, strict=True):
        ax.step(xs, gib, where="post", label=node, linewidth=1)
    if budget is not None:
        ax.axhline(budget, color="tab:red", linestyle="-.", alpha=0.6,
                   label=f"budget {budget:g} GiB")
    ax.set_xlabel(f"time since the first turn ({unit})")
    ax.set_ylabel("pinned KV (GiB)")
    finish_figure(fig, ax, path, f"Pinned KV per D at TTL {format_ttl(series.ttl_s)}")
    return path
