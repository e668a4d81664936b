"""Builds tokenmill's CPU kernels (kernels/cpu/) for this machine into $TOKENMILL_CACHE, once
per version of their sources, and says whether they are in use. `make setup` runs this; a
machine without a C++ compiler goes on without them (the torch path runs)."""

from __future__ import annotations

import logging

from tokenmill.kernels import cpu
from tokenmill.protocol import envs

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not envs.TOKENMILL_CPU_KERNELS:
        print("TOKENMILL_CPU_KERNELS=0: the CPU kernels are not built")
    elif cpu.load(envs.TOKENMILL_CACHE):
        isa = {3: "AMX", 2: "AVX-512 with bf16", 1: "AVX-512", 0: "AVX2"}.get(cpu.cpu_isa(), "?")
        print(f"CPU kernels ready in {cpu.build_dir(envs.TOKENMILL_CACHE)} (this CPU: {isa})")
    else:
        print("CPU kernels not built: the torch path runs")
