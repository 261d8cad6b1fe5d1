"""Plain-text tables and summary statistics shared by the benchmarks."""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], note: str = "") -> str:
    """Print (and return) a Markdown table, so output pastes into docs unchanged."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [f"\n### {title}", ""]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    if note:
        lines += ["", note]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c == 0:
            return "0"
        if abs(c) >= 100:
            return f"{c:.0f}"
        if abs(c) >= 10:
            return f"{c:.1f}"
        return f"{c:.2f}"
    return str(c)
