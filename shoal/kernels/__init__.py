"""Compute kernels: Triton kernels for the GPU and their pure-torch references (the oracle)."""
