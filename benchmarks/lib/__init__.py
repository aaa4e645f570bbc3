"""The benchmarks' own parts: workloads, baselines, servers and attackers the entry scripts above use.

Nothing here is an entry point of its own except the processes a benchmark starts (soak_node,
hostile_attacks, network_serve, transfer_quic's server), which its entry script runs by path.
"""
