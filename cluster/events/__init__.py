"""KV events in vLLM's wire format: the pure event log, its ZMQ publisher and the replay service."""
