"""SGLang PD's prefill transfer path between two processes, without SGLang (benchmark and GPU test).

``MoriKVManager`` needs SGLang; its data path does not:
:meth:`~mori_integrations.sglang.prefill_transfer.PrefillTransferMixin._write_chunk` plans
every layer's K and V pages and the metadata (aux) row of each decode target, submits them
with one ``batch_write`` and waits (bounded). Here

* a decode process holds SGLang-shaped pools -- one ``[pages * page_size, heads, head_dim]``
  tensor per layer for K and one for V (SGLang's ``MHATokenToKVPool``), and host metadata
  buffers -- registered with its engine, and produces what its manager sends: the
  ``PeerRegistration`` and a request's ``TransferMetadata`` (encoded and validated by the
  adapter's codec);
* a prefill process holds the same pools filled with seeded random bytes, takes those
  messages as its manager does (``DecodePeer`` / ``RoomTarget``) and runs ``_write_chunk``
  for chunks of the request.

The caller plays SGLang: it picks pages, chunks and (for a TP mismatch) the head slice.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any, Dict, List, Optional

from mori_core.bench.spawned import SpawnedProcess

AUX_ITEM_BYTES = (64, 4096)  # two host metadata buffers: per-request rows (ids, hidden-state sized)


@dataclasses.dataclass
class Chunk:
    """The fields of SGLang's ``TransferKVChunk`` that the transfer path reads."""

    room: int
    prefill_kv_indices: Any
    index_slice: slice
    is_last_chunk: bool
    prefill_aux_index: Optional[int] = None
    state_indices: Optional[List] = None
    num_kv_tokens: Optional[int] = None
    wait_event: Any = None
    indices_event: Any = None


