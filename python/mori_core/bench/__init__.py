"""Benchmark CLI of mori-suite: ``python -m mori_core.bench {io,ep,moe,omni} ...``.

Every benchmark prints tables of medians with a baseline measured in the same
run. Subcommands live in their own modules, each exposing
``add_arguments(parser)`` and ``run(args) -> int``.
"""
