"""The dashboard's panels drawn from Prometheus data with matplotlib, as one PNG.

A picture of what the Grafana dashboard shows (docs/monitoring.md), for readers without a
Grafana, from the same ``PANELS`` table and the same queries.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from kvrelay.deploy.panels import PANELS, Panel
from kvrelay.deploy.prometheus import PrometheusClient, RangeSeries

_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``legendFormat``: ``{{label}}`` replaced by the series' label value."""
    return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), template).strip()


def render_png(client: PrometheusClient, out: Path, start_s: float, end_s: float,
               step_s: float, rate_window: str, title: str = "kvrelay",
               panels: tuple[Panel, ...] = PANELS) -> None:
    """Draw every panel over ``[start_s, end_s]`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    columns = 2
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(15, 3.3 * rows), squeeze=False)
    fig.suptitle(title, fontsize=13, x=0.01, ha="left")
    for ax, panel in zip(axes.flat, panels, strict=False):
        drawn = labelled = 0
        for query in panel.queries:
            series: list[RangeSeries] = client.query_range(
                query.for_prometheus(rate_window), start_s, end_s, step_s)
            for s in series:
                xs = [(t - start_s) / 60 for t, _ in s.points]
                ys = [v for _, v in s.points]
                label = legend(query.legend, s.labels)
                ax.plot(xs, ys, linewidth=1.4, label=label or None)
                drawn += 1
                labelled += bool(label)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        ax.set_xlim(0, (end_s - start_s) / 60)
        ax.tick_params(labelsize=8)
        if panel.unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif panel.unit == "s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s"))
        elif panel.unit == "reqps":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}/s"))
        if labelled:
            ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.6)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.1 / rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
