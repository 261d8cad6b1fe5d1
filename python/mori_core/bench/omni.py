"""vLLM-Omni connector benchmark: seed 004's table (tx, in-flight, rx decode, size).

``python -m mori_core.bench omni [--device cpu|cuda] [--sizes 3305,1611713] ...``

Two spawned processes play two pipeline stages; the parent relays each put's
metadata from the sender to the receiver, as vLLM-Omni's orchestrator does.
Per transfer (medians over ``--iters``):

* ``tx_time_ms``        — ``put()`` in the sender (serialise + copy into its pool);
* ``in_flight_time_ms`` — from ``put()`` returning to ``get()`` starting
  (metadata relay; CLOCK_MONOTONIC is shared by the processes of a host);
* ``rx_decode_time_ms`` — ``get()`` in the receiver: the pull (control round
  trip + the IO engine's write into the receiver's pool) and deserialisation;
* ``size_kbytes``       — bytes moved (serialised size for objects).

Rows:

* ``mori-suite`` — ``MoriTransferEngineConnector`` when vLLM-Omni is installed,
  else the same transport with pickle for objects (labelled ``transport``);
* baseline from the same run: vLLM-Omni's default ``SharedMemoryConnector``
  (when installed) and, with ``--device cuda``, the TCP backend next to the
  automatically chosen (XGMI) route.

Payloads: ``object`` is a stage-payload dict (fp32 hidden states + token ids +
metadata, serialised), ``tensor`` a raw tensor (the fast path; on ``--device
cuda`` it lives on the sender's GPU and lands in the receiver's GPU pool).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import platform
import time
import traceback
from typing import Any, Optional

from mori_core.bench.table import median, print_table

SEED_004_SIZES = "3305,1611713"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m mori_core.bench omni``."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="pool memory: pinned CPU, or GPU 0 (sender) / GPU 1 (receiver)")
    parser.add_argument("--sizes", default=SEED_004_SIZES,
                        help="payload sizes in bytes, comma separated (default: seed 004's 3.3 KB and 1.6 MB)")
    parser.add_argument("--payloads", default="object,tensor", help="object, tensor or both")
    parser.add_argument("--iters", type=int, default=50, help="measured transfers per row")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured transfers per row")
    parser.add_argument("--no-baseline", action="store_true", help="skip the SharedMemoryConnector / TCP rows")
    parser.add_argument("--base-port", type=int, default=0, help="first ZMQ port (default: pick a free one)")
    parser.add_argument("--impl", choices=("auto", "connector", "transport"), default="auto",
                        help="connector = the vLLM-Omni class (needs vLLM-Omni); transport = its data path "
                             "alone (pickle for objects); auto = connector when vLLM-Omni is installed")


# ----------------------------------------------------------------- payloads
def _payload(kind: str, nbytes: int, device: str) -> Any:
    import torch

    gen = torch.Generator().manual_seed(nbytes)
    if kind == "tensor":
        t = torch.randn(nbytes // 4, generator=gen) if nbytes % 4 == 0 else \
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return t.to(device)
    # ~nbytes once serialised: fp32 hidden states plus a little metadata.
    n = max(1, (nbytes - 114) // 4)  # ~114 bytes of msgpack framing and metadata
    return {"hidden": torch.randn(n, generator=gen), "token_ids": list(range(8)),
            "meta": {"finished": False, "next_stage_prompt_len": 8}}


class _Endpoint:
    """One stage's side of a connector, with put/get/release."""

    def __init__(self, impl: str, extra: dict) -> None:
        self.impl = impl
        self._transport = None
        if impl in ("mori", "shm"):
            from mori_integrations.vllm_omni import plugin

            plugin.register()
            from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
            from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

            name = "MoriTransferEngineConnector" if impl == "mori" else "SharedMemoryConnector"
            self.conn = OmniConnectorFactory.create_connector(ConnectorSpec(name=name, extra=extra))
        else:  # "transport": the connector's data path without vLLM-Omni
            from mori_integrations.vllm_omni.settings import ConnectorSettings
            from mori_integrations.vllm_omni.transport import OmniTransport

            self._transport = OmniTransport(ConnectorSettings.from_extra(extra), name="bench")
            self.conn = None

    def backends(self) -> list:
        t = self._transport or getattr(self.conn, "_transport", None)
        return list(t.backends) if t is not None else []

    def routes(self) -> dict:
        t = self._transport or getattr(self.conn, "_transport", None)
        return dict(t.stats()["routes"]) if t is not None else {}

    def put(self, key: str, data: Any) -> tuple[int, dict]:
        if self.conn is not None:
            ok, size, md = self.conn.put("0", "1", key, data)
            if not ok:
                raise RuntimeError(f"put of {key} failed")
            return size, md
        import torch

        fast = isinstance(data, torch.Tensor)
        size = self._transport.offer(key, data if fast else pickle.dumps(data, protocol=5), is_fast_path=fast)
        return size, {"address": self._transport.listen_address, "data_size": size, "is_fast_path": fast}

    def get(self, key: str, md: dict) -> Any:
        if self.conn is not None:
            res = self.conn.get("0", "1", key, md)
            if res is None:
                raise RuntimeError(f"get of {key} found nothing")
            obj = res[0]
            if hasattr(obj, "release") and hasattr(obj, "tensor"):
                obj.tensor  # the fast path hands out the pool bytes: this is all the decoding
                obj.release()
            return obj
        res = self._transport.fetch(key, md["address"], md["data_size"], md["is_fast_path"])
        if res is None:
            raise RuntimeError(f"fetch of {key} found nothing")
        if res.is_fast_path:
            res.buffer.tensor
            res.buffer.release()
            return None
        try:
            return pickle.loads(res.buffer.to_bytes())
        finally:
            res.buffer.release()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self._transport is not None:
            self._transport.close()


