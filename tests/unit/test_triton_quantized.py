"""The Triton quantized matmuls against de-quantize-then-matmul in torch: GGUF's block types
(and the int4 checkpoints' Q4_Z) on blocks with the formats' extremes, and W8A8 against the
CPU kernels' torch reference. On CUDA when there is a GPU, else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from helpers import require_triton
from test_gguf import KERNEL_TYPES, random_blocks

from tokenmill.kernels.cpu import gguf as G
from tokenmill.kernels.cpu import int8 as I

require_triton()
from tokenmill.kernels import quantized  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter computes 16-bit types wrongly; there the kernels run in fp32.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: G.NAMES[t])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_matmul_equals_dequantize_then_matmul(qtype: int, dtype) -> None:
    n, k = 80, 96  # N not a multiple of the tile: the edge columns are masked
    raw = random_blocks(qtype, n, k, seed=qtype)
    raw.view(n, k // 32, -1)[:, :, 0:2] = (torch.rand(n, k // 32, 1) * 0.05).half().view(
        torch.uint8
    )  # moderate scales (fp16's extremes are checked by the CPU kernels' tests)
    weight = G.dequantize(raw, qtype)
    bias = torch.randn(n)
    for m in (1, 3, 16, 40):
        x = torch.randn(m, k).to(dtype)
        got = quantized.gguf_matmul(x.to(DEVICE), raw.to(DEVICE), qtype, bias.to(DEVICE, dtype))
        want = x.float() @ weight.to(dtype).float().T + bias.to(dtype).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        atol = tol * float(want.abs().max())
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=atol)


def test_gguf_matmul_takes_the_input_in_the_weights_column_order() -> None:
    n, k = 64, 64
    raw = random_blocks(G.Q4_Z, n, k, seed=3)
    perm = torch.randperm(k)
    x = torch.randn(5, k)
    got = quantized.gguf_matmul(x.to(DEVICE), raw.to(DEVICE), G.Q4_Z, perm=perm.to(DEVICE))
    want = x[:, perm] @ G.dequantize(raw, G.Q4_Z).T
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_matmul_equals_the_w8a8_reference(dtype) -> None:
    n, k = 192, 160
    packed = I.pack(torch.randn(n, k), kernel=False)
    bias = torch.randn(n)
    for m in (1, 3, 16, 40):
        x = torch.randn(m, k).to(dtype)
        x[0, :8] = torch.tensor([0.0, 1e3, -1e3, 1e-6, 0.5, -0.5, 3.0, 0.0])
        device_packed = I.PackedInt8(
            packed.shape, *(t.to(DEVICE) for t in (packed.qweight, packed.scales, packed.colsum)),
            False,
        )  # fmt: skip
        got = quantized.int8_matmul(x.to(DEVICE), device_packed, bias.to(DEVICE, dtype)).cpu()
        want = I.reference_linear(x, packed, bias.to(dtype))
        if dtype == torch.float32:  # the same integers and the same fp32 scaling
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
