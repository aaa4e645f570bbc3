"""Engine adapters: how an inference engine's KV reaches the fabric, and the engine-side allocators
(block manager, block pool, free queue, KV pools) that the paged engine uses."""
