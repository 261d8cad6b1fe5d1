"""The hooks that make stock vLLM (0.30-0.33) run ``all2all_backend="mori_ep"``.

vLLM has no registry for all2all backends: the name is a closed ``Literal`` checked by
pydantic and argparse, the device communicator builds managers in an if/elif chain, and
``maybe_make_prepare_finalize`` picks prepare/finalize classes in another. Each hook below
extends one of those places for ``mori_ep`` only and leaves every other backend's path
untouched. :func:`resolve_targets` finds all hook points first, so a vLLM whose internals
moved is refused as a whole (nothing half-patched).

Every wrapper is marked with ``__mori_ep_hook__`` so installing twice is a no-op.
Hooks: 1. backend name, 2. communicator, 3. prepare/finalize, 4. CUDA graphs,
5. batched experts on request (VLLM_MORI_EP_BATCHED_EXPERTS).
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable

BACKEND = "mori_ep"
_MARK = "__mori_ep_hook__"


@dataclass(frozen=True)
class HookTargets:
    """The vLLM objects the hooks modify (found by :func:`resolve_targets`)."""

    parallel_config_cls: type
    arg_utils_module: Any
    parallel_module: Any
    communicator_cls: type
    all2all_utils_module: Any
    compilation_config_cls: type
    moe_parallel_config_cls: type


def resolve_targets() -> HookTargets:
    """Import and check every hook point; raise RuntimeError listing what is missing."""
    import vllm.config.parallel as parallel_module
    import vllm.engine.arg_utils as arg_utils_module
    import vllm.model_executor.layers.fused_moe.all2all_utils as all2all_utils_module
    from vllm.config import CompilationConfig, ParallelConfig
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    communicator_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
    missing = []
    if "all2all_backend" not in getattr(ParallelConfig, "__pydantic_fields__", {}):
        missing.append("ParallelConfig.__pydantic_fields__['all2all_backend']")
    if not hasattr(arg_utils_module, "_compute_kwargs"):
        missing.append("vllm.engine.arg_utils._compute_kwargs")
    if "use_all2all" not in inspect.signature(communicator_cls.__init__).parameters:
        missing.append(f"{communicator_cls.__qualname__}.__init__(use_all2all=...)")
    if not callable(getattr(all2all_utils_module, "maybe_make_prepare_finalize", None)):
        missing.append("all2all_utils.maybe_make_prepare_finalize")
    params = inspect.signature(getattr(all2all_utils_module, "maybe_make_prepare_finalize", lambda: None)).parameters
    for name in ("moe", "quant_config", "routing_tables", "use_monolithic", "all2all_manager"):
        if name not in params:
            missing.append(f"maybe_make_prepare_finalize({name}=...)")
    if not callable(getattr(CompilationConfig, "set_splitting_ops_for_v1", None)):
        missing.append("CompilationConfig.set_splitting_ops_for_v1")
    if not isinstance(FusedMoEParallelConfig.__dict__.get("use_batched_activation_format"), property):
        missing.append("FusedMoEParallelConfig.use_batched_activation_format (property)")
    if missing:
        raise RuntimeError("vLLM internals the mori_ep backend hooks into are missing: " + ", ".join(missing))
    return HookTargets(
        parallel_config_cls=ParallelConfig,
        arg_utils_module=arg_utils_module,
        parallel_module=parallel_module,
        communicator_cls=communicator_cls,
        all2all_utils_module=all2all_utils_module,
        compilation_config_cls=CompilationConfig,
        moe_parallel_config_cls=FusedMoEParallelConfig,
    )


def _mark(fn: Callable) -> Callable:
    setattr(fn, _MARK, True)
    return fn


def _is_hooked(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))


def configured_backend() -> Any:
    """``parallel_config.all2all_backend`` of the vLLM config being built/run (None outside)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.parallel_config.all2all_backend


