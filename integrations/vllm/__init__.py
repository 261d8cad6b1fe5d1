"""vLLM adapter of mori-suite: MORI-EP as vLLM's ``all2all_backend="mori_ep"``, and the PD KV
connector ``MoriSuiteConnector`` (:mod:`.kv_connector`, proxy :mod:`.pd_proxy`; docs/vllm_pd.md).

* :mod:`.plugin`            -- ``vllm.general_plugins`` entry point (``register()``)
* :mod:`.hooks`             -- where stock vLLM is extended for ``mori_ep``
* :mod:`.factory`           -- builds a layer's prepare/finalize from its MoE config
* :mod:`.prepare_finalize`  -- ``MoriPrepareAndFinalize`` (vLLM's modular-kernel contract)
* :mod:`.all2all`           -- ``MoriEpAll2AllManager`` (shmem + operator cache per EP group)
* :mod:`.mori_utils`        -- ``MoriEpConfig``, ``create_mori_ep_op()``, launch settings
* :mod:`.token_exchange`    -- dispatch/combine round trip (no vLLM import; GPU check, bench)
* :mod:`.dispatch_quant`, :mod:`.quant` -- activation quantisation around dispatch

Importing this package imports nothing from vLLM; docs/vllm.md describes usage.
"""
