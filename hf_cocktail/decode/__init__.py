"""Decode attention over a store: the plain-PyTorch reference (split precision) and the dispatch to the fused CPU and
Triton kernels."""
