"""Fixtures of the unit tests of tokenmill's CPU kernels: the kernels built (else the test
skips), and a test run once per instruction set level this CPU has (test_cpu_kernels.py keeps
its own, autouse, variants)."""

from __future__ import annotations

import shutil

import pytest

from tokenmill.kernels import cpu
from tokenmill.protocol import envs


@pytest.fixture(scope="module")
def kernels() -> None:
    if shutil.which("c++") is None and not cpu.build_dir(envs.TOKENMILL_CACHE).exists():
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    assert cpu.load(envs.TOKENMILL_CACHE), "the CPU kernels failed to build (see the log)"


@pytest.fixture(params=[3, 2, 1, 0, -1], ids=lambda level: f"isa{level}")
def isa(request, kernels) -> int:
    """The kernels capped at each instruction set level this CPU runs."""
    full = cpu.limit_isa(3)
    if request.param > full:
        pytest.skip(f"this CPU runs up to level {full}")
    cpu.limit_isa(request.param)
    yield request.param
    cpu.limit_isa(full)
