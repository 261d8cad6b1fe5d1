"""``python -m mori_core.bench vllm-pd --agents``: one request's KV between two processes, no framework.

What a PD deployment adds to a request's first token, measured below the frameworks:

* **vLLM** (``MoriSuiteConnector``'s worker side, :mod:`.pd_agents`): WRITE (the decode asks,
  the prefill writes every layer at once), READ (the decode pulls), and WRITE layer-pipelined
  (the decode asked first; the prefill runs a forward of ``--layer-us`` of GPU work per layer
  and saves each layer's KV as vLLM's attention does: what is left after the forward ended
  is the transfer's cost to the first token). Request time is taken in the decode process,
  from its receive job to its outcome (no pipe, no polling interval in it); engine time is
  the connector's own (first submission to the last completion).
* **SGLang** (the adapter's chunk data path, :mod:`.sglang_agents`): one chunk of the
  whole request (every layer's K and V pages, the metadata row), plan + one ``batch_write``
  + wait, timed in the prefill process.
* **baseline**: ``Tensor.copy_`` of the same bytes between the same two GPUs (one process,
  CUDA events), in the same run.

Block / page ids are contiguous (runs of blocks merge into large segments) or scattered
(a random permutation on each side: every block or page a segment of its own), see
``--block-order``. ``--breakdown`` adds where a request's time goes (phase stamps taken by
both processes on one clock).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mori_core.bench.table import fmt_bytes, median, print_table

_TIMEOUTS = {"transfer_timeout": 60, "recv_abort_timeout": 120, "defer_timeout": 120}


def _start_all(makers: Sequence[Callable[[], Any]]) -> List[Any]:
    """Start helper processes concurrently (each pays its torch/CUDA start-up once, in parallel)."""
    with concurrent.futures.ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(m) for m in makers]
        out, error = [], None
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # keep the others to close them
                error = error or e
                out.append(None)
    if error is not None:
        for p in out:
            if p is not None:
                p.close()
        raise error
    return out


def _devices(device: str) -> Tuple[str, str]:
    if device == "cpu":
        return "cpu", "cpu"
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        raise SystemExit("vllm-pd --agents --device cuda: no CUDA device")
    return "cuda:0", f"cuda:{1 % n}"


def _block_ids(n: int, order: str, seed: int) -> List[int]:
    ids = list(range(1, n + 1))  # block 0 is vLLM's null block
    if order == "scattered":
        random.Random(seed).shuffle(ids)
    return ids


# ---------------------------------------------------------------- vLLM agents
class _VllmPair:
    """A prefill and a decode agent (one request shape, one engine setting)."""

    def __init__(self, args: argparse.Namespace, devices: Tuple[str, str], env: Dict[str, str], label: str,
                 config: Optional[Dict[str, Any]] = None) -> None:
        from mori_core.bench.pd_agents import AgentProcess, free_port_block

        self.args, self.label = args, label
        self.blocks = -(-args.tokens // args.block_size)
        spec = dict(tp_rank=0, tp_size=1, total_heads=args.kv_heads, layers=args.layers, num_blocks=self.blocks + 1,
                    heads=args.kv_heads, tokens=args.block_size, content=2 * args.head_size, dtype="bfloat16", env=env)
        makers = []
        for name, dev in zip(("bench-prefill", "bench-decode"), devices):
            base = free_port_block(2)
            extra = {"backend": "auto", "host_ip": "127.0.0.1", "handshake_port": base, "notify_port": base + 1,
                     **_TIMEOUTS, **(config or {})}
            makers.append(lambda s=dict(spec, engine_id=f"{name}-{label}", device=dev, extra=extra): AgentProcess(s))
        self.makers = makers
        self.prefill = self.decode = None
        self.passes = 0  # run() calls so far

    def started(self, procs: List[Any]) -> None:
        self.prefill, self.decode = procs
        self.prefill.call("fill", 1)

    def close(self) -> None:
        for p in (self.prefill, self.decode):
            if p is not None:
                p.close()

    def run(self, mode: str, order: str, iters: int, warmup: int, trace: bool) -> Dict[str, Any]:
        """``mode``: write | read | pipelined. Per iteration: engine ms, request ms (or tail ms), phases."""
        from mori_integrations.vllm.kv_connector.metadata import FinishedSend, PeerAddress, RecvJob, SendJob

        p, d = self.prefill, self.decode
        peer = PeerAddress("127.0.0.1", p.info["handshake_port"], p.info["notify_port"])
        for proc in (p, d):
            proc.call("trace", ("on" if trace else "off", None))
        out: Dict[str, Any] = {"engine": [], "request": [], "phases": [], "nbytes": 0}
        self.passes += 1
        for i in range(warmup + iters):
            tid = f"{self.label}-{mode}-{order}-p{self.passes}-{i}"  # unique: a finished id is refused again
            src = _block_ids(self.blocks, order, 2 * i)
            dst = _block_ids(self.blocks, order, 2 * i + 1)
            send = SendJob(req_id=f"p-{tid}", transfer_id=tid, block_ids=[src], num_prompt_tokens=self.args.tokens)
            job = RecvJob(req_id=f"d-{tid}", transfer_id=tid, mode="read" if mode == "read" else "write", peer=peer,
                          local_block_ids=[dst], positions=[0], num_prompt_tokens=self.args.tokens,
                          remote_block_ids=[src] if mode == "read" else None)
            if mode == "pipelined":
                d.send("recv_wait", (job, 120))
                time.sleep(0.05)  # the write request reaches the prefill before its forward starts
                forward_done = p.call("forward", (send, self.args.layer_us), timeout=180)
                res, ms, t_end = d.result(180, "recv_wait")
                ms = (t_end - forward_done) / 1e6
            else:
                p.call("send", (send, False))
                res, ms, _ = d.call("recv_wait", (job, 120), timeout=180)
            if not res.ok:
                raise RuntimeError(f"{self.label} {mode} transfer failed: {res.reason}")
            p.call("finish", FinishedSend(req_id=send.req_id, transfer_id=tid, aborted=False))
            p.call("take_finished", 60, timeout=90)
            if i < warmup:
                continue
            out["engine"].append(res.transfer_ms)
            out["request"].append(ms)
            out["nbytes"] = res.nbytes
            if trace:
                stamps = dict(p.call("trace", ("take", tid)))
                stamps.update({f"d:{k}": v for k, v in d.call("trace", ("take", tid)).items()})
                out["phases"].append(stamps)
        initiator = d if mode == "read" else p
        out["route"] = ", ".join(sorted(set(initiator.call("peer_routes").values())))
        return out


# Phases of a request, as (label, (process, stamp, first|last), (process, stamp, first|last)).
_WRITE_PHASES = [
    ("decode: job -> write request sent", ("d", "recv_start", 0), ("d", "write_request_sent", 1)),
    ("control: write request to the prefill", ("d", "write_request_sent", 1), ("p", "write_request_received", 0)),
    ("prefill: request -> writer thread", ("p", "write_request_received", 0), ("p", "write_begin", 0)),
    ("prefill: block and head pairs", ("p", "write_begin", 0), ("p", "prepared", 0)),
    ("prefill: pairs -> first copy submitted", ("p", "prepared", 0), ("p", "submitted", 0)),
    ("prefill: plan (all layers; with a lead part, its call too)", ("p", "prepared", 0), ("p", "planned", 1)),
    ("prefill: batch_write call (host)", ("p", "planned", 1), ("p", "submitted", 1)),
    ("prefill: submitted -> copy done seen", ("p", "submitted", 1), ("p", "statuses_done", 1)),
    ("prefill: done -> WriteDone sent", ("p", "statuses_done", 1), ("p", "write_done_sent", 1)),
    ("control: WriteDone to the decode", ("p", "write_done_sent", 1), ("d", "write_done_received", 1)),
    ("decode: WriteDone -> outcome", ("d", "write_done_received", 1), ("d", "result", 1)),
    ("doorbell: copy done seen -> rung", ("p", "statuses_done", 1), ("p", "doorbell_rung", 1)),
    ("doorbell: rung -> seen by the decode", ("p", "doorbell_rung", 1), ("d", "doorbell_seen", 1)),
    ("decode: doorbell seen -> outcome", ("d", "doorbell_seen", 1), ("d", "result", 1)),
    ("total: job -> outcome", ("d", "recv_start", 0), ("d", "result", 1)),
]
_PIPELINED_PHASES = [
    ("prefill: first layer submitted -> last submitted", ("p", "submitted", 0), ("p", "submitted", 1)),
    ("prefill: last batch_write call (host)", ("p", "planned", 1), ("p", "submitted", 1)),
    ("prefill: last submitted -> copies done seen", ("p", "submitted", 1), ("p", "statuses_done", 1)),
    ("prefill: done -> WriteDone sent", ("p", "statuses_done", 1), ("p", "write_done_sent", 1)),
    ("control: WriteDone to the decode", ("p", "write_done_sent", 1), ("d", "write_done_received", 1)),
    ("decode: WriteDone -> outcome", ("d", "write_done_received", 1), ("d", "result", 1)),
    ("doorbell: rung -> seen by the decode", ("p", "doorbell_rung", 1), ("d", "doorbell_seen", 1)),
    ("decode: doorbell seen -> outcome", ("d", "doorbell_seen", 1), ("d", "result", 1)),
]
_READ_PHASES = [
    ("decode: job -> peer known (cached handshake)", ("d", "recv_start", 0), ("d", "handshake_done", 0)),
    ("decode: peer known -> first copy submitted", ("d", "handshake_done", 0), ("d", "submitted", 0)),
    ("decode: plan (all layers; with a lead part, its call too)", ("d", "handshake_done", 0), ("d", "planned", 1)),
    ("decode: batch_read call (host)", ("d", "planned", 1), ("d", "submitted", 1)),
    ("decode: submitted -> copy done seen", ("d", "submitted", 1), ("d", "statuses_done", 1)),
    ("decode: done -> outcome (ConsumerDone sent)", ("d", "statuses_done", 1), ("d", "result", 1)),
    ("total: job -> outcome", ("d", "recv_start", 0), ("d", "result", 1)),
]


def _phase_rows(label: str, runs: List[Dict[str, Any]], phases: List[Tuple]) -> List[List[Any]]:
    rows = []
    for name, a, b in phases:
        vals = []
        for st in runs:
            ka = ("d:" if a[0] == "d" else "") + a[1]
            kb = ("d:" if b[0] == "d" else "") + b[1]
            if ka in st and kb in st:
                vals.append((st[kb][b[2]] - st[ka][a[2]]) / 1e3)
        rows.append([label, name, median(vals) if vals else "-"])
    return rows


# ------------------------------------------------------------- SGLang ranks
class _SglangPair:
    """An SGLang prefill rank and decode rank with per-layer K/V pools of the same KV shape."""

    def __init__(self, args: argparse.Namespace, devices: Tuple[str, str]) -> None:
        from mori_core.bench.sglang_agents import SglangRank

        self.pages = -(-args.tokens // args.block_size)
        spec = dict(layers=args.layers, heads=args.kv_heads, head_dim=args.head_size, page_size=args.block_size,
                    num_pages=self.pages + 1, aux_rows=4, tp_size=1, tp_rank=0, dtype="bfloat16")
        self.makers = [lambda: SglangRank("prefill", dict(spec, device=devices[0], seed=3)),
                       lambda: SglangRank("decode", dict(spec, device=devices[1]))]
        self.prefill = self.decode = None

    def started(self, procs: List[Any]) -> None:
        self.prefill, self.decode = procs
        self.prefill.call("connect", (self.decode.call("registration"), None))

    def close(self) -> None:
        for p in (self.prefill, self.decode):
            if p is not None:
                p.close()

    def run(self, order: str, room: int, iters: int, warmup: int, lead_split: bool = True) -> Dict[str, Any]:
        """``lead_split``: the chunk's lead region pairs in a call of their own (the default), or one call."""
        src = _block_ids(self.pages, order, 100 + room)
        dst = _block_ids(self.pages, order, 200 + room)
        self.prefill.call("target", self.decode.call("metadata", (room, dst, 1, 1)))
        out = self.prefill.call("bench", ((room, src, 0, len(dst), True, 2), iters, warmup, lead_split), timeout=300)
        out["route"] = ", ".join(f"{k.split()[-1]} {v}" for k, v in sorted(self.prefill.call("routes").items()))
        return out


