"""Stage processes for the connector tests: each hosts real connectors, driven over a pipe.

The parent sends ``(command, kwargs)``; the child runs it against connectors
it built through vLLM-Omni's own factory (after our plugin registered) and
answers ``("ok", result)`` or ``("err", text)``. Payloads are generated from
a seed on the side that needs them and compared by digest, so 64 MB never
crosses the pipe. Every parent-side wait is bounded.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any, Optional

CALL_TIMEOUT_S = 120.0


# ----------------------------------------------------------------- payloads
def make_payload(kind: str, nbytes: int, seed: int) -> Any:
    """A deterministic payload of about ``nbytes``.

    kind ``tensor``: a float32 tensor of exactly ``nbytes`` (multiple of 4) or
    uint8 otherwise; ``bytes``: random bytes; ``object``: a dict like a stage
    payload (tensor + token ids + text + nested metadata) serialised by the
    connector.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    if kind == "bytes":
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    if kind == "tensor":
        if nbytes % 4 == 0:
            return torch.randn(nbytes // 4, generator=gen)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if kind == "object":
        n_float = max(1, (nbytes - 512) // 4)
        return {
            "embed": {"hidden": torch.randn(n_float, generator=gen)},
            "ids": {"output": torch.randint(0, 151_000, (16,), generator=gen).tolist()},
            "meta": {"finished": bool(seed % 2), "seed": seed, "text": f"payload-{seed}"},
        }
    raise ValueError(f"unknown payload kind {kind!r}")


def digest(value: Any) -> str:
    """Canonical sha256 of a payload or of received bytes/buffers."""
    import torch

    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, (bytes, bytearray, memoryview)):
            h.update(b"B")
            h.update(bytes(v))
        elif isinstance(v, dict):
            h.update(b"D")
            for k in sorted(v):
                feed(k)
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(b"L")
            for x in v:
                feed(x)
        else:
            h.update(repr(v).encode())

    feed(value)
    return h.hexdigest()


def raw_digest(value: Any) -> str:
    """Digest of the raw bytes a fast-path put moves (what the receiver gets back)."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return digest(bytes(value))


# -------------------------------------------------------------------- child
class _Child:
    def __init__(self) -> None:
        from mori_integrations.vllm_omni import plugin

        plugin.register()
        from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
        from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

        self.factory, self.spec_cls = OmniConnectorFactory, ConnectorSpec
        self.connectors: dict[str, Any] = {}
        self.reserved: dict[str, Any] = {}
        self.sent: dict[str, Any] = {}

    # commands ------------------------------------------------------------
    def create(self, cid: str, extra: dict, name: str = "MoriTransferEngineConnector") -> dict:
        conn = self.factory.create_connector(self.spec_cls(name=name, extra=dict(extra)))
        self.connectors[cid] = conn
        return {"class": type(conn).__module__ + "." + type(conn).__name__,
                "info": conn.get_connection_info() if hasattr(conn, "get_connection_info") else {}}

    def put(self, cid: str, frm: str, to: str, key: str, kind: str, nbytes: int, seed: int) -> dict:
        data = make_payload(kind, nbytes, seed)
        t0 = time.perf_counter()
        ok, size, md = self.connectors[cid].put(frm, to, key, data)
        return {"ok": ok, "size": size, "md": md, "tx_s": time.perf_counter() - t0,
                "digest": raw_digest(data) if kind != "object" else digest(data)}

    def get(self, cid: str, frm: str, to: str, key: str, md: Optional[dict] = None,
            deadline_s: Optional[float] = None) -> dict:
        conn = self.connectors[cid]
        t0 = time.perf_counter()
        if deadline_s is None:
            res = conn.get(frm, to, key, md)
        else:
            res = conn.get_with_deadline(frm, to, key, md, deadline=time.monotonic() + deadline_s)
        elapsed = time.perf_counter() - t0
        if res is None:
            return {"found": False, "elapsed_s": elapsed}
        obj, size = res
        if hasattr(obj, "release") and hasattr(obj, "tensor"):
            d = digest(obj.to_bytes())
            obj.release()
            return {"found": True, "size": size, "digest": d, "kind": "buffer", "elapsed_s": elapsed}
        return {"found": True, "size": size, "digest": digest(obj), "kind": type(obj).__name__, "elapsed_s": elapsed}

    def relay(self, cid: str, frm: str, to: str, key: str, md: Optional[dict], out_to: str,
              out_kind: str, out_nbytes: int, seed: int) -> dict:
        """A middle stage: get from upstream, then put a new payload downstream."""
        got = self.get(cid, frm, to, key, md)
        if not got["found"]:
            return {"got": got}
        return {"got": got, "put": self.put(cid, to, out_to, key, out_kind, out_nbytes, seed)}

    def get_many(self, cid: str, frm: str, to: str, items: list, threads: int) -> list:
        """items: [(key, md)], fetched by ``threads`` threads at once."""
        results: list = [None] * len(items)

        def work(i: int) -> None:
            try:
                results[i] = self.get(cid, frm, to, items[i][0], items[i][1])
            except Exception as exc:  # reported per item
                results[i] = {"found": False, "error": repr(exc)}

        pool = [threading.Thread(target=lambda j=j: [work(i) for i in range(j, len(items), threads)])
                for j in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=CALL_TIMEOUT_S)
        return results

    def put_own_buffer_and_release(self, cid: str, frm: str, to: str, key: str, nbytes: int, seed: int) -> dict:
        """Zero-copy put of a buffer of the connector's own pool, released right after the put;
        then the next payload of the same size is allocated and written (first fit: it lands
        where the released bytes were unless they are still held for the receiver)."""
        import numpy as np

        conn = self.connectors[cid]
        pool = conn._transport.pool
        payload = make_payload("bytes", nbytes, seed)
        first = pool.alloc(nbytes)
        first.tensor.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        ok, size, md = conn.put(frm, to, key, first)
        offset = first.offset
        first.release()
        second = pool.alloc(nbytes)
        second.tensor.numpy()[:] = 0x42
        self.reserved[f"{cid}/{key}"] = second
        return {"ok": ok, "size": size, "md": md, "digest": digest(payload), "reused": second.offset == offset,
                "used_bytes": pool.allocator.used_bytes}

    def release_reserved(self, cid: str, key: str) -> None:
        self.reserved.pop(f"{cid}/{key}").release()

    def reserve(self, cid: str, size: int) -> dict:
        """Reserve a destination buffer and describe it, for a pull sent by the parent."""
        conn = self.connectors[cid]
        transport = conn._transport
        buf = transport.pool.alloc(size)
        self.reserved[cid] = buf
        return {"engine_desc": transport.engine_desc_packed, "mem_desc": transport.pool.desc_packed,
                "offset": buf.offset, "pool_size": transport.pool.size}

    def reserved_digest(self, cid: str) -> str:
        buf = self.reserved.pop(cid)
        d = digest(buf.to_bytes())
        buf.release()
        return d

    def abandon_get(self, cid: str, key: str) -> None:
        self.connectors[cid].abandon_get(key)

    def cleanup(self, cid: str, key: str, frm: Optional[str] = None, to: Optional[str] = None) -> Any:
        return self.connectors[cid].cleanup(key, frm, to)

    def update_sender_info(self, cid: str, host: str, port: int) -> None:
        self.connectors[cid].update_sender_info(host, port)

    def health(self, cid: str) -> dict:
        return self.connectors[cid].health()

    def close(self, cid: str) -> dict:
        conn = self.connectors[cid]
        conn.close()
        conn.close()  # idempotent
        return conn.health()

    def call_after_close(self, cid: str) -> str:
        try:
            self.connectors[cid].put("0", "1", "late", b"x")
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    def pid(self) -> int:
        return os.getpid()


def _serve(conn: Any) -> None:
    child = None
    while True:
        try:
            cmd, kwargs = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            for c in (child.connectors.values() if child is not None else ()):
                c.close()
            conn.send(("ok", None))
            conn.close()
            os._exit(0)  # skip the interpreter teardown of vLLM/torch (seconds, and nothing to check)
        try:
            if child is None:
                child = _Child()
            conn.send(("ok", getattr(child, cmd)(**kwargs)))
        except Exception as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# ------------------------------------------------------------------- parent
class StageProc:
    """A spawned process hosting connectors (see module docstring)."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_conn,), name=name, daemon=True)
        self.proc.start()
        self._pending = False

    def send(self, cmd: str, **kwargs: Any) -> None:
        """Start a command without waiting (collect with :meth:`result`)."""
        assert not self._pending, "one command at a time"
        self._conn.send((cmd, kwargs))
        self._pending = True

    def result(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The answer of the command started last; raises on error or timeout."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout} s")
        self._pending = False
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def call(self, cmd: str, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        """Run a command and return its result (bounded by ``timeout``)."""
        self.send(cmd, **kwargs)
        return self.result(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def freeze(self) -> None:
        """SIGSTOP: the process (and its IO engine threads) stops reading its sockets."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(timeout=10)

    def stop(self) -> None:
        """Ask the child to exit; kill it if it does not within a few seconds."""
        if self.proc.is_alive():
            try:
                self.thaw()
                if not self._pending:
                    self._conn.send(("exit", {}))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(timeout=10)
        self.kill()


def find_free_base(span: int) -> int:
    """A base port such that base .. base+span-1 are all free right now."""
    import random
    import socket

    def free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - span)
        if all(free(base + i) for i in range(span)):
            return base
    raise RuntimeError("no block of free ports found")


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout``; returns its last value."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= end:
            return bool(value)
        time.sleep(interval)
