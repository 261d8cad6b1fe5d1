"""A target engine holding GPU memory in another process (for the GPU IO tests)."""

from __future__ import annotations

from typing import Any

from io_peer import PeerProcess


def _serve(pipe, key: str, backends: tuple, auto_xgmi: bool) -> None:
    import torch

    from mori_core.io import BackendType, EngineDesc, IOEngine, IOEngineConfig

    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, enable_auto_xgmi=auto_xgmi))
    for b in backends:
        engine.create_backend(getattr(BackendType, b))
    tensors: dict[str, Any] = {}
    mems: dict[str, Any] = {}
    pipe.send(engine.get_engine_desc().pack())
    while True:
        cmd, arg = pipe.recv()
        try:
            if cmd == "alloc":  # (name, nbytes, device or -1 for pinned CPU, leading offset)
                name, nbytes, device, offset = arg
                dev = "cpu" if device < 0 else f"cuda:{device}"
                base = torch.zeros(nbytes + offset, dtype=torch.uint8, device=dev)
                if device < 0:
                    base = base.pin_memory()
                tensors[name] = base
                view = base[offset:]
                mems[name] = engine.register_torch_tensor(view)
                pipe.send(mems[name].pack())
            elif cmd == "fill":
                name, value = arg
                tensors[name].fill_(value)
                torch.cuda.synchronize()
                pipe.send(True)
            elif cmd == "get":  # bytes of the registered view
                name, start, length = arg
                t = tensors[name]
                off = mems[name].data - t.data_ptr()
                torch.cuda.synchronize()
                pipe.send(t[off + start: off + start + length].cpu().numpy().tobytes())
            elif cmd == "put":
                name, start, data = arg
                t = tensors[name]
                off = mems[name].data - t.data_ptr()
                t[off + start: off + start + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                torch.cuda.synchronize()
                pipe.send(True)
            elif cmd == "remote":
                engine.register_remote_engine(EngineDesc.unpack(arg))
                pipe.send(True)
            elif cmd == "pop":
                st = engine.pop_inbound_transfer_status(arg[0], arg[1])
                pipe.send(None if st is None else int(st.Code()))
            elif cmd == "free":
                engine.deregister_memory(mems.pop(arg))
                del tensors[arg]
                torch.cuda.synchronize()
                pipe.send(True)
            elif cmd == "stop":
                pipe.send(True)
                return
        except Exception as e:  # report, keep serving
            pipe.send(e)


class GpuTarget(PeerProcess):
    """A target engine with GPU (or pinned CPU) buffers; ``alloc`` registers one."""

    def __init__(self, key: str, backends=("TCP",), auto_xgmi: bool = True) -> None:
        super().__init__(_serve, (key, tuple(backends), auto_xgmi), start_timeout=120, call_timeout=120)

    def alloc(self, name: str, nbytes: int, device: int, offset: int = 0):
        from mori_core.io import MemoryDesc

        return MemoryDesc.unpack(self.call("alloc", (name, nbytes, device, offset)))
