"""The charts' house style (bench and tune): a private Agg figure in one size, finished with
a title, a grid, a legend and a tight layout into a PNG.

matplotlib is imported inside the functions (the ``bench``/``tune`` extras), on a private
``Figure`` (not pyplot's global state), so charts can be drawn from any thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def new_figure() -> tuple[Any, Any]:
    """A private Agg figure with one axes, in the house size (7 x 4.2 in, 110 dpi)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def finish_figure(fig: Any, ax: Any, path: Path, title: str, *, log_y: bool = False) -> None:
    """Title, y axis from 0 (or log), grid, legend, tight layout, PNG at ``path``."""
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.12)  # room for the point labels
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
