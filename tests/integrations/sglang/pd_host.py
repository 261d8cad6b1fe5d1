"""One OS process playing SGLang PD roles for the tests (run as a script by ``pd_cluster``).

It loads SGLang's real plugin loader (so our entry point applies as in a server),
resolves classes through SGLang's ``get_kv_class(TransferBackend.MORI, ...)``, and
hosts bootstrap servers, prefill or decode managers with CPU KV / aux / state
buffers, plus their senders and receivers. Commands arrive over a
``multiprocessing.connection`` and return ``("ok", result)`` or ``("err", traceback)``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client
from typing import Any, Dict, List, Optional

import numpy as np
import torch

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, StateType  # noqa: E402
from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


class _SingleStage:
    """Stands in for torch.distributed's pipeline group of a 1-stage deployment."""

    world_size = 1
    rank_in_group = 0
    is_first_rank = True
    is_last_rank = True


def _kv_class(kind: KVClassType):
    cls = get_kv_class(TransferBackend.MORI, kind)
    if not cls.__module__.startswith("mori_integrations.sglang"):
        raise AssertionError(f"get_kv_class(MORI, {kind}) resolved to {cls.__module__}.{cls.__qualname__}")
    return cls


class Host:
    def __init__(self) -> None:
        self.servers: Dict[str, Any] = {}
        self.managers: Dict[str, Any] = {}
        self.buffers: Dict[str, Dict[str, Any]] = {}
        self.senders: Dict[tuple, Any] = {}
        self.receivers: Dict[tuple, Any] = {}

    # ------------------------------------------------------------ setup
    def ping(self) -> int:
        return os.getpid()

    def bootstrap(self, name: str) -> int:
        server = _kv_class(KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", 0)
        self.servers[name] = server
        return int(server.port)

    def manager(self, name: str, role: str, tp_size: int, tp_rank: int, bootstrap_port: int, layout: dict, seed: int) -> dict:
        server_args = ServerArgs(
            model_path="dummy",
            tp_size=tp_size,
            disaggregation_mode=role,
            disaggregation_transfer_backend="mori",
            disaggregation_bootstrap_port=bootstrap_port,
            host="127.0.0.1",
            page_size=layout["page_size"],
            device="cpu",
        )
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=tp_rank))
        get_parallel().override_permanently(pp_group=_SingleStage())
        kv_args, buffers = self._kv_args(layout, tp_size, tp_rank)
        if role == "prefill":
            gen = torch.Generator().manual_seed(seed)
            for t in buffers["kv"] + buffers["aux"] + [x for c in buffers["state"] for x in c]:
                flat = t.view(-1).view(torch.uint8)
                flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        cls = _kv_class(KVClassType.MANAGER)
        mgr = cls(kv_args, DisaggregationMode(role), server_args, layout["mla"])
        self.managers[name] = mgr
        self.buffers[name] = buffers
        return {"rank_port": mgr.rank_port, "engine_key": mgr.engine_desc.key, "backends": mgr.engine.backends().__repr__()}

    def _kv_args(self, layout: dict, tp_size: int, tp_rank: int):
        page_size, num_pages, layers = layout["page_size"], layout["num_pages"], layout["layers"]
        slots = page_size * num_pages
        kv_args = KVArgs()
        kv_args.engine_rank = tp_rank
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "bfloat16"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = layers
        kv_args.num_draft_entries = 0
        kv_args.page_size = page_size
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        if layout["mla"]:
            kv = [torch.zeros(slots, 1, layout["mla_dim"], dtype=torch.bfloat16) for _ in range(layers)]
            kv_args.kv_layer_ids = list(range(layers))
        else:
            heads = layout["total_heads"] // tp_size
            kv = [torch.zeros(slots, heads, layout["head_dim"], dtype=torch.bfloat16) for _ in range(2 * layers)]
            kv_args.kv_layer_ids = list(range(layers)) * 2
            kv_args.kv_head_num = heads
            kv_args.total_kv_head_num = layout["total_heads"]
        kv_args.kv_data_ptrs = [t.data_ptr() for t in kv]
        kv_args.kv_data_lens = [t.numel() * t.element_size() for t in kv]
        kv_args.kv_item_lens = [t[0].numel() * t.element_size() * page_size for t in kv]
        meta = MetadataBuffers(size=8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0)
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
        aux = [t for t in vars(meta).values() if isinstance(t, torch.Tensor) and t.data_ptr() in kv_args.aux_data_ptrs]
        aux.sort(key=lambda t: kv_args.aux_data_ptrs.index(t.data_ptr()))
        state: List[List[torch.Tensor]] = []
        kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [], [], [], []
        kv_args.state_dim_per_tensor, kv_args.state_layer_ids = [], []
        kv_args.state_slice_outer_counts, kv_args.state_conv_shard_groups = [], []
        kv_args.is_hybrid_mla_backend = False
        kv_args.swa_kv_cache_layout = "nhd" if layout.get("state") else None
        kv_args.mla_compression_ratios = None
        for comp in layout.get("state", []):
            if comp == "mamba":  # per layer: conv [slots, 24] and temporal [slots, 2, 8] float32
                tensors = [torch.zeros(8, 24) for _ in range(layers)] + [torch.zeros(8, 2, 8) for _ in range(layers)]
                item_lens = [t[0].numel() * 4 for t in tensors]
                kind, layer_ids = StateType.MAMBA, list(range(layers)) * 2
                dims = [24] * layers + [2] * layers
            else:  # "swa": paged window K/V per layer, same geometry as a 1-head KV page
                tensors = [torch.zeros(slots, 1, 16, dtype=torch.bfloat16) for _ in range(2 * layers)]
                item_lens = [t[0].numel() * t.element_size() * page_size for t in tensors]
                kind, layer_ids, dims = StateType.SWA, list(range(layers)) * 2, []
            state.append(tensors)
            kv_args.state_types.append(kind)
            kv_args.state_data_ptrs.append([t.data_ptr() for t in tensors])
            kv_args.state_data_lens.append([t.numel() * t.element_size() for t in tensors])
            kv_args.state_item_lens.append(item_lens)
            kv_args.state_dim_per_tensor.append(dims)
            kv_args.state_layer_ids.append(layer_ids)
            kv_args.state_slice_outer_counts.append([1] * len(tensors))
            kv_args.state_conv_shard_groups.append([None] * len(tensors))
        return kv_args, {"kv": kv, "aux": aux, "state": state, "meta": meta}

    # -------------------------------------------------------- requests
    def sender(self, name: str, room: int, addr: str) -> int:
        s = _kv_class(KVClassType.SENDER)(self.managers[name], addr, room)
        self.senders[(name, room)] = s
        return int(s.poll())

    def sender_init(self, name: str, room: int, num_pages: int, aux_index: int) -> None:
        self.senders[(name, room)].init(num_pages, aux_index)

    def sender_send(self, name: str, room: int, pages: List[int], state: Optional[List[List[int]]] = None) -> None:
        st = None if state is None else [np.asarray(s, dtype=np.int32) for s in state]
        self.senders[(name, room)].send(np.asarray(pages, dtype=np.int32), st)

    def sender_abort(self, name: str, room: int) -> None:
        self.senders[(name, room)].abort()

    def receiver(self, name: str, room: int, addr: str) -> int:
        mgr = self.managers[name]
        deadline = time.monotonic() + 20
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill parallel info not available at {addr}")
            time.sleep(0.05)
        r = _kv_class(KVClassType.RECEIVER)(mgr, addr, room)
        r.init(0)
        self.receivers[(name, room)] = r
        return int(r.poll())

    def receiver_send_metadata(self, name: str, room: int, pages: List[int], aux_index: int, state=None) -> None:
        st = None if state is None else [np.asarray(s, dtype=np.int32) for s in state]
        self.receivers[(name, room)].send_metadata(np.asarray(pages, dtype=np.int32), aux_index, st)

    def receiver_abort(self, name: str, room: int) -> None:
        self.receivers[(name, room)].abort()

    def poll(self, side: str, name: str, room: int) -> int:
        return int((self.senders if side == "sender" else self.receivers)[(name, room)].poll())

    def wait(self, side: str, name: str, room: int, until: List[int], within: float) -> dict:
        obj = (self.senders if side == "sender" else self.receivers)[(name, room)]
        start = time.monotonic()
        while True:
            status = int(obj.poll())
            if status in until or time.monotonic() - start > within:
                return {"status": status, "elapsed": time.monotonic() - start}
            time.sleep(0.01)

    def failure(self, side: str, name: str, room: int) -> str:
        obj = (self.senders if side == "sender" else self.receivers)[(name, room)]
        try:
            obj.failure_exception()
        except KVTransferError as e:
            return e.failure_reason
        return ""

    def clear(self, side: str, name: str, room: int) -> None:
        (self.senders if side == "sender" else self.receivers).pop((name, room)).clear()

    def abort_release_safe(self, name: str, room: int, required_acks: int) -> bool:
        return bool(self.managers[name].is_abort_release_safe(room, required_acks))

    # ------------------------------------------------------- inspection
    def read_kv(self, name: str, pages: List[int]) -> List[np.ndarray]:
        page_size = self.managers[name].kv_args.page_size
        out = []
        for t in self.buffers[name]["kv"]:
            raw = t.view(torch.uint8).reshape(t.shape[0] // page_size, -1)
            out.append(raw[pages].numpy().copy())
        return out

    def read_aux(self, name: str, row: int) -> List[bytes]:
        return [t[row].contiguous().view(torch.uint8).numpy().tobytes() for t in self.buffers[name]["aux"]]

    def read_state(self, name: str, comp: int, rows: List[int], page_size: int = 1) -> List[np.ndarray]:
        out = []
        for t in self.buffers[name]["state"][comp]:
            raw = t.contiguous().view(torch.uint8).reshape(t.shape[0] // page_size, -1)
            out.append(raw[rows].numpy().copy())
        return out

    def probe_first_peer(self, name: str) -> str:
        """Prefill: one raw write into the first registered decode peer's first KV region."""
        mgr = self.managers[name]
        peer = next(iter(mgr.decode_kv_args_table.values()))
        engine = mgr.engine
        status = engine.write(mgr.kv_descs[0], 0, peer.kv_descs[0], 0, 64, engine.allocate_transfer_uid())
        status.WaitFor(20000)
        return str(status.Code().name)

    def manager_info(self, name: str) -> dict:
        mgr = self.managers[name]
        return {"rank_port": int(mgr.rank_port), "engine_key": mgr.engine_desc.key,
                "transfer_timeout_s": getattr(mgr, "_transfer_timeout_s", None)}

    def teardown(self, name: str) -> None:
        self.managers.pop(name).teardown()

    def threads(self) -> List[str]:
        return [t.name for t in threading.enumerate()]

    def bytes_sent(self, name: str) -> int:
        return int(self.managers[name].bytes_sent)


def main() -> None:
    host, port = os.environ["PD_HOST_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=os.environ["PD_HOST_KEY"].encode())
    h = Host()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd, kwargs = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(h, cmd)(**kwargs)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # daemon threads of torn-down managers must not delay exit