def _stage(conn: Any, impl: str, extra: dict, device: Optional[str]) -> None:
    """Child process: build an endpoint, then serve put/get commands from the parent."""
    try:
        if device and device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(device))
        ep = _Endpoint(impl, extra)
        conn.send(("ok", ep.backends()))
    except Exception as exc:
        conn.send(("err", f"{exc}\n{traceback.format_exc()}"))
        return
    payload = None
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "prepare":
                payload = _payload(kw["kind"], kw["nbytes"], kw["device"])
                conn.send(("ok", None))
            elif cmd == "put":
                t0 = time.perf_counter()
                size, md = ep.put(kw["key"], payload)
                t1 = time.perf_counter()
                conn.send(("ok", (size, md, (t1 - t0) * 1e3, time.monotonic())))
            elif cmd == "get":
                start = time.monotonic()
                t0 = time.perf_counter()
                ep.get(kw["key"], kw["md"])
                conn.send(("ok", (start, (time.perf_counter() - t0) * 1e3)))
            elif cmd == "routes":
                conn.send(("ok", ep.routes()))
            elif cmd == "exit":
                ep.close()
                conn.send(("ok", None))
                conn.close()
                os._exit(0)
        except Exception as exc:
            conn.send(("err", f"{exc}\n{traceback.format_exc()}"))


class _Proc:
    def __init__(self, impl: str, extra: dict, device: Optional[str]) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_stage, args=(child, impl, extra, device), daemon=True)
        self.proc.start()
        self.backends = self._answer()

    def _answer(self, timeout: float = 300.0) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError("benchmark stage process did not answer")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, cmd: str, **kw: Any) -> Any:
        self._conn.send((cmd, kw))
        return self._answer()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except Exception:
                pass
            self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()


# --------------------------------------------------------------------- run
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _have_vllm_omni() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_omni") is not None


