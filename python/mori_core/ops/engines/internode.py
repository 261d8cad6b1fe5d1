"""Inter-node MORI-EP: the InterNode, InterNodeV1, InterNodeV1LL and AsyncLL kernel types.

Routing is hierarchical. Rank ``r`` is local rank ``r % gpu_per_node`` of node
``r // gpu_per_node``. A token crosses the network at most once per destination node: to the
GPU with the same local rank there (its "proxy"). The proxy forwards it over NVLink to the
token's destination ranks on its node. Rows for ranks on the sender's own node go straight
over NVLink. Combine runs the other way. Each node first sums its rows for a token in fp32
(ascending local rank) and rounds once to the combine dtype. That partial row crosses the
network once, and the source rank adds the node partials in fp32 in ascending node order.
With one GPU per node or a single node this is exactly IntraNode's fp32 sum over ranks.

The network hop uses NVSHMEM (``mori_core._internode``, a separate extension built only
when NVSHMEM is found; see docs/ep.md). NVSHMEM is bootstrapped through the shmem bootstrap
store with its unique-id bootstrap. NVLink traffic goes through mori_core.shmem's symmetric
heap, as in IntraNode.

Kernel types (MORI's names and values):

* ``InterNode``: every dispatch block stages network rows and writes node peers.
* ``InterNodeV1`` / ``InterNodeV1LL``: blocks ``[0, rdma_block_num)`` stage network rows
  while the rest write node peers (MORI's AUTO: 96 blocks, 64 RDMA, 8 warps).
* ``AsyncLL``: ``dispatch_send``/``combine_send`` launch the send half and return;
  ``dispatch_recv``/``combine_recv`` wait for the peers and finish, so compute can run in
  between. The other types finish both halves in ``dispatch``/``combine``.

Network path, per peer node (every warp of the grid moves rows on both):

* *direct*: the peer's NVSHMEM heap is load/store-reachable from this GPU (``nvshmem_ptr`` is
  not null: the same NVLink domain). Rows are stored straight into its receive area.
* *put*: every other peer. Rows are staged locally and sent with NVSHMEM puts of
  ``MORI_EP_INTERNODE_PUT_ROWS`` rows (default 1: one put per token and node), issued by the
  warp that staged them as soon as they are ready, so many puts are in flight.

``MORI_EP_INTERNODE_PATH=put`` (read when an op is created; default ``auto``) sends every peer
through the put path, as if none were load/store-reachable. NVSHMEM then carries the puts over
whatever transport it has (P2P on one machine), so the network path's logic runs and can be
timed without a NIC.

Every wait is bounded (``MORI_EP_TIMEOUT_MS``). A timeout names the rank that never arrived,
and the next call raises :class:`~mori_core.ops.EpOpError`. All calls are device-side only (no
host sync), so they can be captured in CUDA graphs.

This module is the inter-node engine behind :class:`~mori_core.ops.EpDispatchCombineOp` (which
returns its ``InterNodeEpDispatchCombineOp`` face for these kernel types).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mori_core.ops.call_cache import RowBuffer, stream_handle_getter
from mori_core.ops.config import (
    INTERNODE_KERNEL_TYPES,
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineQuantType,
    normalize_kernel_type,
    normalize_quant_type,
)
from mori_core.ops.engines.gpu_common import HandleEngine, byte_view, handle_fields, require_gpu_ops
from mori_core.ops.errors import EpOpError
from mori_core.ops.launch_config import LaunchParams, checked_grid, launch_mode, resolve_internode
# NVSHMEM's symmetric heap when the user sets none: what the op needs, twice, at least 1 GiB.
_MIN_NVSHMEM_HEAP = 1 << 30
PATH_ENV = "MORI_EP_INTERNODE_PATH"
PUT_ROWS_ENV = "MORI_EP_INTERNODE_PUT_ROWS"
NET_PATHS = ("auto", "put")

_MODULE: Any = None
_NET_STATE: dict[str, Any] = {}


def _preload_nvshmem_host() -> None:
    """Load libnvshmem_host.so.3 from the installed nvidia-nvshmem package (global symbols), in
    case the extension's RPATH does not reach it (e.g. a different site-packages layout)."""
    spec = importlib.util.find_spec("nvidia.nvshmem")
    if spec is None or not spec.submodule_search_locations:
        return
    for base in spec.submodule_search_locations:
        lib = os.path.join(base, "lib", "libnvshmem_host.so.3")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


