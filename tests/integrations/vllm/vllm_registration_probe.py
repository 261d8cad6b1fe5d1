"""Fresh-interpreter probe of the mori_ep registration; prints one JSON object.

``python vllm_registration_probe.py MODE MODEL_DIR`` with MODE:

* ``plugins``  -- load plugins the way vLLM does, then report what vLLM accepts and builds;
* ``no_plugin`` -- same without loading plugins (VLLM_PLUGINS="" is set by the caller);
* ``broken``   -- remove one hook point from vLLM first, then call ``register()``.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any


def _accepts_mori_ep() -> Any:
    from vllm.config import ParallelConfig

    try:
        return ParallelConfig(all2all_backend="mori_ep").all2all_backend == "mori_ep"
    except Exception as e:  # pydantic.ValidationError
        return f"rejected: {type(e).__name__}"


def probe_plugins(model_dir: str) -> dict:
    """Everything a user-facing vLLM entry point does with ``mori_ep`` after plugin loading."""
    from vllm.plugins import load_general_plugins, load_plugins_by_group

    out: dict[str, Any] = {"entry_points": sorted(load_plugins_by_group("vllm.general_plugins"))}
    load_general_plugins()
    out["parallel_config_accepts"] = _accepts_mori_ep()
    from vllm.config import ParallelConfig

    try:
        ParallelConfig(all2all_backend="not_a_backend")
        out["unknown_still_rejected"] = False
    except Exception:
        out["unknown_still_rejected"] = True

    # Configs embedding ParallelConfig validate nested dict input with the new name too.
    from vllm.config import VllmConfig

    out["nested_dict_accepts"] = VllmConfig(
        parallel_config={"all2all_backend": "mori_ep"}
    ).parallel_config.all2all_backend

    # The CLI parser of `vllm serve` (plugins load before it is built).
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", model_dir, "--all2all-backend", "mori_ep", "--enable-expert-parallel", "--data-parallel-size", "2"]
    )
    out["cli_value"] = args.all2all_backend

    # The full engine config of an offline LLM(...) / vllm serve with DP x EP.
    engine_args = EngineArgs(
        model=model_dir,
        skip_tokenizer_init=True,
        all2all_backend="mori_ep",
        enable_expert_parallel=True,
        data_parallel_size=2,
    )
    config = engine_args.create_engine_config()
    out["engine_config_backend"] = config.parallel_config.all2all_backend
    out["cudagraph_mode"] = str(config.compilation_config.cudagraph_mode)

    # Which classes vLLM's hook points now lead to.
    import vllm.model_executor.layers.fused_moe.all2all_utils as all2all_utils
    import vllm.model_executor.layers.fused_moe.oracle.fp8 as fp8_oracle
    import vllm.model_executor.layers.fused_moe.oracle.unquantized as unquantized_oracle
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    hooked = all2all_utils.maybe_make_prepare_finalize
    out["prepare_finalize_hooked"] = bool(getattr(hooked, "__mori_ep_hook__", False))
    out["oracles_rebound"] = unquantized_oracle.maybe_make_prepare_finalize is hooked and (
        fp8_oracle.maybe_make_prepare_finalize is hooked
    )
    comm = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
    out["communicator_hooked"] = bool(getattr(comm.__init__, "__mori_ep_hook__", False))

    # Idempotency: a second register() wraps nothing twice.
    from mori_integrations.vllm.plugin import register

    register()
    register()
    out["single_wrap"] = not getattr(hooked.__wrapped__, "__mori_ep_hook__", False) and (
        all2all_utils.maybe_make_prepare_finalize is hooked
    )
    return out


def probe_no_plugin() -> dict:
    """Stock vLLM (plugins disabled) must refuse the name: the plugin is what adds it."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return {"parallel_config_accepts": _accepts_mori_ep()}


def probe_broken() -> dict:
    """A vLLM without one hook point: register() raises and installs nothing."""
    import vllm.model_executor.layers.fused_moe.all2all_utils as all2all_utils

    del all2all_utils.maybe_make_prepare_finalize
    from mori_integrations.vllm.plugin import register

    out: dict[str, Any] = {}
    try:
        register()
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    out["parallel_config_accepts"] = _accepts_mori_ep()
    return out


def main() -> int:
    """Run the probe named on the command line and print its JSON result."""
    mode, model_dir = sys.argv[1], sys.argv[2]
    try:
        if mode == "plugins":
            result = probe_plugins(model_dir)
        elif mode == "no_plugin":
            result = probe_no_plugin()
        else:
            result = probe_broken()
    except Exception:
        result = {"exception": traceback.format_exc()}
    print("PROBE_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
