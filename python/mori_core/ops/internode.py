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

Every wait is bounded (``MORI_EP_TIMEOUT_MS``). A timeout names the rank that never arrived,
and the next call raises :class:`~mori_core.ops.dispatch_combine.EpOpError`. All calls are
device-side only (no host sync), so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import Any, Optional

import torch

from mori_core.ops.config import (
    INTERNODE_KERNEL_TYPES,
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineQuantType,
    normalize_kernel_type,
    normalize_quant_type,
)
from mori_core.ops.dispatch_combine import (
    DEFAULT_TIMEOUT_MS,
    TIMEOUT_ENV,
    EpDispatchCombineOp,
    gpu_ops_available,
)
from mori_core.ops.call_cache import typed_view as _typed_view
from mori_core.ops.launch_config import LaunchParams, launch_mode, resolve_internode
from mori_core.ops.validation import (
    COMBINE_DTYPES,
    DISPATCH_DTYPES,
    check_combine_args,
    check_dispatch_args,
    check_launch_overrides,
    resolve_combine_mode,
)

_COMBINE_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1}
# NVSHMEM's symmetric heap when the user sets none: what the op needs, twice, at least 1 GiB.
_MIN_NVSHMEM_HEAP = 1 << 30

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


def _handle_config(config: EpDispatchCombineConfig, timeout_ms: int) -> dict[str, int]:
    return dict(
        rank=config.rank,
        world_size=config.world_size,
        gpu_per_node=config.gpu_per_node,
        hidden_dim=config.hidden_dim,
        scale_dim=config.scale_dim,
        scale_type_size=config.scale_type_size if config.scale_dim > 0 else 0,
        max_token_type_size=config.max_token_type_size,
        max_num_inp_token_per_rank=config.max_num_inp_token_per_rank,
        num_experts_per_rank=config.num_experts_per_rank,
        num_experts_per_token=config.num_experts_per_token,
        max_num_tokens_to_recv=config.max_num_tokens_to_recv(),
        timeout_ms=timeout_ms,
    )


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