def load_internode() -> Any:
    """Import ``mori_core._internode`` (the inter-node kernels), or raise RuntimeError that names
    what is missing: the extension (build without NVSHMEM) or NVSHMEM's host library."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    if importlib.util.find_spec("mori_core._internode") is None:
        raise RuntimeError(
            "the inter-node EP kernels (InterNode, InterNodeV1, InterNodeV1LL, AsyncLL) are not in this "
            "mori_core build: it was built without NVSHMEM (mori_core.build_info()['internode'] is False). "
            "Install nvidia-nvshmem-cu13 (or set NVSHMEM_HOME) and rebuild mori-suite with a CUDA toolkit"
        )
    try:
        _preload_nvshmem_host()
        from mori_core import _internode
    except OSError as e:
        raise RuntimeError(
            f"NVSHMEM's host library could not be loaded ({e}); install nvidia-nvshmem-cu13 (the version "
            "mori-suite was built against)"
        ) from None
    except ImportError as e:
        raise RuntimeError(
            f"mori_core._internode failed to import ({e}); it needs NVSHMEM's host library "
            "(libnvshmem_host.so.3 from nvidia-nvshmem-cu13) at run time"
        ) from None
    _MODULE = _internode
    return _MODULE


def ensure_network(config: EpDispatchCombineConfig, net_bytes_hint: int) -> None:
    """Initialise NVSHMEM once per process over the shmem bootstrap (collective on every rank).

    Rank 0 creates NVSHMEM's unique id and the shmem bootstrap store carries it to every
    rank. ``NVSHMEM_DISABLE_NVLS=1`` is always set (NVLink multicast is never used).
    ``NVSHMEM_SYMMETRIC_SIZE`` defaults to what the op needs, twice, and at least 1 GiB.
    ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` defaults to ``config.num_qp_per_pe``. User settings win.
    """
    from mori_core import shmem

    mod = load_internode()
    if mod.nvshmem_initialized():
        if _NET_STATE.get("world") != config.world_size:
            raise RuntimeError(
                f"NVSHMEM is initialised for {_NET_STATE.get('world')} ranks in this process, the op has "
                f"world_size={config.world_size}"
            )
        return
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    heap = max(_MIN_NVSHMEM_HEAP, 2 * int(net_bytes_hint))
    heap = -(-heap // (512 << 20)) * (512 << 20)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap))
    os.environ.setdefault("NVSHMEM_IBGDA_NUM_RC_PER_PE", str(config.num_qp_per_pe))
    uid = mod.nvshmem_unique_id() if config.rank == 0 else None
    uids = shmem.exchange("nvshmem_uid", uid)
    mod.nvshmem_init(config.rank, config.world_size, uids[0], shmem.shmem_device())
    _NET_STATE["world"] = config.world_size
    shmem.register_finalizer(_finalize_network)


def _finalize_network() -> None:
    if _MODULE is not None and _MODULE.nvshmem_initialized():
        _MODULE.nvshmem_finalize()
    _NET_STATE.clear()


def network_path_from_env(max_tokens: int) -> tuple[bool, int]:
    """``(force_put, put_rows)`` from ``MORI_EP_INTERNODE_PATH`` (``auto``/``put``, default auto)
    and ``MORI_EP_INTERNODE_PUT_ROWS`` (rows per NVSHMEM put, 1..``max_tokens``, default 1);
    raises ValueError naming the variable and what it accepts."""
    path = os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
    if path not in NET_PATHS:
        raise ValueError(f"{PATH_ENV}={path!r} must be one of {', '.join(NET_PATHS)}")
    raw = os.environ.get(PUT_ROWS_ENV, "1").strip() or "1"
    rows = int(raw) if raw.isdigit() else 0
    if not 1 <= rows <= max_tokens:
        raise ValueError(f"{PUT_ROWS_ENV}={raw!r} must be an integer in [1, max_num_inp_token_per_rank={max_tokens}]")
    return path == "put", rows


def network_bytes(config: EpDispatchCombineConfig) -> int:
    """NVSHMEM heap bytes one op needs (0 when the group is one node)."""
    nodes = config.world_size // config.gpu_per_node
    if nodes <= 1:
        return 0
    row = config.hidden_dim * config.max_token_type_size
    topk, scale = config.num_experts_per_token, config.scale_dim * config.scale_type_size
    disp = -(-(row + 8 * topk + scale + 4) // 16) * 16
    comb = -(-(row + 4 * topk) // 16) * 16
    return 2 * 2 * nodes * config.max_num_inp_token_per_rank * (disp + comb) + (1 << 20)




@dataclass(frozen=True)
class InterNodeLaunch(LaunchParams):
    """Grid of an inter-node launch: blocks ``[0, rdma_block_num)`` stage network rows (V1/V1LL)."""

    rdma_block_num: int = 0


class InterNodeEngine(HandleEngine):
    """The inter-node kernels of one op (see the module docstring). Construction is collective
    (same order on every rank) and initialises NVSHMEM on first use when the group spans more
    than one node."""

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        kt = normalize_kernel_type(config.kernel_type)
        if kt not in INTERNODE_KERNEL_TYPES:
            raise ValueError(f"kernel_type {kt.name} is not an inter-node type")
        if normalize_quant_type(config.quant_type) != EpDispatchCombineQuantType.None_:
            raise NotImplementedError(f"quant_type={config.quant_type!r} is not implemented; use 'none'")
        require_gpu_ops()
        mod = load_internode()
        from mori_core import shmem

        force_put, put_rows = network_path_from_env(config.max_num_inp_token_per_rank)
        self._place(config)
        self.kernel_type = kt
        self.split_phases = kt == EpDispatchCombineKernelType.AsyncLL
        hcfg = dict(handle_fields(config), gpu_per_node=config.gpu_per_node)
        nodes = config.world_size // config.gpu_per_node
        if nodes > 1:
            ensure_network(config, network_bytes(config))
        self._ipc_bytes = int(mod.ipc_bytes(hcfg))
        self._ipc = shmem.shmem_malloc_align(4096, self._ipc_bytes)
        node0 = (config.rank // config.gpu_per_node) * config.gpu_per_node
        deltas = [
            shmem.shmem_ptr_p2p(self._ipc, config.rank, node0 + l) - self._ipc for l in range(config.gpu_per_node)
        ]
        try:
            self._handle = mod.InterNodeHandle(hcfg, self._ipc, deltas, self.device.index, force_put)
        except BaseException:
            shmem.shmem_free(self._ipc)
            raise
        self.handle = self._handle
        # Same heap offset on every rank, and every rank zeroed its buffers before any peer writes.
        from mori_core import _C

        shmem.verify_symmetric("ep_internode_offset", self._ipc - int(_C.shmem_heap_info()["base"]))
        self._bind_buffers()  # also the placeholder address for empty weights / scales tensors
        self._handle.put_rows = put_rows
        self.launch_config_mode = launch_mode()
        self.failure = mod.InterNodeOpFailure
        # Bound once for the launches (the op's hot path): the native fast calls, the handle's
        # address (0 once closed: the fast calls refuse it), the raw stream accessor.
        self._addr = int(self._handle.address)
        self._dispatch_native = mod.launch_dispatch
        self._combine_native = mod.launch_combine
        self._stream_of = stream_handle_getter()
        self._dev = self.device.index
        self._phase_names = tuple(mod.PHASE_POINTS)

    @property
    def uses_network(self) -> bool:
        """True when the group spans several nodes (NVSHMEM carries the inter-node rows)."""
        return bool(self._handle.uses_network)

    @property
    def network_paths(self) -> dict[str, int]:
        """Peer nodes per network path: ``{"direct": ..., "put": ...}`` (see the module docstring)."""
        return {"direct": int(self._handle.direct_peers), "put": int(self._handle.put_peers)}

    def phase_times(self) -> tuple[torch.Tensor, tuple[str, ...]]:
        """The kernels' phase timestamps: a view ``int64 [2, ring, points]`` (dispatch, combine; row
        ``round % ring``; globaltimer ns of this GPU, 0 where never written) and the point names.
        Read it after synchronising; differences within one round give the time of each phase."""
        ptr, nbytes = self._handle.phase_ring()
        ring = byte_view(ptr, nbytes, self.device).view(torch.int64)
        return ring.view(2, -1, len(self._phase_names)), self._phase_names

    # ------------------------------------------------------------------ launches
    def resolve_launch(
        self, kernel: str, num_tokens: int, block_num: int, rdma_block_num: int, warp_per_block: int
    ) -> InterNodeLaunch:
        """Per-call overrides > MORI's AUTO table > config; only dispatch takes ``rdma_block_num``
        (InterNode and AsyncLL have no dedicated network blocks)."""
        cfg = self.config
        b, r, w = resolve_internode(
            self.kernel_type.name,
            block_num,
            rdma_block_num if kernel == "dispatch" else -1,
            warp_per_block,
            cfg.block_num,
            cfg.rdma_block_num,
            cfg.warp_num_per_block,
            self.launch_config_mode,
        )
        checked_grid(LaunchParams(b, w))
        if self.kernel_type in (EpDispatchCombineKernelType.InterNode, EpDispatchCombineKernelType.AsyncLL):
            r = 0  # these types have no dedicated network blocks
        return InterNodeLaunch(b, w, r)

    def launch_dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                        indices: torch.Tensor, num_tokens: int, row_bytes: int, plan: InterNodeLaunch, finish: bool
                        ) -> None:
        """Send every token through the network once per destination node, then over NVLink
        inside the node; without ``finish`` only the send half (AsyncLL's dispatch_send). Raises
        EpOpError when an earlier kernel of the op failed."""
        try:
            self._dispatch_native(self._addr, input.data_ptr(), row_bytes, num_tokens,
                                  0 if weights is None else (weights.data_ptr() or self._placeholder),
                                  0 if scales is None else (scales.data_ptr() or self._placeholder),
                                  indices.data_ptr(), plan.block_num, plan.warp_per_block, plan.rdma_block_num, finish,
                                  self._stream_of(self._dev))
        except self.failure as e:
            raise EpOpError(str(e)) from None

    def finish_dispatch(self, plan: InterNodeLaunch) -> None:
        """Wait for the other nodes' rows, forward them inside the node, publish ``total_recv``."""
        self._handle.dispatch_recv(plan.block_num, plan.warp_per_block, self._stream_of(self._dev))

    def launch_combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor,
                       num_tokens: int, rows: RowBuffer, input_rows: int, push: bool, plan: InterNodeLaunch,
                       finish: bool) -> None:
        """Sum the rows inside each node first (fp32, rounded once to the combine dtype), then
        across nodes in fp32 in ascending node order (push reads ``input``; pull reads the
        registered buffer); without ``finish`` only the send half. Raises EpOpError when an
        earlier kernel of the op failed."""
        try:
            self._combine_native(self._addr, input.data_ptr(), rows.dtype_code, rows.view.shape[1], input_rows,
                                 0 if weights is None else (weights.data_ptr() or self._placeholder),
                                 0 if weights is None else int(weights.shape[0]), indices.data_ptr(), num_tokens,
                                 push, plan.block_num, plan.warp_per_block, finish, self._stream_of(self._dev))
        except self.failure as e:
            raise EpOpError(str(e)) from None

    def finish_combine(self, plan: InterNodeLaunch) -> None:
        """Wait for the other nodes' partial rows and write the sums."""
        self._handle.combine_recv(plan.block_num, plan.warp_per_block, self._stream_of(self._dev))

    # ------------------------------------------------------------------ profiler and teardown
    def debug_time_buf(self) -> torch.Tensor:
        raise NotImplementedError(f"the kernel profiler covers the IntraNode kernels, not {self.config.kernel_type}")

    def close(self) -> None:
        """Free the NVSHMEM and node-local buffers (collective: call on every rank)."""
        handle = getattr(self, "_handle", None)
        if handle is None:
            return
        from mori_core import shmem

        torch.cuda.synchronize(self.device)
        self._views = {}
        self._addr = 0
        handle.close()
        self._handle = self.handle = None
        try:
            shmem.shmem_free(self._ipc)
        except RuntimeError:
            pass  # shmem was finalised first: the heap (and this block) is gone already
