"""int8 W8A8: the CPU kernel `int8_linear` against de-quantize-then-matmul (the activations'
and weights' int8 values times their scales, multiplied in fp32) at 1 to 512 rows on every
instruction set level this CPU runs, and against its torch reference bit for bit in fp32; the
quantization itself checked by hand."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu import int8 as I


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Random rows with the quantizer's extremes: a row of zeros, one-sided rows (as after
    SiLU or ReLU), a constant row, a row with one outlier, huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    special = [
        torch.zeros(k), torch.rand(k, generator=g), -torch.rand(k, generator=g),
        torch.full((k,), 3.0), torch.randn(k, generator=g) * 1e-3,
        torch.randn(k, generator=g) * 1e4,
    ]  # fmt: skip
    special[4][7] = 50.0  # one outlier
    for i, row in enumerate(special[:m]):
        x[i] = row
    return x


def test_quantization_by_hand() -> None:
    rows = torch.tensor([[-1.0, 0.0, 0.5, 1.0], [0.0, 2.0, 1.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    xu, zero, scale = I.quantize_activations(rows)
    # row 0: range [-1, 1], 255 / 2 per unit, zero point round(127.5) = 128 (ties to even)
    assert zero.tolist() == [128, 0, 0]
    assert xu[0].tolist() == [0, 128, 192, 255]  # round(-127.5) = -128, round(63.75) = 64
    assert xu[1].tolist() == [0, 128, 64, 255]  # round(127.5) = 128, round(63.75) = 64
    assert xu[2].tolist() == [0, 0, 0, 0] and scale[2] == 0
    assert torch.allclose(scale[:2], torch.tensor([2 / 255, 4 / 255]))
    q, s = I.quantize_rows(torch.tensor([[0.5, -1.0, 0.25, 0.0]]))
    assert q.tolist() == [[64, -127, 32, 0]] and torch.allclose(s, torch.tensor([1 / 127]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_equals_dequantize_then_matmul(isa, dtype) -> None:
    n, k = 192, 320
    weight = torch.randn(n, k)
    weight[3] = 0.0  # a column of zeros: scale 0
    weight[5, 9] = 40.0  # an outlier in a column
    packed = I.pack(weight)
    bias = torch.randn(n)
    wd = packed.dequantized()
    for m in (1, 3, 4, 16, 64, 300, 512):
        x = activations(m, k, seed=m).to(dtype)
        got = I.int8_linear(x, packed, bias.to(dtype))
        assert got.dtype == dtype and got.shape == (m, n)
        xu, zero, sx = I.quantize_activations(x.reshape(m, k))
        xd = (xu - zero.unsqueeze(-1)).float() * sx.unsqueeze(-1)
        want = xd @ wd.T + bias.to(dtype).float()
        magnitude = xd.abs() @ wd.abs().T + bias.abs()
        bound = (k + 2) * 2.0**-24 * magnitude
        if dtype == torch.bfloat16:
            bound = bound + 2.0**-8 * want.abs()  # the output rounded to bf16
        diff = (got.float() - want).abs()
        assert (diff <= bound).all(), (m, float((diff - bound).max()))
        if dtype == torch.float32:  # the torch reference's arithmetic, bit for bit
            assert torch.equal(got, I.reference_linear(x, packed, bias))


def test_pack_refuses_shapes_the_kernel_does_not_take() -> None:
    assert I.supported((64, 8)) and not I.supported((48, 8)) and not I.supported((64, 6))
    with pytest.raises(ValueError, match="does not fit"):
        I.pack(torch.randn(48, 64))


def test_without_the_kernel_the_reference_runs_in_fp32() -> None:
    packed = I.pack(torch.randn(64, 96), kernel=False)
    x = torch.randn(5, 96)
    got = packed.linear(x)
    torch.testing.assert_close(got, I.reference_linear(x, packed), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_silu_mul_is_silu_and_mul_of_int8_linear_bit_for_bit(isa, dtype) -> None:
    from tokenmill.kernels.cpu.layers import silu_and_mul

    inter, k = 128, 96
    packed = I.pack(torch.randn(2 * inter, k))
    assert I.fuses_silu_mul(packed) and not I.fuses_silu_mul(I.pack(torch.randn(192, k)))
    bias = torch.randn(2 * inter).to(dtype)
    for m in (1, 5, 64, 300):
        x = activations(m, k, seed=m).to(dtype)
        got = I.int8_linear_silu_mul(x, packed, bias)
        want = silu_and_mul(I.int8_linear(x, packed, bias))
        assert got.shape == (m, inter) and torch.equal(got, want), m
