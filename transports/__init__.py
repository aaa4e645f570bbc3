"""Transports of kvfabric: the shared frame codec and the QUIC, TLS-TCP and RDMA adapters."""
