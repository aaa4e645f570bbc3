"""Engine adapters: how an inference engine's KV reaches the fabric."""
