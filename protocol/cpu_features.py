"""What the host CPU computes natively, read without importing torch (the frontend resolves
the engine config before the core process starts, and importing torch costs it 1-2 s).

`native_bf16()` decides the CPU's default dtype, as vLLM's CPU backend does: bf16 where the
CPU has bf16 dot-product instructions (AVX512_BF16, or AMX tiles) and neither torch
(`ATEN_CPU_CAPABILITY`) nor oneDNN (`ONEDNN_MAX_CPU_ISA`) has been told to stay below them;
fp32 elsewhere, where bf16 matmuls are emulated (converted to fp32 and back: slower than
fp32 itself).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# ATEN_CPU_CAPABILITY values that keep torch's kernels off AVX-512 (and its bf16 paths).
_ATEN_BELOW_AVX512 = frozenset({"default", "avx", "avx2", "zvector", "vsx"})
# ONEDNN_MAX_CPU_ISA values under which oneDNN has no bf16 dot products (its ISA names).
_ONEDNN_WITHOUT_BF16 = frozenset(
    {"sse41", "avx", "avx2", "avx2_vnni", "avx512_core", "avx512_core_vnni"}
)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where unreadable)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(
    flags: frozenset[str] | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether bf16 matmuls run on bf16 hardware here (x86: AVX512_BF16 or AMX-BF16)."""
    if platform.machine().lower() not in ("x86_64", "amd64") and flags is None:
        return False  # aarch64's bf16 (BF16/SVE) goes through other paths; fp32 there
    flags = cpu_flags() if flags is None else flags
    env = os.environ if environ is None else environ
    if not _BF16_FLAGS & flags:
        return False
    if env.get("ATEN_CPU_CAPABILITY", "").strip().lower() in _ATEN_BELOW_AVX512:
        return False
    return env.get("ONEDNN_MAX_CPU_ISA", "").strip().lower() not in _ONEDNN_WITHOUT_BF16
