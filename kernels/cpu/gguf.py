"""GGUF block formats on the CPU kernels (csrc/gguf_linear.cpp): the formats, their plain-torch
de-quantization (the reference), the re-layout made once at load, and the product.

A GGUF tensor [N, K] of a block type is N rows of K / 32 blocks; a block holds 32 weights:
  Q4_0: fp16 d, 16 bytes of 4-bit q (weights 0-15 in the low nibbles, 16-31 in the high);
        w = d * (q - 8)
  Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit q as Q4_0;  w = d * q + m
  Q8_0: fp16 d, 32 int8 q;  w = d * q
  Q4_Z: no GGML type but the int4 checkpoints' (AWQ, GPTQ: worker/layers/quantization/int4.py):
        Q4_1's bytes with an integer zero point z (exact in fp16) where Q4_1 has m;
        w = d * (q - z)
`repack` turns those rows into the kernel's groups of 16 columns (csrc/gguf_linear.cpp says
the layout); the bytes per weight stay the file's (0.56, 0.63, 1.06).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML's type ids (gguf.GGMLQuantizationType)
Q4_Z = 1000  # tokenmill's own id, beyond GGML's
BLOCK = 32  # weights per block
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_Z: 20}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_Z: "Q4_Z"}
GROUP = 16  # output columns per group of the kernel's layout
# Columns the kernel's many-row path de-quantizes at a time: N must be a multiple.
COLUMN_BLOCK = 64


def supported(qtype: int, shape: tuple[int, int]) -> bool:
    """Whether the kernels take a weight of this type and logical shape [N, K]."""
    n, k = shape
    return qtype in BLOCK_BYTES and n % COLUMN_BLOCK == 0 and k % BLOCK == 0


def _blocks(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % BLOCK_BYTES[qtype]:
        raise ValueError(
            f"a {NAMES[qtype]} tensor must be uint8 [N, K / 32 * {BLOCK_BYTES[qtype]}], got "
            f"{raw.dtype} {tuple(raw.shape)}"
        )
    return raw.contiguous().view(raw.shape[0], -1, BLOCK_BYTES[qtype])


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block: [N, K / 32]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1)


def _fields(raw: torch.Tensor, qtype: int):
    """(d, m or None, q [N, K] as integers) of a GGUF tensor's rows."""
    blocks = _blocks(raw, qtype)
    n = blocks.shape[0]
    d = _half(blocks, 0)
    if qtype == Q8_0:
        return d, None, blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    m = _half(blocks, 2) if qtype in (Q4_1, Q4_Z) else None
    nibbles = blocks[..., 4:] if m is not None else blocks[..., 2:]
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)  # weights 0-15, then 16-31
    return d, m, q.reshape(n, -1)


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The fp32 weights [N, K] of a GGUF tensor's rows, in GGUF's own arithmetic (the fp16
    fields widened, one fp32 product and, for Q4_1, one sum per weight)."""
    d, m, q = _fields(raw, qtype)
    n, k = q.shape
    scale = d.float().repeat_interleave(BLOCK, dim=1)
    if qtype == Q4_0:
        return scale * (q.float() - 8)
    if qtype == Q4_Z:
        return scale * (q.float() - m.float().repeat_interleave(BLOCK, dim=1))
    w = scale * q.float()
    if qtype == Q4_1:
        w = w + m.float().repeat_interleave(BLOCK, dim=1)
    return w


@dataclass
class PackedGGUF:
    """A GGUF weight in the kernel's layout (csrc/gguf_linear.cpp)."""

    qtype: int
    shape: tuple[int, int]  # the logical [N, K]
    qs: torch.Tensor  # uint8 [N / 16, K / 32, pairs, 32]
    d: torch.Tensor  # fp16 [N / 16, K / 32, 16]
    m: torch.Tensor | None  # fp16, as d (Q4_1's m, Q4_Z's z)
    # The input features in the weight's column order (GPTQ's act-order: the checkpoint's
    # columns sorted by group), taken from x before the product; None: x's own order.
    perm: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_linear(x, self, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows `ids` [T] of the weight, [T, K], as `dequantize` gives them (a tied
        embedding's lookup in its LM head's blocks)."""
        n, k = self.shape
        blocks, t = k // BLOCK, ids.numel()
        group, column = ids // GROUP, ids % GROUP
        qs = self.qs[group]  # [T, blocks, pairs, 32]: word j is column j // 2 at k parity j % 2
        words = torch.stack((2 * column, 2 * column + 1), dim=-1).view(t, 1, 1, 2)
        picked = qs.gather(3, words.expand(t, blocks, qs.shape[2], 2))  # [T, blocks, pairs, 2]
        if self.qtype == Q8_0:
            q = picked.view(torch.int8).reshape(t, k).float()
        else:  # byte row pp holds pair 2pp in its low nibbles, 2pp + 1 in its high ones
            q = torch.stack((picked & 0xF, picked >> 4), dim=3).reshape(t, k).float()

        def per_block(s: torch.Tensor) -> torch.Tensor:
            at = column.view(t, 1, 1).expand(t, blocks, 1)
            return s[group].gather(2, at).view(t, blocks).float().repeat_interleave(BLOCK, dim=1)

        scale = per_block(self.d)
        if self.qtype == Q4_0:
            return scale * (q - 8)
        if self.qtype == Q4_Z:
            return scale * (q - per_block(self.m))
        w = scale * q
        return w + per_block(self.m) if self.qtype == Q4_1 else w


def repack(raw: torch.Tensor, qtype: int, perm: torch.Tensor | None = None) -> PackedGGUF:
    """A GGUF tensor's rows [N, K / 32 * block bytes] in the kernel's layout."""
    d, m, q = _fields(raw, qtype)
    n, k = q.shape
    if not supported(qtype, (n, k)):
        raise ValueError(f"a {NAMES[qtype]} weight [{n}, {k}] does not fit the kernels' layout")
    groups, blocks = n // GROUP, k // BLOCK
    # [group, column, block, pair, parity] -> [group, block, pair, column * 2 + parity]
    words = q.view(groups, GROUP, blocks, 16, 2).permute(0, 2, 3, 1, 4).reshape(
        groups, blocks, 16, 2 * GROUP
    )
    if qtype == Q8_0:
        qs = words.contiguous().view(torch.uint8)
    else:  # pairs 2p and 2p + 1 share a row of bytes: low and high nibbles
        pairs = words.view(groups, blocks, 8, 2, 2 * GROUP).to(torch.uint8)
        qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).contiguous()

    def per_group(s: torch.Tensor) -> torch.Tensor:
        return s.view(groups, GROUP, blocks).transpose(1, 2).contiguous()

    return PackedGGUF(qtype, (n, k), qs, per_group(d), None if m is None else per_group(m), perm)


def gguf_linear(
    x: torch.Tensor, weight: PackedGGUF, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype (bf16 or fp32)."""
    shape = x.shape
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    y = torch.ops.tokenmill.gguf_linear(
        x.reshape(-1, shape[-1]), weight.qs, weight.d, weight.m, weight.qtype, bias
    )
    return y.view(*shape[:-1], y.shape[-1])
