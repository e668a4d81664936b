"""Kernels: plain-torch reference implementations, and (on CUDA) Triton kernels checked
against them. Workers' attention backends call these; tests compare every fast path here
with its reference."""