# ---------------------------------------------------------------------------------- 1. name
def install_backend_name(t: HookTargets) -> None:
    """Add ``mori_ep`` to the ``all2all_backend`` Literal of ParallelConfig and the CLI."""
    import pydantic

    cls = t.parallel_config_cls
    field_info = cls.__pydantic_fields__["all2all_backend"]
    choices = typing.get_args(field_info.annotation)
    if BACKEND in choices:
        return
    extended = typing.Literal[(*choices, BACKEND)]  # type: ignore[valid-type]
    field_info.annotation = extended
    cls.__annotations__["all2all_backend"] = extended
    cls.__dataclass_fields__["all2all_backend"].type = extended
    if not pydantic.dataclasses.rebuild_dataclass(cls, force=True):
        raise RuntimeError("pydantic could not rebuild ParallelConfig with all2all_backend='mori_ep'")
    # Configs that embed ParallelConfig (SpeculativeConfig, VllmConfig) carry a copy of its
    # old schema; rebuild them too, innermost first, so nested dict input validates as well.
    _rebuild_embedding_configs(cls)
    t.parallel_module.All2AllBackend = extended
    # argparse choices come from this cache (vllm serve --all2all-backend).
    t.arg_utils_module._compute_kwargs.cache_clear()


def _rebuild_embedding_configs(target: type) -> None:
    """Rebuild every pydantic config class of ``vllm.config`` whose fields reach ``target``."""
    import dataclasses

    import pydantic

    import vllm.config as config_module

    classes = [
        obj
        for obj in vars(config_module).values()
        if isinstance(obj, type) and obj is not target and "__pydantic_fields__" in obj.__dict__
    ]

    def field_types(cls: type) -> list[type]:
        found: list[type] = []
        stack = [f.annotation for f in cls.__pydantic_fields__.values()]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                found.append(tp)
            stack.extend(typing.get_args(tp))
        return found

    reaches: dict[type, bool] = {}

    def reaches_target(cls: type, seen: frozenset = frozenset()) -> bool:
        if "__pydantic_fields__" not in cls.__dict__:  # plain dataclasses embed no pydantic schema
            return False
        if cls not in reaches:
            deps = [d for d in field_types(cls) if d not in seen]
            reaches[cls] = any(d is target or reaches_target(d, seen | {cls}) for d in deps)
        return reaches[cls]

    rebuilt: set[type] = set()

    def rebuild(cls: type) -> None:
        if cls in rebuilt:
            return
        rebuilt.add(cls)
        for dep in field_types(cls):
            if dep is not target and "__pydantic_fields__" in dep.__dict__ and reaches_target(dep):
                rebuild(dep)
        pydantic.dataclasses.rebuild_dataclass(cls, force=True)

    for cls in classes:
        if reaches_target(cls):
            rebuild(cls)


