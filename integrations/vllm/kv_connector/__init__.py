"""``MoriSuiteConnector``: vLLM prefill/decode disaggregation on mori-suite's IO engine.

vLLM-facing (import vLLM):

* :mod:`.register`  -- ``vllm.general_plugins`` entry point ``mori_suite_kv``
* :mod:`.connector` -- ``MoriSuiteConnector`` (``KVConnectorBase_V1`` + ``SupportsHMA``)
* :mod:`.scheduler` -- scheduler side: which requests load / hand over KV, block lists
* :mod:`.worker`    -- worker side: vLLM hooks -> the transfer agent
* :mod:`.prom`      -- transfer counters on ``/metrics``

Below vLLM's interfaces (no vLLM import; the GPU test drives these directly):

* :mod:`.agent`     -- IO engine, registered KV, peers, planning (one per worker)
* :mod:`.producer`  -- prefill side: layer-pipelined writes, holding blocks until decodes are done
* :mod:`.consumer`  -- decode side: READ / WRITE receive, bounded waits, aborts
* :mod:`.control`, :mod:`.messages` -- the control plane (ZMQ, bounded and optionally authenticated messages)
* :mod:`.layout`, :mod:`.planner`, :mod:`.tp_mapping` -- KV geometry, block -> byte segments, heads across TP
* :mod:`.config`, :mod:`.params`, :mod:`.metadata`, :mod:`.stats` -- settings, request params, step plans, counters

docs/vllm_pd.md describes usage.
"""
