"""Attention backends behind one interface (torch on the CPU; Triton on CUDA later)."""
