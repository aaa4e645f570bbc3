"""The network test bed: hosts in network namespaces on a private bridge, with Ray and the fabric on them."""
