"""tokenmill's own CPU kernels (kernels/cpu/) against their torch references, on every
instruction set this CPU runs. They must build wherever a C++ compiler exists (CI's machine
has one): a failed build there fails these tests instead of skipping them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu
from tokenmill.kernels.cpu import linear as cpu_linear
from tokenmill.protocol import envs


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and not cpu.build_dir(envs.TOKENMILL_CACHE).exists():
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    assert cpu.load(envs.TOKENMILL_CACHE), "the CPU kernels failed to build (see the log)"


def _assert_sums_close(
    got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, k: int
) -> None:
    """got equals the fp32 reference up to what the order of an fp32 sum of k terms may change
    (k * 2^-24 of the sum of their magnitudes), and, in bf16, one place of the rounding (a
    sum that lands near a tie rounds either way)."""
    bound = k * 2.0**-24 * magnitude
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-7 * torch.maximum(want.abs(), got.float().abs())
    diff = (got.float() - want).abs()
    assert (diff <= bound).all(), (diff - bound).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(960, 576), (48, 64), (4096, 1536), (96, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_the_reference(dtype, n, k, with_bias) -> None:
    torch.manual_seed(n + k)
    weight = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    packed = cpu_linear.pack_weight(weight)
    assert packed is not None and torch.equal(cpu_linear.unpack_weight(packed), weight)
    for m in (1, 3, 17, 256, 300):  # decode rows, odd counts, one and two row blocks
        x = torch.randn(m, k).to(dtype)
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        got = cpu_linear.linear(x, packed, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        magnitude = F.linear(x.float().abs(), weight.float().abs())
        _assert_sums_close(got, want, magnitude, k + 1)


def test_linear_keeps_leading_dimensions_and_handles_no_rows() -> None:
    weight = torch.randn(64, 32)
    packed = cpu_linear.pack_weight(weight)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(cpu_linear.linear(x, packed), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert cpu_linear.linear(torch.empty(0, 32), packed).shape == (0, 64)


def test_weights_the_layout_does_not_fit_are_left_alone() -> None:
    assert cpu_linear.pack_weight(torch.randn(64, 33).bfloat16()) is None  # odd K in bf16
    assert cpu_linear.pack_weight(torch.randn(40, 32)) is None  # N not a multiple of 16
    assert cpu_linear.pack_weight(torch.randn(64, 32).half()) is None
    assert cpu_linear.pack_weight(torch.randn(64, 33)) is not None  # fp32 takes any K


def test_bad_arguments_are_clear_errors() -> None:
    packed = cpu_linear.pack_weight(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="features"):
        cpu_linear.linear(torch.randn(3, 31), packed)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_linear.linear(torch.randn(3, 32).bfloat16(), packed)


def test_the_isa_is_one_this_cpu_has() -> None:
    flags = open("/proc/cpuinfo").read()
    isa = cpu.cpu_isa()
    assert isa >= -1
    if isa >= 2:
        assert "avx512_bf16" in flags
    if isa == 3:
        assert "amx_bf16" in flags
    if " avx512f" in flags and " avx512bw" in flags:
        assert isa >= 1


def test_without_a_compiler_the_torch_path_runs(tmp_path) -> None:
    """A machine without a C++ compiler (and nothing built yet): load() says no, with one log
    line, and nothing raises."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO)\n"
        "from tokenmill.kernels import cpu\n"
        f"print('loaded', cpu.load({str(tmp_path)!r}))\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "CXX": "", "CC": ""}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "loaded False" in done.stdout
    assert "CPU kernels are not in use" in done.stderr and "torch path runs" in done.stderr