class _Pools:
    """Per-layer K and V buffers (``[pages * page_size, heads, head_dim]``) and host metadata buffers."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        import torch

        self.spec = spec
        dtype = getattr(torch, spec.get("dtype", "bfloat16"))
        rows = spec["num_pages"] * spec["page_size"]
        device = spec["device"]
        self.kv = [torch.zeros(rows, spec["heads"], spec["head_dim"], dtype=dtype, device=device)
                   for _ in range(2 * spec["layers"])]  # K of every layer, then V (kv_data_ptrs' order)
        self.aux = [torch.zeros(spec["aux_rows"], n, dtype=torch.uint8) for n in AUX_ITEM_BYTES]
        self.page_bytes = spec["page_size"] * spec["heads"] * spec["head_dim"] * self.kv[0].element_size()

    def fill(self, seed: int) -> None:
        import torch

        g = torch.Generator(device="cpu").manual_seed(seed)
        for t in self.kv + self.aux:
            flat = t.view(-1).view(torch.uint8)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
        if self.kv[0].is_cuda:
            torch.cuda.synchronize()

    def zero(self) -> None:
        for t in self.kv + self.aux:
            t.zero_()

    def pages(self, pages: List[int]) -> Any:
        """Bytes of ``pages`` of every K/V buffer, ``[buffers, pages, page bytes]`` (host numpy)."""
        import torch

        ps = self.spec["page_size"]
        idx = torch.tensor([p * ps + k for p in pages for k in range(ps)], device=self.kv[0].device)
        out = torch.stack([t.index_select(0, idx).view(len(pages), -1).view(torch.uint8) for t in self.kv])
        return out.cpu().numpy()

    def aux_rows(self, row: int) -> List[bytes]:
        return [t[row].numpy().tobytes() for t in self.aux]


def _engine(spec: Dict[str, Any], role: str) -> Any:
    import os

    from mori_integrations.sglang import io_setup

    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    setup = io_setup.create_engine(f"bench-sglang-{role}-tp{spec['tp_rank']}-pid{os.getpid()}", "127.0.0.1",
                                   gpu_memory=spec["device"].startswith("cuda"), rdma=io_setup.RdmaTuning())
    return setup


def _register(setup: Any, pools: _Pools, spec: Dict[str, Any]) -> tuple:
    from mori_core.io import MemoryLocationType
    from mori_integrations.sglang import io_setup

    gpu = spec["device"].startswith("cuda")
    gpu_id = _device_index(spec["device"])
    kv = io_setup.register_regions(setup.engine, [t.data_ptr() for t in pools.kv], [t.nbytes for t in pools.kv],
                                   io_setup.kv_location("cuda" if gpu else "cpu"), gpu_id)
    aux = io_setup.register_regions(setup.engine, [t.data_ptr() for t in pools.aux], [t.nbytes for t in pools.aux],
                                    MemoryLocationType.CPU, -1)
    return kv, aux


def _serve_decode(pipe: Any, spec: Dict[str, Any]) -> None:
    import torch

    from mori_integrations.sglang.messages import PeerRegistration, TransferMetadata, encode_message

    try:
        if spec["device"].startswith("cuda"):
            torch.cuda.set_device(torch.device(spec["device"]))
        pools = _Pools(spec)
        setup = _engine(spec, "decode")
        kv_descs, aux_descs = _register(setup, pools, spec)
        desc = setup.engine.get_engine_desc()
    except Exception:
        pipe.send(RuntimeError(traceback.format_exc()))
        return
    layers = spec["layers"]

    def registration(_: Any) -> List[bytes]:  # what MoriKVManager.build_receiver_registration_message sends
        return encode_message(PeerRegistration(
            endpoint="127.0.0.1", rank_port=max(1, desc.port), engine_desc=desc.pack(),
            kv_descs=[d.pack() for d in kv_descs], kv_item_lens=[pools.page_bytes] * len(kv_descs),
            kv_layer_ids=list(range(layers)) * 2, aux_descs=[d.pack() for d in aux_descs],
            aux_item_lens=list(AUX_ITEM_BYTES), state_types=[], state_descs=[], state_item_lens=[],
            state_dim_per_tensor=[], state_layer_ids=[], gpu_id=max(0, _device_index(spec["device"])),
            attn_tp_size=spec["tp_size"], attn_tp_rank=spec["tp_rank"], page_size=spec["page_size"], is_mla=False,
            dcp_size=1, dcp_rank=0, kv_cache_dtype=spec.get("dtype", "bfloat16")))

    def metadata(arg: Any) -> List[bytes]:  # ... and build_receiver_metadata_message
        import numpy as np

        room, pages, aux_index, required = arg
        return encode_message(TransferMetadata(
            room=room, endpoint="127.0.0.1", rank_port=max(1, desc.port), engine_key=desc.key,
            kv_pages=np.asarray(pages, dtype="<i4").tobytes(), aux_index=aux_index, state_indices=[],
            required_dst_info_num=required, decode_prefix_len=0, is_dummy=False))

    handlers = {
        "registration": registration,
        "metadata": metadata,
        "pages": lambda pages: pools.pages(pages),
        "aux_rows": lambda row: pools.aux_rows(row),
        "zero": lambda _: pools.zero(),
        "info": lambda _: {"engine_key": desc.key, "backends": setup.describe()},
    }
    _loop(pipe, handlers, spec, "decode")


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if device.startswith("cuda") else -1


def _make_writer(engine: Any, pools: _Pools, kv_descs: List[Any], aux_descs: List[Any], timeout_s: float) -> Any:
    """The mixin's data path with what MoriKVManager gives it (SGLang's status bookkeeping left out)."""
    import types

    from mori_integrations.sglang.prefill_transfer import PrefillTransferMixin

    writer = type("ChunkWriter", (PrefillTransferMixin,), {})()
    writer.engine = engine
    writer.kv_args = types.SimpleNamespace(kv_item_lens=[pools.page_bytes] * len(kv_descs),
                                           aux_item_lens=list(AUX_ITEM_BYTES), page_size=pools.spec["page_size"],
                                           state_types=[])
    writer.kv_descs, writer.aux_descs, writer.state_descs = kv_descs, aux_descs, []
    writer.pp_group = types.SimpleNamespace(is_last_rank=True)
    writer._transfer_timeout_s, writer._wait_poll_ms, writer.bytes_sent = timeout_s, 1000, 0
    return writer


def _serve_prefill(pipe: Any, spec: Dict[str, Any]) -> None:
    import numpy as np
    import torch

    from mori_integrations.sglang.messages import decode_message
    from mori_integrations.sglang.peers import DecodePeer, RoomTarget
    from mori_integrations.sglang.plans import HeadSlice

    try:
        if spec["device"].startswith("cuda"):
            torch.cuda.set_device(torch.device(spec["device"]))
        pools = _Pools(spec)
        pools.fill(spec.get("seed", 1))
        setup = _engine(spec, "prefill")
        kv_descs, aux_descs = _register(setup, pools, spec)
        writer = _make_writer(setup.engine, pools, kv_descs, aux_descs, spec.get("timeout_s", 30.0))
    except Exception:
        pipe.send(RuntimeError(traceback.format_exc()))
        return
    peers: Dict[str, Any] = {}
    targets: Dict[int, List[Any]] = {}

    def connect(arg: Any) -> str:
        frames, head_slice = arg  # head_slice: SGLang's slice for a TP mismatch (the caller computes it)
        peer = DecodePeer.from_registration(decode_message(frames))
        peer.kv_pairs = [(i, i) for i in range(min(len(kv_descs), len(peer.kv_descs)))]  # equal layer ids
        peer.head_slice = None if head_slice is None else HeadSlice(**head_slice)
        setup.engine.register_remote_engine(peer.engine_desc)
        peers[peer.engine_key] = peer
        return peer.engine_key

    def target(frames: List[bytes]) -> int:
        meta = decode_message(frames)
        targets.setdefault(meta.room, []).append(RoomTarget.from_metadata(meta))
        return meta.room

    def chunk_of(arg: Any) -> Chunk:
        room, pages, start, stop, last, aux = arg
        return Chunk(room=room, prefill_kv_indices=np.asarray(pages, dtype=np.int32), index_slice=slice(start, stop),
                     is_last_chunk=last, prefill_aux_index=aux)

    def write(arg: Any) -> Dict[str, Any]:
        chunk = chunk_of(arg)
        pairs = [(t, peers.get(t.engine_key)) for t in targets[chunk.room]]
        t0 = time.perf_counter()
        failure, quiescent = writer._write_chunk(chunk, pairs)
        return {"failure": failure, "quiescent": quiescent, "ms": (time.perf_counter() - t0) * 1000,
                "bytes_sent": writer.bytes_sent, "lead": writer.last_lead}

    def bench(arg: Any) -> Dict[str, List[float]]:
        """Times of ``iters`` whole-chunk writes: the data path, and its phases run one by one."""
        chunk_arg, iters, warmup, lead_split = arg
        chunk = chunk_of(chunk_arg)
        writer.lead_split = lead_split
        pairs = [(t, peers.get(t.engine_key)) for t in targets[chunk.room]]
        total, plan, submit, wait = [], [], [], []
        pc = time.perf_counter_ns
        for i in range(warmup + iters):
            t0 = pc()
            failure, _ = writer._write_chunk(chunk, pairs)
            t1 = pc()
            if failure is not None:
                raise RuntimeError(f"chunk write failed: {failure}")
            batch = writer._plan_chunk(chunk, pairs)  # the same steps, stamped between
            t2 = pc()
            statuses: List[Any] = []
            writer._submit_chunk(chunk, batch, statuses)
            t3 = pc()
            failure, _ = writer._await_statuses(statuses)
            t4 = pc()
            if failure is not None:
                raise RuntimeError(f"chunk write failed: {failure}")
            if i >= warmup:
                total.append((t1 - t0) / 1e6)
                plan.append((t2 - t1) / 1e6)
                submit.append((t3 - t2) / 1e6)
                wait.append((t4 - t3) / 1e6)
        return {"chunk": total, "plan": plan, "submit": submit, "wait": wait, "pairs": [len(batch)],
                "segments": [sum(len(s) for s in batch.sizes)], "nbytes": [batch.nbytes]}

    def routes(_: Any) -> Dict[str, str]:
        out = {}
        for key, peer in peers.items():
            out[f"{key} kv"] = str(setup.engine.route_of(kv_descs[0], peer.kv_descs[0]).name)
            out[f"{key} aux"] = str(setup.engine.route_of(aux_descs[0], peer.aux_descs[0]).name)
        return out

    handlers = {
        "connect": connect,
        "target": target,
        "write": write,
        "bench": bench,
        "routes": routes,
        "pages": lambda pages: pools.pages(pages),
        "aux_rows": lambda row: pools.aux_rows(row),
        "info": lambda _: {"engine_key": setup.engine.get_engine_desc().key, "backends": setup.describe()},
    }
    _loop(pipe, handlers, spec, "prefill")


def _loop(pipe: Any, handlers: Dict[str, Any], spec: Dict[str, Any], role: str) -> None:
    pipe.send("ready")
    while True:
        cmd, arg = pipe.recv()
        if cmd == "stop":
            pipe.send(True)
            return
        try:
            pipe.send(handlers[cmd](arg))
        except Exception:
            pipe.send(RuntimeError(f"sglang {role} tp{spec['tp_rank']}: {cmd} failed:\n{traceback.format_exc()}"))


class SglangRank(SpawnedProcess):
    """One SGLang PD rank (``role`` "prefill" or "decode") in a spawned process; :meth:`call` runs a command.

    ``spec`` keys: layers, heads (this rank's), head_dim, page_size, num_pages, aux_rows, device, tp_size,
    tp_rank; optional dtype (bfloat16), seed (prefill fill), env (variables set before the engine is made),
    timeout_s (transfer bound).
    """

    def __init__(self, role: str, spec: Dict[str, Any], start_timeout: float = 180.0, call_timeout: float = 120.0):
        serve = _serve_prefill if role == "prefill" else _serve_decode
        super().__init__(serve, (spec,), start_timeout, call_timeout)
        self.role, self.spec = role, spec
        self.info = self.call("info")
