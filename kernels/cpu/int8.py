"""int8 W8A8 on the CPU kernels (csrc/int8_linear.cpp): weights quantized per output column
once at load, activations per row (token) in each call, int8 products with int32 sums (AMX
int8 tiles or AVX512-VNNI through oneDNN's microkernel).

The arithmetic, which `reference_linear` spells out in torch (the kernel's reference):
  weights, symmetric per output column:
    s_w[n] = max |w[n, :]| / 127, q[n, k] = round(w[n, k] * 127 / max |w[n, :]|)
  activations, asymmetric per row (lo = min(x[m, :], 0), hi = max(x[m, :], 0)):
    s_x[m] = (hi - lo) / 255, zp[m] = round(-lo * 255 / (hi - lo)),
    xu[m, k] = clamp(round(x[m, k] * 255 / (hi - lo)) + zp[m], 0, 255)
  y[m, n] = s_x[m] * s_w[n] * sum_k (xu[m, k] - zp[m]) q[n, k]  (+ bias[n])
(round: to nearest, ties to even; a row of zeros has scale 0). Asymmetric activations use all
256 levels on one-sided rows (after SiLU): SmolLM2's log-probabilities moved a third less on
average, half as much at the worst tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_N = 64  # output columns per block of the kernel's layout
QTYPE = 2000  # an int8 projection's entry in decode_layers' qtypes (GGUF's are GGML type ids)


def supported(shape: tuple[int, int]) -> bool:
    """Whether the kernel takes a weight of logical shape [N, K]."""
    n, k = shape
    return n % BLOCK_N == 0 and k % 4 == 0


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uint8 per row of x [R, C]: (xu as int32 [R, C], zero point int32 [R], scale
    fp32 [R]), in the kernel's fp32 arithmetic."""
    x = x.float()
    lo = x.amin(dim=-1).clamp(max=0)
    hi = x.amax(dim=-1).clamp(min=0)
    span = hi - lo
    # (a true division: `255.0 / span` would multiply by span's rounded reciprocal)
    inv = torch.where(span > 0, torch.full_like(span, 255.0).div(span), torch.zeros_like(span))
    zero = torch.round(-lo * inv).to(torch.int32)
    xu = (torch.round(x * inv.unsqueeze(-1)).to(torch.int32) + zero.unsqueeze(-1)).clamp(0, 255)
    return xu, zero, span / 255.0


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of t [R, C]: (q int8 [R, C], scale fp32 [R])."""
    t = t.float()
    amax = t.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(t * inv.unsqueeze(-1)).to(torch.int8)
    return q, amax / 127.0


@dataclass
class PackedInt8:
    """A weight quantized per output column, in the kernel's layout."""

    shape: tuple[int, int]  # the logical [N, K]
    qweight: torch.Tensor  # int8 [N / 64, K / 4, 64, 4]
    scales: torch.Tensor  # fp32 [N]
    colsum: torch.Tensor  # int32 [N]: each column's sum of q

    # Whether the CPU kernel runs the product; otherwise Triton's (kernels/quantized.py, on
    # CUDA) or `reference_linear` (in fp32) does.
    kernel: bool = True
    triton: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.colsum))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel:
            return int8_linear(x, self, bias)
        if self.triton:
            from tokenmill.kernels.quantized import int8_matmul

            return int8_matmul(x, self, bias)
        return reference_linear(x, self, bias, exact=False)

    def values(self) -> torch.Tensor:
        """The int8 weight [N, K], out of the kernel's layout."""
        n, k = self.shape
        return self.qweight.permute(0, 2, 1, 3).reshape(n, k)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] the int8 values stand for."""
        return self.values().float() * self.scales.unsqueeze(-1)

    def decode_operands(self) -> tuple[int, list[torch.Tensor | None]] | None:
        """(QTYPE, its three tensors) for the one-call decode step (csrc/decode_layers.cpp),
        whose gate/up product is fused with SiLU-and-mul; None off the CPU kernel."""
        if not self.kernel:
            return None
        return QTYPE, [self.qweight, self.scales, self.colsum]


def pack(weight: torch.Tensor, kernel: bool = True, triton: bool = False) -> PackedInt8:
    """weight [N, K] (any float dtype) quantized and laid out for `int8_linear`."""
    n, k = weight.shape
    if not supported((n, k)):
        raise ValueError(f"an int8 weight [{n}, {k}] does not fit the kernel's layout")
    q, scales = quantize_rows(weight)
    # [block, column, k / 4, 4] -> [block, k / 4, column, 4]
    packed = q.view(n // BLOCK_N, BLOCK_N, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return PackedInt8((n, k), packed, scales, q.sum(dim=-1, dtype=torch.int32), kernel, triton)


def int8_linear(
    x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype (bf16 or fp32)."""
    shape = x.shape
    y = torch.ops.tokenmill.int8_linear(
        x.reshape(-1, shape[-1]), weight.qweight, weight.scales, weight.colsum, bias
    )
    return y.view(*shape[:-1], y.shape[-1])


def fuses_silu_mul(weight: PackedInt8) -> bool:
    """Whether `int8_linear_silu_mul` takes this gate/up weight: on the kernel, its halves
    whole blocks of columns."""
    return weight.kernel and weight.shape[0] % (2 * BLOCK_N) == 0


def int8_linear_silu_mul(
    x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of a gated MLP's [gate; up] weight, [..., K] -> [..., N / 2]: the same
    values as silu_and_mul(int8_linear(x, weight, bias)), without the [..., N] product."""
    shape = x.shape
    y = torch.ops.tokenmill.int8_linear_silu_mul(
        x.reshape(-1, shape[-1]), weight.qweight, weight.scales, weight.colsum, bias
    )
    return y.view(*shape[:-1], y.shape[-1])


def reference_linear(
    x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None = None, exact: bool = True
) -> torch.Tensor:
    """The same product in torch: x quantized per row, integer sums (exact in fp64; in fp32,
    rounded past 2^24, where there is no kernel), scaled."""
    shape = x.shape
    xu, zero, sx = quantize_activations(x.reshape(-1, shape[-1]))
    n = weight.shape[0]
    q = weight.values()
    wide = torch.float64 if exact else torch.float32
    acc = (xu.to(wide) @ q.to(wide).T - (zero.unsqueeze(-1) * weight.colsum).to(wide)).float()
    y = acc * (sx.unsqueeze(-1) * weight.scales)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], n)