def _hardware(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores"
    if device == "cuda":
        import torch

        text += f"; {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return text


def _measure(sender: _Proc, receiver: _Proc, kind: str, nbytes: int, device: str, iters: int,
             warmup: int, tag: str) -> dict:
    sender.call("prepare", kind=kind, nbytes=nbytes, device=device)
    tx, flight, rx = [], [], []
    size = 0
    for i in range(warmup + iters):
        key = f"{tag}-{kind}-{nbytes}-{i}"
        size, md, tx_ms, put_done = sender.call("put", key=key)
        get_start, rx_ms = receiver.call("get", key=key, md=md)
        if i >= warmup:
            tx.append(tx_ms)
            flight.append((get_start - put_done) * 1e3)
            rx.append(rx_ms)
    return {"size": size, "tx": median(tx), "flight": median(flight), "rx": median(rx)}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print one table; returns the exit code."""
    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    kinds = [k.strip() for k in str(args.payloads).split(",") if k.strip()]
    if any(k not in ("object", "tensor") for k in kinds) or not sizes or min(sizes) <= 0:
        raise SystemExit("--payloads takes object/tensor, --sizes positive byte counts")
    omni = _have_vllm_omni()
    if args.impl == "connector" and not omni:
        raise SystemExit("--impl connector needs vLLM-Omni installed")
    impl = "transport" if args.impl == "transport" or not omni else "mori"
    dev_s, dev_r = ("cuda:0", "cuda:1") if args.device == "cuda" else ("cpu", "cpu")
    pool = max(64 << 20, 2 * max(sizes) + (8 << 20))

    variants = [(impl, "auto")]
    if not args.no_baseline:
        if args.device == "cuda":
            variants.append((impl, "tcp"))
        if omni:
            variants.append(("shm", "-"))
    rows = []
    for impl_name, backend in variants:
        base = args.base_port or _free_port()
        if impl_name == "shm":
            s_extra = r_extra = {}
        else:
            s_extra = {"host": "127.0.0.1", "role": "sender", "zmq_port": base, "backend_type": backend,
                       "memory_pool_device": dev_s, "memory_pool_size": pool}
            r_extra = {"host": "127.0.0.1", "role": "receiver", "backend_type": backend, "sender_host": "127.0.0.1",
                       "sender_zmq_port": base, "memory_pool_device": dev_r, "memory_pool_size": pool}
        sender = _Proc(impl_name, s_extra, dev_s)
        receiver = _Proc(impl_name, r_extra, dev_r)
        try:
            label = {"mori": "mori-suite connector", "transport": "mori-suite transport",
                     "shm": "SharedMemoryConnector (stock default)"}[impl_name]
            for kind in kinds:
                for nbytes in sizes:
                    tensor_dev = dev_s if kind == "tensor" and args.device == "cuda" else "cpu"
                    before = sender.call("routes")
                    r = _measure(sender, receiver, kind, nbytes, tensor_dev, args.iters, args.warmup,
                                 f"{impl_name}{backend}")
                    after = sender.call("routes")
                    route = ",".join(k for k in after if after.get(k, 0) != before.get(k, 0)) or "-"
                    rows.append([label, route, kind, f"{r['size'] / 1000:.3f}", r["tx"], r["flight"], r["rx"]])
        finally:
            sender.stop()
            receiver.stop()

    import torch

    print_table(
        f"vLLM-Omni connector, seed 004's fields ({args.device} pools; {_hardware(args.device)}; "
        f"torch {torch.__version__}; medians of {args.iters})",
        ["connector", "route", "payload", "size_kbytes", "tx_time_ms", "in_flight_time_ms", "rx_decode_time_ms"],
        rows,
        note=("tx = put(); in-flight = put() returned -> get() started (metadata relayed by the parent process); "
              "rx_decode = get(): pull (control round trip + IO-engine write) + deserialise. "
              + ("" if impl == "mori" else "Transport rows: objects use pickle instead of OmniSerializer.")),
    )
    return 0
