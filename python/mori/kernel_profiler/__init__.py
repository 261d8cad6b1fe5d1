"""Alias of the EP kernel profiler's trace export under MORI's name (``mori.kernel_profiler``)."""

from mori_core.ops.profiler import PhaseSpan, export_to_perfetto, parse_trace  # noqa: F401

__all__ = ["PhaseSpan", "export_to_perfetto", "parse_trace"]
