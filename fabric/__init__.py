"""Node-local core of kvfabric: keys, layouts, block manager, radix tree, KV pools, tiers, store."""
