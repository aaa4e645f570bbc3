"""kvfabric as vLLM's KV connector (`KVConnectorBase_V1`, vLLM 0.32).

Enable it on every vLLM engine of a Ray cluster that runs kvfabric (docs/vllm.md):

    --kv-transfer-config '{"kv_connector": "KVFabricConnector",
                           "kv_connector_module_path": "cluster.engines.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"ray_address": "auto"}}'

Modules: `paged` (vLLM's paged KV cache <-> fabric payloads), `namespace` (whose KV a request's
blocks are), `metadata` (what the scheduler tells the workers each step), `scheduler` and `worker`
(the connector's two roles), `link` (how a vLLM process reaches its node's fabric), `connector`.
Only this package imports vllm; nothing else in kvfabric needs it installed.
"""
