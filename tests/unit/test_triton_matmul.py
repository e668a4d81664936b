"""The batch-invariant Triton matmul (kernels/matmul.py) against its torch reference, and bit
for bit against itself: a row computed alone has the bits it has inside batches of 2 to 100
rows. On CUDA when there is a GPU, else in Triton's interpreter (TRITON_INTERPRET=1, set in
conftest). Then its place in the layers: linear.py's `matmul` runs it in the mode on the
Triton path only, and the CPU platform leaves that path's weights plain.

The interpreter's 16-bit loads and widening are exact and its dots are numpy's fp32 matmuls on
fixed tile shapes, so bf16 and fp16 are as deterministic there as fp32; its fp32 -> bf16
conversion truncates (torch rounds to nearest), so a bf16 result is within one bf16 step of
the reference, not at its nearest value."""

from __future__ import annotations

import pytest
import torch
from helpers import require_triton
from torch import nn

from tokenmill.kernels.batch_invariant import batch_invariant, set_batch_invariant
from tokenmill.worker.layers import linear
from tokenmill.worker.layers.custom_op import layer_kernels
from tokenmill.worker.layers.embedding import ParallelLMHead
from tokenmill.worker.layers.layernorm import RMSNorm
from tokenmill.worker.platform import platform_of

require_triton()
from tokenmill.kernels.launches import LAUNCHES  # noqa: E402
from tokenmill.kernels.matmul import matmul, matmul_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# (N, K): about one tile; then several N tiles and K steps, with ragged ends.
SHAPES = [(128, 64), (300, 200)]


def operands(n: int, k: int, dtype: torch.dtype, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    return x, weight, bias


@pytest.fixture
def invariant_mode():
    previous = batch_invariant()
    set_batch_invariant(True)
    yield
    set_batch_invariant(previous)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_matmul_matches_reference(n: int, k: int, dtype: torch.dtype, with_bias: bool) -> None:
    for rows in (1, 7, 100):
        x, weight, bias = operands(n, k, dtype, rows)
        bias = bias if with_bias else None
        out = matmul(x, weight, bias)
        ref = matmul_reference(x, weight, bias)
        assert out.shape == (rows, n) and out.dtype == dtype
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < TOLERANCE[dtype], (rows, err)


def test_matmul_keeps_leading_dims_and_takes_strided_rows() -> None:
    x, weight, bias = operands(128, 64, torch.float32, 12)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 elements apart
    out = matmul(wide.view(3, 4, 64), weight, bias)
    assert out.shape == (3, 4, 128)
    torch.testing.assert_close(out.view(12, 128), matmul_reference(x, weight, bias))
    assert matmul(x[:0], weight, bias).shape == (0, 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_row_bits_do_not_depend_on_the_batch(n: int, k: int, dtype: torch.dtype) -> None:
    """The target row alone, then among 1, 6, 32 and 99 random rows at several places (the
    second row tile of 100 rows too): the same bits each time."""
    target, weight, bias = operands(n, k, dtype, 1)
    alone = matmul(target, weight, bias).view(BITS[dtype])
    for rows in (2, 7, 33, 100):
        others, _, _ = operands(n, k, dtype, rows, seed=rows)
        for at in {0, rows // 2, rows - 1}:
            batch = others.clone()
            batch[at] = target[0]
            out = matmul(batch, weight, bias).view(BITS[dtype])
            assert torch.equal(out[at : at + 1], alone), (rows, at)


def test_linear_matmul_runs_the_kernel_in_the_mode_on_the_triton_path(invariant_mode) -> None:
    """linear.py's `matmul`: a marked CPU weight (or any CUDA one) in the mode; a packed or
    unmarked CPU weight, or the mode off, never."""
    x, weight, bias = operands(128, 64, torch.float32, 5)
    marked = weight.clone()
    marked.triton_matmul = True
    want = matmul(x, weight, bias)
    before = LAUNCHES["matmul"]
    assert torch.equal(linear.matmul(x, marked, bias), want)
    assert LAUNCHES["matmul"] == before + 1
    linear.matmul(x, weight, bias)
    after = before + 1 + (DEVICE.type == "cuda")
    assert LAUNCHES["matmul"] == after
    set_batch_invariant(False)
    linear.matmul(x, marked, bias)
    assert LAUNCHES["matmul"] == after


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(64, eps=1e-6)
        self.proj = linear.ColumnParallelLinear(64, 128, bias=True)
        self.head = ParallelLMHead(256, 64)


@pytest.mark.parametrize("kind", ["triton", "native"])
def test_cpu_platform_leaves_triton_weights_plain_in_the_mode(invariant_mode, kind: str) -> None:
    """The CPU platform packs nothing for a model of Triton's layers in the mode (the kernel
    reads [N, K]); a model of other layers is packed as ever."""
    with layer_kernels(kind), torch.device("cpu"):
        block = _Block()
    for param in (block.proj.weight, block.proj.bias, block.head.weight):
        param.data.normal_()
    platform_of("cpu").prepare_model(block)
    for layer in (block.proj, block.head):
        if kind == "triton":
            assert layer.weight.dim() == 2 and not layer.weight.is_mkldnn
            assert layer.weight.shape == (layer.weight.shape[0], 64)
            assert getattr(layer.weight, "triton_matmul", False)
        else:
            assert not getattr(layer.weight, "triton_matmul", False)
    if kind == "triton" and DEVICE.type == "cpu":  # (CPU tensors run in the interpreter)
        before = LAUNCHES["matmul"]
        x = torch.randn(3, 64)
        torch.testing.assert_close(
            block.proj(x), matmul_reference(x, block.proj.weight, block.proj.bias)
        )
        block.head(x)
        assert LAUNCHES["matmul"] == before + 2
