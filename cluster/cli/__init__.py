"""The `kvfabric` command line, one module per command group."""