class InterNodeEpDispatchCombineOp(EpDispatchCombineOp):
    """Inter-node EP dispatch/combine (MORI's API; see the module docstring).

    Created through ``EpDispatchCombineOp(config)`` when ``config.kernel_type`` is an inter-node
    type. Needs :mod:`mori_core.shmem` initialised on all ``world_size`` ranks. Construction is
    collective (same order on every rank) and initialises NVSHMEM on first use when the group
    spans more than one node.
    """

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        config.validate()
        kt = normalize_kernel_type(config.kernel_type)
        if kt not in INTERNODE_KERNEL_TYPES:
            raise ValueError(f"kernel_type {kt.name} is not an inter-node type")
        if normalize_quant_type(config.quant_type) != EpDispatchCombineQuantType.None_:
            raise NotImplementedError(f"quant_type={config.quant_type!r} is not implemented; use 'none'")
        ok, why = gpu_ops_available()
        if not ok:
            raise RuntimeError(f"EpDispatchCombineOp needs the GPU build: {why}")
        mod = load_internode()
        from mori_core import shmem

        shmem.require_initialized(config.rank, config.world_size)
        self.config = config
        self.kernel_type = kt
        self.device = torch.device("cuda", shmem.shmem_device())
        timeout_ms = int(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_MS))
        if timeout_ms <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be a positive number of milliseconds, got {timeout_ms}")
        nodes = config.world_size // config.gpu_per_node
        if nodes > 1:
            ensure_network(config, network_bytes(config))
        hcfg = _handle_config(config, timeout_ms)
        self._ipc_bytes = int(mod.ipc_bytes(hcfg))
        self._ipc = shmem.shmem_malloc_align(4096, self._ipc_bytes)
        node0 = (config.rank // config.gpu_per_node) * config.gpu_per_node
        deltas = [
            shmem.shmem_ptr_p2p(self._ipc, config.rank, node0 + l) - self._ipc for l in range(config.gpu_per_node)
        ]
        try:
            self._handle = mod.InterNodeHandle(hcfg, self._ipc, deltas, self.device.index)
        except BaseException:
            shmem.shmem_free(self._ipc)
            raise
        # Same heap offset on every rank, and every rank zeroed its buffers before any peer writes.
        from mori_core import _C

        shmem.verify_symmetric("ep_internode_offset", self._ipc - int(_C.shmem_heap_info()["base"]))
        self._adopt_buffers(config)
        self.launch_config_mode = launch_mode()
        self._dispatch_tokens: Optional[int] = None
        self._pending_dispatch: Optional[tuple[int, int]] = None
        self._pending_combine: Optional[tuple[int, int]] = None
        self._cached_dispatch_launch: Optional[LaunchParams] = None
        self._cached_combine_launch: Optional[LaunchParams] = None
        self._cached_rdma_block_num = 0

    # ------------------------------------------------------------------ launch parameters
    @property
    def uses_network(self) -> bool:
        """True when the group spans several nodes (NVSHMEM carries the inter-node rows)."""
        return bool(self._handle.uses_network)

    def _resolve(self, block_num: int, rdma_block_num: int, warp_per_block: int) -> tuple[int, int, int]:
        cfg = self.config
        b, r, w = resolve_internode(
            self.kernel_type.name,
            block_num,
            rdma_block_num,
            warp_per_block,
            cfg.block_num,
            cfg.rdma_block_num,
            cfg.warp_num_per_block,
            self.launch_config_mode,
        )
        if not 1 <= w <= 16:
            raise ValueError(f"warp_per_block={w} must be in [1, 16] (512 threads per block)")
        if b < 1:
            raise ValueError(f"block_num={b} must be >= 1")
        if self.kernel_type in (EpDispatchCombineKernelType.InterNode, EpDispatchCombineKernelType.AsyncLL):
            r = 0  # these types have no dedicated network blocks
        return b, r, w

    def get_launch_config(self, is_dispatch: bool = True, num_tokens: int = 0, zero_copy: bool = False) -> LaunchParams:
        """The (block_num, warp_per_block) a call without overrides would use."""
        b, _, w = self._resolve(-1, -1, -1)
        return LaunchParams(b, w)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # ------------------------------------------------------------------ dispatch
    def _dispatch_views(
        self, input: torch.Tensor, hidden: int, has_scales: bool, scales: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        cfg, mr = self.config, self._max_recv
        out = _typed_view(self._bufs["dispatch_out"], input.dtype, mr, hidden)
        out_weights = _typed_view(self._bufs["dispatch_out_weights"], torch.float32, mr, cfg.num_experts_per_token)
        out_indices = _typed_view(self._bufs["dispatch_out_indices"], torch.int32, mr, cfg.num_experts_per_token)
        out_scales = None
        if has_scales:
            out_scales = _typed_view(self._bufs["dispatch_out_scales"], scales.dtype, mr, cfg.scale_dim)
        return out, out_weights, out_scales, out_indices, self._total_recv

    def _dispatch_send(self, input, weights, scales, indices, block_num, rdma_block_num, warp_per_block):
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        if self._pending_dispatch is not None:
            raise RuntimeError("dispatch_send() was called twice without dispatch_recv()")
        args = check_dispatch_args(
            self.config, input, weights, scales, indices, device=self.device, allowed_dtypes=DISPATCH_DTYPES
        )
        row_bytes = args.hidden_dim * input.element_size()
        if row_bytes % 16:
            raise ValueError(
                f"input rows must be a multiple of 16 bytes (hidden {args.hidden_dim} x {input.element_size()} B "
                f"= {row_bytes} B) for the 16-byte vector copies"
            )
        b, r, w = self._resolve(block_num, rdma_block_num, warp_per_block)
        self._cached_dispatch_launch, self._cached_rdma_block_num = LaunchParams(b, w), r
        self._handle.dispatch_send(
            input.data_ptr(),
            row_bytes,
            args.num_tokens,
            weights.data_ptr() if args.has_weights else 0,
            scales.data_ptr() if args.has_scales else 0,
            indices.data_ptr(),
            b,
            w,
            r,
            self._stream(),
        )
        self._pending_dispatch = (b, w)
        self._dispatch_tokens = args.num_tokens
        return self._dispatch_views(input, args.hidden_dim, args.has_scales, scales)

    def _dispatch_recv(self, call_local_expert_count: bool) -> None:
        if self._pending_dispatch is None:
            raise RuntimeError("dispatch_recv() needs a preceding dispatch_send()")
        b, w = self._pending_dispatch
        self._handle.dispatch_recv(b, w, self._stream())
        self._pending_dispatch = None
        if call_local_expert_count:
            self._count_local_experts(_typed_view(
                self._bufs["dispatch_out_indices"], torch.int32, self._max_recv, self.config.num_experts_per_token
            ))

    def dispatch(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Send every token once to each unique destination rank: through the network once per
        destination node, then over NVLink inside the node. Arguments and returns as
        :meth:`EpDispatchCombineOp.dispatch`; ``rdma_block_num`` is honoured by V1/V1LL."""
        res = self._dispatch_send(input, weights, scales, indices, block_num, rdma_block_num, warp_per_block)
        self._dispatch_recv(call_local_expert_count)
        return res

    def dispatch_send(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        scales: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """AsyncLL: launch the send half and return the output views (valid after
        :meth:`dispatch_recv`). Other types: the whole :meth:`dispatch` (MORI's behaviour)."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            return self.dispatch(input, weights, scales, indices, block_num=block_num, warp_per_block=warp_per_block,
                                 call_local_expert_count=call_local_expert_count)
        self._count_after_recv = call_local_expert_count
        return self._dispatch_send(input, weights, scales, indices, block_num, -1, warp_per_block)

    def dispatch_recv(
        self, block_num: int = -1, warp_per_block: int = -1, call_local_expert_count: bool = False
    ) -> None:
        """AsyncLL: wait for the other nodes' rows, forward them inside the node and publish
        ``total_recv``. Other types: nothing left to do (returns None)."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            if self._dispatch_tokens is None:
                raise RuntimeError("dispatch_recv() needs a preceding dispatch_send()")
            return None
        self._dispatch_recv(call_local_expert_count or getattr(self, "_count_after_recv", False))
        return None

    # ------------------------------------------------------------------ combine
    def _combine_send(self, input, weights, indices, block_num, rdma_block_num, warp_per_block, use_external_inp_buf):
        self.check_error(synchronize=False)
        check_launch_overrides(block_num, rdma_block_num, warp_per_block)
        if self._dispatch_tokens is None or self._pending_dispatch is not None:
            raise RuntimeError("combine() needs a preceding, completed dispatch()")
        if self._pending_combine is not None:
            raise RuntimeError("combine_send() was called twice without combine_recv()")
        cfg = self.config
        has_weights = check_combine_args(
            cfg, input, weights, indices, self._dispatch_tokens, device=self.device, allowed_dtypes=COMBINE_DTYPES
        )
        push = resolve_combine_mode(cfg, use_external_inp_buf)
        h = int(input.shape[1])
        if (h * input.element_size()) % 16:
            raise ValueError(f"input rows must be a multiple of 16 bytes, got hidden {h} x {input.element_size()} B")
        b, _, w = self._resolve(block_num, -1, warp_per_block)
        self._cached_combine_launch = LaunchParams(b, w)
        self._handle.combine_send(
            input.data_ptr(),
            _COMBINE_DTYPE_CODE[input.dtype],
            h,
            int(input.shape[0]),
            weights.data_ptr() if has_weights else 0,
            int(weights.shape[0]) if has_weights else 0,
            indices.data_ptr(),
            self._dispatch_tokens,
            bool(push),
            b,
            w,
            self._stream(),
        )
        self._pending_combine = (b, w)
        out = _typed_view(self._bufs["combine_out"], input.dtype, cfg.max_num_inp_token_per_rank, h)
        out_weights = None
        if has_weights:
            out_weights = _typed_view(
                self._bufs["combine_out_weights"], torch.float32, cfg.max_num_inp_token_per_rank,
                cfg.num_experts_per_token,
            )
        return out, out_weights

    def _combine_recv(self) -> None:
        if self._pending_combine is None:
            raise RuntimeError("combine_recv() needs a preceding combine_send()")
        b, w = self._pending_combine
        self._handle.combine_recv(b, w, self._stream())
        self._pending_combine = None

    def combine(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        use_external_inp_buf: int = -1,
        call_reset: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum the expert outputs per original token: inside each node first (fp32, rounded once
        to the combine dtype), then across nodes in fp32 in ascending node order. Arguments and
        returns as :meth:`EpDispatchCombineOp.combine` (push copies ``input`` into the registered
        buffer first; pull reads it in place)."""
        res = self._combine_send(input, weights, indices, block_num, rdma_block_num, warp_per_block,
                                 use_external_inp_buf)
        self._combine_recv()
        if call_reset:
            self.reset()
        return res

    def combine_send(
        self,
        input: torch.Tensor,
        weights: Optional[torch.Tensor],
        indices: torch.Tensor,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """AsyncLL: reduce inside the node and send the partial rows; returns the output views
        (valid after :meth:`combine_recv`). Other types: the whole :meth:`combine`."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            return self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)
        return self._combine_send(input, weights, indices, block_num, -1, warp_per_block, -1)

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """AsyncLL: wait for the other nodes' partial rows and write the sums. Other types:
        nothing left to do (returns None)."""
        if self.kernel_type == EpDispatchCombineKernelType.AsyncLL:
            self._combine_recv()
        return None

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Free the op's NVSHMEM and node-local buffers (collective: call on every rank)."""
        handle = getattr(self, "_handle", None)
        if handle is None:
            return
        from mori_core import shmem

        torch.cuda.synchronize(self.device)
        self._bufs = {}
        handle.close()
        self._handle = None
        try:
            shmem.shmem_free(self._ipc)
        except RuntimeError:
            pass  # shmem was finalised first: the heap (and this block) is gone already