# -------------------------------------------------------------- baseline
def _plain_copy_ms(nbytes: int, devices: Tuple[str, str], iters: int) -> float:
    import torch

    if devices[0] != "cpu":
        src = torch.empty(nbytes, dtype=torch.uint8, device=devices[0])
        dst = torch.empty(nbytes, dtype=torch.uint8, device=devices[1])
        times = []
        for _ in range(iters + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return median(times[2:])
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t0) * 1000)
    return median(times[2:])


def _config_values(cfg: Dict[str, str]) -> Dict[str, Any]:
    """Connector config overrides from ``key=value`` text: ints, floats and true/false as such."""
    out: Dict[str, Any] = {}
    for k, v in cfg.items():
        low = v.strip().lower()
        if low in ("true", "false"):
            out[k] = low == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def _env_settings(text: str) -> List[Dict[str, str]]:
    """``"A=1,B=2;A=3"`` -> [{A: 1, B: 2}, {A: 3}] (one extra engine setting per ``;`` part)."""
    out = []
    for part in text.split(";"):
        part = part.strip()
        if part:
            out.append(dict(kv.split("=", 1) for kv in part.split(",")))
    return out


def run_agents(args: argparse.Namespace) -> int:
    """The ``--agents`` benchmark (see the module docstring)."""
    devices = _devices(args.device)
    orders = ["contiguous", "scattered"] if args.block_order == "both" else [args.block_order]
    frameworks = {f for f in args.frameworks.split(",") if f}
    # (engine environment, connector config overrides, label) of each vLLM agent pair
    settings = ([({}, {}, "default")]
                + [(env, {}, ",".join(f"{k}={v}" for k, v in env.items())) for env in _env_settings(args.engine_env)]
                + [({}, _config_values(cfg), ",".join(f"{k}={v}" for k, v in cfg.items()))
                   for cfg in _env_settings(args.connector_config)])
    vllm = ([_VllmPair(args, devices, env, f"v{i}", cfg) for i, (env, cfg, _) in enumerate(settings)]
            if "vllm" in frameworks else [])
    sgl = _SglangPair(args, devices) if "sglang" in frameworks else None
    makers = [m for v in vllm for m in v.makers] + (sgl.makers if sgl else [])
    rows, phase_rows, sg_rows = [], [], []
    nbytes = 0
    procs: List[Any] = []
    try:
        procs = _start_all(makers)
        k = 0
        for v in vllm:
            v.started(procs[k:k + 2])
            k += 2
        if sgl:
            sgl.started(procs[k:k + 2])
        modes = [m for m in args.modes.split(",") if m]
        if devices[0] == "cpu":
            modes = [m for m in modes if m != "pipelined"]
        for order in orders:
            for v, (_, _, setting) in zip(vllm, settings):
                for mode in modes:
                    if mode == "pipelined" and setting != "default":
                        continue  # extra engine settings: the whole-request rows only
                    # The table's times come from untraced requests (the phase stamps cost every
                    # request a few tens of us, which other settings' rows would not pay); the
                    # breakdown from a traced pass after them.
                    r = v.run(mode, order, args.iters, args.warmup, False)
                    if args.breakdown and setting == "default":
                        r["phases"] = v.run(mode, order, args.iters, 1, True)["phases"]
                    nbytes = r["nbytes"]
                    what = {"write": "WRITE", "read": "READ",
                            "pipelined": f"WRITE layer-pipelined ({args.layer_us:g} us/layer forward)"}[mode]
                    # Pipelined: the engine time spans the forward; what counts is the tail after it.
                    engine = median(r["engine"]) if mode != "pipelined" else None
                    rows.append([f"vLLM MoriSuiteConnector {what} ({r['route']})", order, setting, engine,
                                 median(r["request"]), r["nbytes"]])
                    if r["phases"]:
                        table = {"write": _WRITE_PHASES, "read": _READ_PHASES, "pipelined": _PIPELINED_PHASES}[mode]
                        phase_rows += _phase_rows(f"{mode}, {order}", r["phases"], table)
            if sgl:
                # Same run: the default (lead pairs in a call of their own), one call, the default again.
                for lead_split, setting in ((True, "default"), (False, "one batch_write"), (True, "default (2)")):
                    if not lead_split and not args.sglang_one_call:
                        continue
                    r = sgl.run(order, len(sg_rows) + 1, args.iters, args.warmup, lead_split)
                    nbytes = nbytes or r["nbytes"][0]
                    engine_ms = [a + b for a, b in zip(r["submit"], r["wait"])]
                    rows.append([f"SGLang PD chunk ({r['route']})", order, setting, median(engine_ms),
                                 median(r["chunk"]), r["nbytes"][0]])
                    sg_rows.append([order, setting, r["pairs"][0], r["segments"][0], median(r["plan"]),
                                    median(r["submit"]), median(r["wait"]), median(r["chunk"])])
                    if not args.sglang_one_call:
                        break
    finally:
        for p in procs:
            if p is not None:
                p.close()
    base = _plain_copy_ms(nbytes, devices, args.iters)
    plain = "memcpy" if devices[0] == "cpu" else f"Tensor.copy_ {devices[0]} -> {devices[1]}"
    table = []
    for path, order, setting, engine, request, moved in rows:
        table.append([path, order, setting, "-" if engine is None else engine, request,
                      "-" if engine is None else moved / engine / 1e6,
                      "-" if engine is None else engine / base, request / base])
    table.append([f"plain copy in one process ({plain})", "-", "-", base, base, nbytes / base / 1e6, 1.0, 1.0])
    kind = ("host memory" if devices[0] == "cpu" else
            f"two processes on {devices[0]}" if devices[0] == devices[1] else f"{devices[0]} -> {devices[1]}")
    print_table(
        f"KV of one {args.tokens}-token request ({args.layers} layers, {args.kv_heads} KV heads x {args.head_size}, "
        f"bf16, blocks/pages of {args.block_size}: {fmt_bytes(nbytes)}), {kind}, two processes, medians of {args.iters}",
        ["path", "blocks", "engine setting", "engine ms", "request ms", "GB/s (engine)", "engine / copy",
         "request / copy"], table,
        note="engine ms: first submission -> last completion (SGLang: batch_write + wait). request ms: vLLM: the "
             "decode's receive job -> its outcome, in the decode process (WRITE: the decode's request reaches the "
             "prefill first); layer-pipelined: from the end of the prefill's forward (GPU idle) to the decode's "
             "outcome, i.e. what the transfer adds after the forward; SGLang: the transfer worker's whole chunk "
             "(plan + batch_write + wait). copy: the plain copy's time in the same run.",
    )
    if sg_rows:
        print_table("SGLang PD chunk: where the time goes (ms, median)",
                    ["page ids", "setting", "region pairs", "segments", "plan", "batch_write calls", "wait", "chunk"],
                    sg_rows)
    if phase_rows:
        print_table("vLLM PD request: where the time goes (us, median; stamps of both processes, one clock)",
                    ["request", "phase", "us"], phase_rows)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--agents`` options (the rest of ``vllm-pd``'s are in :mod:`.vllm_pd`)."""
    parser.add_argument("--layers", type=int, default=32, help="--agents: KV layers")
    parser.add_argument("--kv-heads", type=int, default=8, help="--agents: KV heads")
    parser.add_argument("--head-size", type=int, default=128, help="--agents: head size")
    parser.add_argument("--block-size", type=int, default=16, help="--agents: tokens per block / page")
    parser.add_argument("--tokens", type=int, default=2048, help="--agents: prompt tokens per request")
    parser.add_argument("--iters", type=int, default=10, help="--agents: measured requests per mode")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests per system / mode")
    parser.add_argument("--modes", default="write,read,pipelined",
                        help="--agents: vLLM modes (write, read, pipelined: WRITE behind a forward)")
    parser.add_argument("--layer-us", type=float, default=300.0,
                        help="--agents pipelined: GPU time of each layer of the emulated forward (us)")
    parser.add_argument("--block-order", choices=("contiguous", "scattered", "both"), default="contiguous",
                        help="--agents: block / page ids in order (runs merge) or a random permutation per side")
    parser.add_argument("--frameworks", default="vllm,sglang", help="--agents: vllm, sglang or both")
    parser.add_argument("--engine-env", default="",
                        help="--agents: extra vLLM agent pairs with engine settings, e.g. "
                             "'MORI_IO_XGMI_KERNEL_MAX_AVG_BYTES=64M;MORI_IO_XGMI_MAX_BLOCKS=132'")
    parser.add_argument("--connector-config", default="",
                        help="--agents: extra vLLM agent pairs with connector settings (kv_connector_extra_config "
                             "keys), e.g. 'lead_layers=0;lead_layers=4'")
    parser.add_argument("--sglang-one-call", action="store_true",
                        help="--agents: SGLang rows also with the whole chunk in one batch_write (no lead call), "
                             "between two default runs")
    parser.add_argument("--breakdown", action="store_true", help="--agents: where a request's time goes")
