"""GPU stage processes for test_omni_gpu.py: the connector's transport on CUDA pools.

Imports only ``mori_integrations.vllm_omni.transport`` (torch, pyzmq, msgspec and
the core) — never vLLM-Omni, which the GPU machine does not have.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import traceback
from typing import Any

CALL_TIMEOUT_S = 180.0


def gpu_payload(nbytes: int, seed: int, device: str) -> Any:
    """``nbytes`` of deterministic data on ``device`` (float32 when divisible by 4)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    if nbytes % 4 == 0:
        t = torch.randn(nbytes // 4, generator=gen)
    else:
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return t.to(device)


def byte_digest(t: Any) -> str:
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(flat).hexdigest()


def _serve(conn: Any, device: str, extra: dict) -> None:
    try:
        import torch

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        from mori_integrations.vllm_omni.settings import ConnectorSettings
        from mori_integrations.vllm_omni.transport import OmniTransport

        transport = OmniTransport(ConnectorSettings.from_extra(extra), name="gputest")
        conn.send(("ok", {"backends": transport.backends, "pool_device": str(transport.pool.device),
                         "unavailable": transport.unavailable_backends,
                         "address": transport.listen_address}))
    except Exception as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                transport.close()
                conn.send(("ok", None))
                conn.close()
                os._exit(0)
            if cmd == "offer":
                data = gpu_payload(kw["nbytes"], kw["seed"], kw["src_device"])
                size = transport.offer(kw["key"], data, is_fast_path=True)
                conn.send(("ok", {"size": size, "digest": byte_digest(data)}))
            elif cmd == "fetch":
                res = transport.fetch(kw["key"], kw["address"], kw.get("size"), True, None)
                if res is None:
                    conn.send(("ok", {"found": False}))
                    continue
                out = {"found": True, "size": res.size, "device": str(res.buffer.tensor.device),
                       "digest": byte_digest(res.buffer.tensor)}
                res.buffer.release()
                conn.send(("ok", out))
            elif cmd == "stats":
                conn.send(("ok", transport.stats()))
            else:
                raise ValueError(f"unknown command {cmd}")
        except Exception as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class GpuStage:
    """A spawned process owning one transport with its pool on ``device``."""

    def __init__(self, device: str, extra: dict) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, device, extra), daemon=True)
        self.proc.start()
        self.info = self._answer()

    def _answer(self) -> Any:
        if not self._conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError("GPU stage process did not answer")
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
                self._conn.send(("exit", {}))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
