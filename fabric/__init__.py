"""Node-local core of kvfabric: keys, layouts, tiers, the RocksDB index, the store and its metrics."""
