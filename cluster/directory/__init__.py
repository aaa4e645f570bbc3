"""The cluster directory: the pure shard, its Ray actor, the node-side client, report authentication and upkeep."""
