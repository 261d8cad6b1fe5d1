"""PNG charts of benchmark results: ``--plot FILE`` of ``python -m mori_core.bench ep`` and ``io``.

A chart is a row of panels, each with lines of (x, y) points: the measured series drawn solid,
same-run baselines dashed. matplotlib is imported only when a chart is written (it is not a
dependency of the suite); without it :func:`write_png` raises :class:`PlotUnavailable` saying how
to get it, and the benchmarks print that and carry on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


class PlotUnavailable(RuntimeError):
    """matplotlib is not importable here."""


@dataclass
class Series:
    """One line: ``label``, its points, and whether it is a baseline (drawn dashed)."""

    label: str
    xs: list[float]
    ys: list[float]
    baseline: bool = False


@dataclass
class Panel:
    """One chart panel. ``xlog2``/``ylog``: logarithmic axes (x in powers of two)."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    xlog2: bool = True
    ylog: bool = False

    def add(self, label: str, points: Sequence[tuple[float, float]], baseline: bool = False) -> None:
        """Add a series from (x, y) points (sorted by x; points with a missing or non-finite y
        are dropped, and an empty series is not added)."""
        pts = sorted((float(x), float(y)) for x, y in points if y is not None and math.isfinite(float(y)))
        if pts:
            self.series.append(Series(label, [p[0] for p in pts], [p[1] for p in pts], baseline))


def write_png(path: str, title: str, panels: Sequence[Panel], columns: int = 0) -> str:
    """Draw ``panels`` (those with at least one series) into a PNG at ``path``; returns ``path``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        ValueError: no panel has data.
    """
    panels = [p for p in panels if p.series]
    if not panels:
        raise ValueError("nothing to plot: no panel has a series with data")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib (pip install matplotlib): {e}") from None
    cols = columns or min(len(panels), 3)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for s in panel.series:
            ax.plot(s.xs, s.ys, marker="o", markersize=3.5, linestyle="--" if s.baseline else "-", label=s.label)
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        if panel.xlog2:
            ax.set_xscale("log", base=2)
            xs = sorted({x for s in panel.series for x in s.xs})
            ax.set_xticks(xs)
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        if panel.ylog:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
