"""tokenmill's own CPU kernels: C++17 ops under `torch.ops.tokenmill`, built for this machine
by torch's C++ extension tooling, once, into the cache (a folder per version of the sources,
torch and Python); later processes load the built library in milliseconds.

`load(cache_dir)` builds the library where needed, loads it and returns True, or logs one line
and returns False (no compiler, a failed build): the caller then runs the torch path (the
layers' `forward_native`, the TORCH_SDPA backend, kernels/reference.py), which is also each
op's reference in the tests. The worker's platform calls it, unless TOKENMILL_CPU_KERNELS=0;
`make` builds it at set-up (scripts/build_cpu_kernels.py). Each C++ file in csrc/ holds one
op (registration.cpp declares them, batch_invariant.cpp its switch) and chooses its inner
loops by the CPU's instruction set at run time (csrc/isa.cpp, vec.h), so one build serves
AVX2, AVX-512 and AMX machines.
The Python modules beside this one (linear.py, layers.py, attention.py) are the ops' calls.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path

import torch

from tokenmill.kernels.batch_invariant import batch_invariant

logger = logging.getLogger(__name__)

NAME = "tokenmill_cpu"
_CSRC = Path(__file__).parent / "csrc"
# No fused multiply-adds the code does not ask for: where the torch path rounds a product
# before adding it, so must the kernels (their reference tests compare bits).
_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"]
_LOADED: bool | None = None  # None: not tried in this process


def build_dir(cache_dir: Path) -> Path:
    """Where this version of the sources, built by this torch for this Python, lives."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {_FLAGS}".encode())
    return Path(cache_dir) / "kernels" / digest.hexdigest()[:16]


def load(cache_dir: Path) -> bool:
    """Builds (where not built yet) and loads the library once per process; False, after one
    log line saying why, where it cannot be."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    folder = build_dir(cache_dir)
    library = folder / f"{NAME}.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(folder)
        # The runner may have set the batch-invariant mode before the library was in.
        torch.ops.tokenmill.set_batch_invariant(batch_invariant())
        _LOADED = True
    except Exception as e:  # no compiler, a failed build: the torch path runs instead
        logger.warning("tokenmill's CPU kernels are not in use (%s); the torch path runs", e)
        _LOADED = False
    return _LOADED


def loaded() -> bool:
    """Whether this process has loaded the library (load() succeeded)."""
    return bool(_LOADED)


def _build(folder: Path) -> None:
    from torch.utils.cpp_extension import load as load_extension

    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    logger.info("building tokenmill's CPU kernels into %s (once)", folder)
    load_extension(
        NAME,
        sorted(str(p) for p in _CSRC.glob("*.cpp")),
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    logger.info("built tokenmill's CPU kernels in %.0f s", time.monotonic() - started)


# The instruction sets the kernels tell apart, by the level cpu_isa() reports.
ISAS = {"amx": 3, "avx512_bf16": 2, "avx512": 1, "avx2": 0, "none": -1}


def cpu_isa() -> int:
    """3 AMX, 2 AVX-512 with bf16 dot products, 1 AVX-512, 0 AVX2 + FMA, -1 none of them
    (what the CPU has, or less where limit_isa capped it)."""
    return int(torch.ops.tokenmill.cpu_isa())


def limit_isa(level: int) -> int:
    """Caps the instruction set the kernels use (for this process), so that the builds for
    lesser CPUs run here; returns the level now in use."""
    return int(torch.ops.tokenmill.limit_cpu_isa(level))
