"""Entry point: ``python -m mori_core.bench <benchmark> [options]`` (also ``mori-bench``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# name -> (module, one-line description). Modules are imported only when chosen,
# so e.g. the IO benchmark runs without torch or GPU-only dependencies.
SUBCOMMANDS = {
    "io": ("mori_core.bench.io", "MORI-IO transfer engine: read/write matrix vs a raw baseline"),
    "ep": ("mori_core.bench.ep", "MORI-EP dispatch/combine vs NCCL all_to_all_single (GPU)"),
    "moe": ("mori_core.bench.moe", "one MoE layer (dispatch + experts + combine) vs a single-GPU baseline"),
    "omni": ("mori_core.bench.omni", "vLLM-Omni connector put/get timings (seed 004's table)"),
    "vllm-pd": ("mori_core.bench.vllm_pd", "vLLM PD disaggregation: TTFT and KV transfer per request (MoriSuiteConnector)"),
    "ccl": ("mori_core.bench.ccl", "MORI-CCL collectives (copy engines, SM) vs NCCL and torch symmetric memory (GPU)"),
    "chaos": ("mori_core.bench.chaos", "reliability: fuzz every listener, kill/stop/reset/deregister faults, load"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the subcommand, import its module and run it; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mori_core.bench", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    modules = {}
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            modules[name] = importlib.import_module(module)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    return int(modules[args.benchmark].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
