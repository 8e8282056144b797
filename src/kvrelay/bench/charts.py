"""PNG charts of a benchmark (matplotlib, Agg backend: no display needed).

* ``W_ttft_vs_context.png``: p50 TTFT of the measured turns against context length, one line
  per mode (the seed's chart: reuse vs no reuse as the context grows), points labelled in ms
  when at most two modes ran; drawn when some measured turn has a context length. The y axis
  is logarithmic when the values span more than ``LOG_SCALE_SPAN`` (e.g. recompute 50x above
  pull: on a linear axis the reuse modes would sit on the x axis).
* ``W_ttft_by_turn.png``: mean TTFT by turn number, one line per mode; drawn when some turn
  succeeded.

matplotlib is imported inside the functions (the ``bench`` extra), on a private ``Figure``
(not pyplot's global state), so charts can be drawn from any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from kvrelay.bench.metrics import ModeSummary
from kvrelay.display.figures import finish_figure, new_figure

LOG_SCALE_SPAN = 20.0

_STYLES: Mapping[str, str] = MappingProxyType(
    {"pull": "o-", "recompute": "s--", "local": "^:", "direct": "d-."}
)


def write_charts(
    workload: str, summaries: dict[str, ModeSummary], out_dir: Path
) -> list[Path]:
    """Draw the charts that apply to a workload's mode summaries into ``out_dir``; returns
    their paths."""
    out: list[Path] = []
    if any(s.ttft_by_context for s in summaries.values()):
        path = out_dir / f"{workload}_ttft_vs_context.png"
        ttft_vs_context(summaries, path, title=f"TTFT vs context length ({workload})")
        out.append(path)
    if any(s.ttft_by_turn for s in summaries.values()):
        path = out_dir / f"{workload}_ttft_by_turn.png"
        ttft_by_turn(summaries, path, title=f"Mean TTFT by turn ({workload})")
        out.append(path)
    return out


def ttft_vs_context(summaries: dict[str, ModeSummary], path: Path, title: str) -> None:
    fig, ax = new_figure()
    label_points = len(summaries) <= 2  # more labels than that overlap; the table has them
    log_y = wide_span([d.p50 for s in summaries.values() for d in s.ttft_by_context.values()])
    for i, (mode, s) in enumerate(summaries.items()):
        xs = sorted(s.ttft_by_context)
        if not xs:
            continue
        ys = [s.ttft_by_context[x].p50 * 1000 for x in xs]
        ax.plot(xs, ys, _STYLES.get(mode, "o-"), label=mode)
        for x, y in zip(xs, ys, strict=True):
            if label_points:
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points",
                            xytext=(0, 6 if i == 0 else -12), ha="center", fontsize=7)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("TTFT p50 (ms, log scale)" if log_y else "TTFT p50 (ms)")
    finish_figure(fig, ax, path, title, log_y=log_y)


def wide_span(values: list[float]) -> bool:
    """Whether positive ``values`` span more than ``LOG_SCALE_SPAN`` (then: log y axis)."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > LOG_SCALE_SPAN


def ttft_by_turn(summaries: dict[str, ModeSummary], path: Path, title: str) -> None:
    fig, ax = new_figure()
    for mode, s in summaries.items():
        xs = sorted(s.ttft_by_turn)
        if xs:
            ax.plot(xs, [s.ttft_by_turn[x] * 1000 for x in xs], _STYLES.get(mode, "o-"),
                    label=mode)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    finish_figure(fig, ax, path, title)