# -------------------------------------------------------------------------- 2. communicator
def install_communicator_hook(t: HookTargets) -> None:
    """Make the platform's device communicator build :class:`MoriEpAll2AllManager` for mori_ep.

    The stock constructor raises on an unknown backend, so for mori_ep it runs with
    ``use_all2all=False`` and the manager is installed afterwards (what the stock branch
    would have done). Without ``--enable-expert-parallel`` vLLM runs data parallelism with
    its naive all-gather/reduce-scatter dispatch, so that case gets vLLM's AgRs manager.
    """
    cls = t.communicator_cls
    if not _is_hooked(cls.__init__):
        original_init = cls.__init__
        signature = inspect.signature(original_init)

        @functools.wraps(original_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            # Forwarding the caller's own arguments unchanged (this wraps a foreign signature).
            bound = signature.bind(self, *args, **kwargs)
            if not (bound.arguments.get("use_all2all") and configured_backend() == BACKEND):
                original_init(*bound.args, **bound.kwargs)
                return
            bound.arguments["use_all2all"] = False
            original_init(*bound.args, **bound.kwargs)
            self.use_all2all = bool(self.is_ep_communicator)
            if self.use_all2all:
                self.all2all_manager = _make_manager(self.cpu_group, bound.arguments.get("tcp_store_group"))

        cls.__init__ = _mark(__init__)

    if not _is_hooked(cls.destroy):
        original_destroy = cls.destroy

        @functools.wraps(original_destroy)
        def destroy(self: Any) -> None:
            original_destroy(self)
            from mori_integrations.vllm.all2all import MoriEpAll2AllManager

            manager = getattr(self, "all2all_manager", None)
            if isinstance(manager, MoriEpAll2AllManager):  # CpuCommunicator.destroy does not
                manager.destroy()
                self.all2all_manager = None

        cls.destroy = _mark(destroy)


def _make_manager(cpu_group: Any, tcp_store_group: Any) -> Any:
    from vllm.config import get_current_vllm_config
    from vllm.logger import init_logger

    if not get_current_vllm_config().parallel_config.enable_expert_parallel:
        from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

        init_logger(__name__).warning(
            "all2all_backend='mori_ep' needs --enable-expert-parallel; without it vLLM uses "
            "all-gather/reduce-scatter data parallelism"
        )
        return AgRsAll2AllManager(cpu_group)
    from mori_integrations.vllm.all2all import MoriEpAll2AllManager

    return MoriEpAll2AllManager(cpu_group, tcp_store_group)


# ---------------------------------------------------------------------- 3. prepare/finalize
def install_prepare_finalize_hook(t: HookTargets) -> None:
    """Route ``maybe_make_prepare_finalize`` to our factory for mori_ep layers.

    The oracles bind the function by name at import, so every already-imported vLLM module
    holding the original is rebound too; modules imported later pick up the hooked one.
    """
    module = t.all2all_utils_module
    original = module.maybe_make_prepare_finalize
    if _is_hooked(original):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def maybe_make_prepare_finalize(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        parallel = a["moe"].moe_parallel_config
        if parallel.all2all_backend == BACKEND and parallel.use_all2all_kernels:
            from mori_integrations.vllm.factory import make_mori_prepare_finalize

            return make_mori_prepare_finalize(
                a["moe"],
                a["quant_config"],
                routing_tables=a["routing_tables"],
                use_monolithic=a["use_monolithic"],
                all2all_manager=a["all2all_manager"],
            )
        return original(*bound.args, **bound.kwargs)

    hooked = _mark(maybe_make_prepare_finalize)
    module.maybe_make_prepare_finalize = hooked
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(mod, "maybe_make_prepare_finalize", None) is original:
            mod.maybe_make_prepare_finalize = hooked


# ---------------------------------------------------------------------------- 4. CUDA graphs
def install_cudagraph_hook(t: HookTargets) -> None:
    """Run mori_ep with data parallelism without CUDA graphs (as vLLM does for DeepEP HT).

    vLLM's standard experts take exactly the received rows, so prepare reads the received
    token count on the host, which a captured graph cannot do.
    """
    cls = t.compilation_config_cls
    original = cls.set_splitting_ops_for_v1
    if _is_hooked(original):
        return

    @functools.wraps(original)
    def set_splitting_ops_for_v1(self: Any, all2all_backend: str, data_parallel_size: int = 1) -> None:
        original(self, all2all_backend, data_parallel_size)
        from vllm.config.compilation import CUDAGraphMode

        if all2all_backend == BACKEND and data_parallel_size > 1 and self.cudagraph_mode != CUDAGraphMode.NONE:
            from vllm.logger import init_logger

            init_logger(__name__).info(
                "mori_ep: disabling CUDA graphs (the MoE layers read the received token count on the host)"
            )
            self.cudagraph_mode = CUDAGraphMode.NONE

    cls.set_splitting_ops_for_v1 = _mark(set_splitting_ops_for_v1)


# ------------------------------------------------------------------------ 5. batched experts
def install_batched_format_hook(t: HookTargets) -> None:
    """With ``VLLM_MORI_EP_BATCHED_EXPERTS=1``, mori_ep layers ask vLLM's oracles for batched
    experts (``use_batched_activation_format``, as DeepEP low-latency does); the prepare/finalize
    then uses MORI's standard-MoE layout. Other backends are unaffected; read at each call."""
    cls = t.moe_parallel_config_cls
    original = cls.__dict__["use_batched_activation_format"]
    if _is_hooked(original.fget):
        return

    @functools.wraps(original.fget)
    def use_batched_activation_format(self: Any) -> bool:
        if original.fget(self):
            return True
        if getattr(self, "all2all_backend", None) != BACKEND or not getattr(self, "use_all2all_kernels", False):
            return False
        from mori_integrations.vllm.mori_utils import use_batched_experts_from_env

        return use_batched_experts_from_env()

    cls.use_batched_activation_format = property(_mark(use_batched_activation_format))


def install_all(t: HookTargets) -> None:
    """Install every hook (each is idempotent)."""
    install_backend_name(t)
    install_communicator_hook(t)
    install_prepare_finalize_hook(t)
    install_cudagraph_hook(t)
    install_batched_format_hook(t)
