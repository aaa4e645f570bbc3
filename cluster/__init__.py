"""Cluster layer of kvfabric: Ray actors, router, client API and the `kvfabric` CLI."""
