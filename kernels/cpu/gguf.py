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
  Q4_F: no GGML type either: fp32 d, fp32 m, 16 bytes of 4-bit q as Q4_0; w = d * q + m
        (GGUF's Q4_K, rewritten exactly: its per-32 scale and minimum, an fp16 times a 6-bit
        integer, need fp32)
  Q8_F: fp32 d, fp32 m, 32 int8 q; w = d * q + m (GGUF's Q5_K: Q4_K's scales with 5-bit q)
  Q8_S: fp32 d, fp32 e, 32 int8 q; w = d * q for weights 0-15, e * q for 16-31 (GGUF's Q6_K:
        6-bit q and an int8 scale per 16 weights of an fp16 d, d * scale exact in fp32)
Other GGUF types become one of these where they can exactly: Q5_0 as Q8_0, Q4_K as Q4_F,
Q5_K as Q8_F, Q6_K as Q8_S. `repack` turns those rows into the kernel's groups of 16 columns
(csrc/gguf_linear.cpp says the layout); the bytes per weight stay the file's (0.56, 0.63,
1.06) for the first three, 0.75 for Q4_F, 1.25 for Q8_F and Q8_S (Q5_K's 0.69 and Q6_K's
0.82 bytes widened to whole bytes: the kernels have no 5- or 6-bit path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import cpu

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML's type ids (gguf.GGMLQuantizationType)
Q4_Z, Q4_F, Q8_F, Q8_S = 1000, 1001, 1002, 1003  # tokenmill's own ids, beyond GGML's
BLOCK = 32  # weights per block
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_Z: 20, Q4_F: 24, Q8_F: 40, Q8_S: 40}
NAMES = {
    Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_Z: "Q4_Z", Q4_F: "Q4_F", Q8_F: "Q8_F",
    Q8_S: "Q8_S",
}  # fmt: skip
EIGHT_BIT = (Q8_0, Q8_F, Q8_S)  # a byte per weight; the others pack two in a byte
FP32_SCALES = (Q4_F, Q8_F, Q8_S)
ADDS_MINIMUM = (Q4_1, Q4_F, Q8_F)  # w = d * q + m
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
    if qtype in FP32_SCALES:
        d = blocks[..., 0:4].contiguous().view(torch.float32).squeeze(-1)
        m = blocks[..., 4:8].contiguous().view(torch.float32).squeeze(-1)
        if qtype != Q4_F:
            return d, m, blocks[..., 8:].contiguous().view(torch.int8).reshape(n, -1)
        nibbles = blocks[..., 8:]
        return d, m, torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(n, -1)
    d = _half(blocks, 0)
    if qtype == Q8_0:
        return d, None, blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    m = _half(blocks, 2) if qtype in (Q4_1, Q4_Z) else None
    nibbles = blocks[..., 4:] if m is not None else blocks[..., 2:]
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)  # weights 0-15, then 16-31
    return d, m, q.reshape(n, -1)


Q5_0 = 6  # GGML's id: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * (q - 16)
Q5_0_BYTES = 22


def q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 rows [N, K / 32 * 22] as Q8_0 rows [N, K / 32 * 34], the same weights exactly:
    Q5_0's q - 16 (in [-16, 15]) are Q8_0's integers, its d Q8_0's scale. (Q5_0 fills most of
    Gemma 3's Q4_K_M file; the kernels take Q8_0.)"""
    n = raw.shape[0]
    blocks = raw.contiguous().view(n, -1, Q5_0_BYTES)
    high = blocks[..., 2:6].contiguous().view(torch.int32).to(torch.int64)  # [N, B, 1]
    bit = (high >> torch.arange(32)) & 1  # weight j's fifth bit: bit j
    nibbles = blocks[..., 6:].to(torch.int64)
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1) | (bit << 4)  # weights 0-15, 16-31
    out = torch.empty(n, blocks.shape[1], BLOCK_BYTES[Q8_0], dtype=torch.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    out[..., 2:] = (q - 16).to(torch.int8).view(torch.uint8)
    return out.view(n, -1)


def _k_header(raw: torch.Tensor, block_bytes: int) -> tuple[torch.Tensor, ...]:
    """Q4_K's and Q5_K's super-blocks [N, S, block_bytes] and their shared head: d and dmin
    [N, S, 1] (fp16 widened) and the 8 sub-blocks' 6-bit scales and minimums [N, S, 8]
    (llama.cpp's get_scale_min_k4)."""
    blocks = raw.contiguous().view(raw.shape[0], -1, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    s = blocks[..., 4:16].to(torch.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = torch.cat((low_sc, high_sc), dim=-1).float()
    return blocks, d, dmin, sc, torch.cat((low_m, high_m), dim=-1).float()


Q4_K = 12  # GGML's id: 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
Q4_K_BYTES = 144  # minimums, 128 bytes of nibbles; w = d * sc * q - dmin * m per 32


def q4_k_as_q4_f(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K rows [N, K / 256 * 144] as Q4_F rows [N, K / 32 * 24], the same weights exactly
    (GGUF's arithmetic: the products d * sc and dmin * m exact in fp32, w = (d * sc) * q -
    dmin * m, one rounding)."""
    n = raw.shape[0]
    blocks, d, dmin, sc, mn = _k_header(raw, Q4_K_BYTES)
    supers = blocks.shape[1]
    # Sub-blocks 2i and 2i + 1: the low and high nibbles of bytes [32 i, 32 i + 32).
    qs = blocks[..., 16:].view(n, supers, 4, 32)
    q = torch.stack((qs & 0xF, qs >> 4), dim=3).view(n, supers, 8, 32)  # [N, S, 8, 32]
    out = torch.empty(n, supers, 8, BLOCK_BYTES[Q4_F], dtype=torch.uint8)
    out[..., 0:4] = (d * sc).unsqueeze(-1).contiguous().view(torch.uint8)
    out[..., 4:8] = (-(dmin * mn)).unsqueeze(-1).contiguous().view(torch.uint8)
    out[..., 8:] = q[..., :16] | (q[..., 16:] << 4)
    return out.view(n, -1)


def _eight_bit_blocks(first: torch.Tensor, second: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q8_F / Q8_S rows [N, K / 32 * 40] from per-block fp32 fields [N, B] and q [N, B, 32]."""
    n, b = q.shape[0], q.shape[1]
    out = torch.empty(n, b, 40, dtype=torch.uint8)
    out[..., 0:4] = first.float().unsqueeze(-1).contiguous().view(torch.uint8)
    out[..., 4:8] = second.float().unsqueeze(-1).contiguous().view(torch.uint8)
    out[..., 8:] = q.to(torch.int8).view(torch.uint8)
    return out.view(n, -1)


Q5_K = 13  # GGML's id: 256 weights: fp16 d, fp16 dmin, 12 bytes of scales and minimums as
Q5_K_BYTES = 176  # Q4_K's, 32 bytes of fifth bits, 128 of nibbles; w = d * sc * q - dmin * m


def q5_k_as_q8_f(raw: torch.Tensor) -> torch.Tensor:
    """Q5_K rows [N, K / 256 * 176] as Q8_F rows [N, K / 32 * 40], the same weights exactly
    (GGUF's arithmetic: (d * sc) * q - dmin * m with both products exact in fp32)."""
    n = raw.shape[0]
    blocks, d, dmin, sc, mn = _k_header(raw, Q5_K_BYTES)
    supers = blocks.shape[1]
    high = blocks[..., 16:48].to(torch.int32)  # [N, S, 32]: bit i of byte l: sub-block i's
    low = blocks[..., 48:].view(n, supers, 4, 32).to(torch.int32)
    nibbles = torch.stack((low & 0xF, low >> 4), dim=3).view(n, supers, 8, 32)
    fifth = (high.unsqueeze(2) >> torch.arange(8).view(1, 1, 8, 1)) & 1
    q = nibbles | (fifth << 4)  # [N, S, 8, 32], in [0, 31]
    return _eight_bit_blocks(
        (d * sc).view(n, -1), (-(dmin * mn)).view(n, -1), q.view(n, supers * 8, 32)
    )


Q6_K = 14  # GGML's id: 256 weights: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
Q6_K_BYTES = 210  # scales (one per 16 weights), fp16 d; w = d * scale * (q - 32)


def q6_k_as_q8_s(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K rows [N, K / 256 * 210] as Q8_S rows [N, K / 32 * 40], the same weights exactly
    (GGUF's arithmetic: (d * scale) * q, the product exact in fp32; q - 32 fits int8)."""
    n = raw.shape[0]
    blocks = raw.contiguous().view(n, -1, Q6_K_BYTES)
    supers = blocks.shape[1]
    ql = blocks[..., 0:128].view(n, supers, 2, 2, 32).to(torch.int32)  # [half, 32-byte run, l]
    qh = blocks[..., 128:192].view(n, supers, 2, 32).to(torch.int32)  # [half, l]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # [N, S, 1]
    # Within a half of 128 weights, 32-weight run r (0-3) takes the low (r < 2) or high
    # nibbles of ql's run r % 2 and bits 2r, 2r + 1 of qh (llama.cpp's dequantize_row_q6_K).
    nib = torch.stack((ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF, ql[..., 0, :] >> 4,
                       ql[..., 1, :] >> 4), dim=3)  # fmt: skip  [N, S, half, run, 32]
    pairs = (qh.unsqueeze(3) >> (2 * torch.arange(4)).view(1, 1, 1, 4, 1)) & 3
    q = (nib | (pairs << 4)) - 32  # [N, S, 2, 4, 32] = 8 blocks of 32 in order
    per16 = (d * scales).view(n, supers * 8, 2)  # block b's two halves' scales
    return _eight_bit_blocks(per16[..., 0], per16[..., 1], q.reshape(n, supers * 8, 32))


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The fp32 weights [N, K] of a GGUF tensor's rows, in GGUF's own arithmetic (the fp16
    fields widened, one fp32 product and, for Q4_1, one sum per weight)."""
    d, m, q = _fields(raw, qtype)
    n, k = q.shape
    if qtype == Q8_S:  # weights 0-15 of a block times d, 16-31 times e (m's place)
        halves = torch.stack((d, m), dim=-1).repeat_interleave(BLOCK // 2, dim=-1)
        return halves.view(n, k) * q.float()
    scale = d.float().repeat_interleave(BLOCK, dim=1)
    if qtype == Q4_0:
        return scale * (q.float() - 8)
    if qtype == Q4_Z:
        return scale * (q.float() - m.float().repeat_interleave(BLOCK, dim=1))
    w = scale * q.float()
    if qtype in ADDS_MINIMUM:
        w = w + m.float().repeat_interleave(BLOCK, dim=1)
    return w


@dataclass
class PackedGGUF:
    """A GGUF weight in the kernel's layout (csrc/gguf_linear.cpp)."""

    qtype: int
    shape: tuple[int, int]  # the logical [N, K]
    qs: torch.Tensor  # uint8 [N / 16, K / 32, 16, 32] (8-bit), [N / 16, K / 32, 4, 64] (4-bit)
    d: torch.Tensor  # fp16 (fp32: Q4_F, Q8_F, Q8_S) [N / 16, K / 32, 16]
    m: torch.Tensor | None  # as d (Q4_1's, Q4_F's and Q8_F's m, Q4_Z's z, Q8_S's e)
    # The input features in the weight's column order (GPTQ's act-order: the checkpoint's
    # columns sorted by group), taken from x before the product; None: x's own order.
    perm: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_linear(x, self, bias)

    def decode_operands(self) -> tuple[int, list[torch.Tensor | None]] | None:
        """(qtype, its three tensors) for the one-call decode step (csrc/decode_layers.cpp);
        None where it cannot take this weight (x in another feature order)."""
        return None if self.perm is not None else (self.qtype, [self.qs, self.d, self.m])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows `ids` [T] of the weight, [T, K], as `dequantize` gives them (a tied
        embedding's lookup in its LM head's blocks): the kernel's loop on the CPU where the
        kernels are loaded (the torch ops below cost ~0.2 ms a decode step at one token), else
        those."""
        if cpu.loaded() and self.qs.device.type == "cpu":
            return torch.ops.tokenmill.gguf_rows(self.qs, self.d, self.m, self.qtype, ids)
        return self.rows_native(ids)

    def rows_native(self, ids: torch.Tensor) -> torch.Tensor:
        """`rows` in torch ops (the reference of the kernel's)."""
        n, k = self.shape
        blocks, t = k // BLOCK, ids.numel()
        group, column = ids // GROUP, ids % GROUP
        # Lane j of a pair is column j // 2 at k parity j % 2.
        lanes = torch.stack((2 * column, 2 * column + 1), dim=-1).view(t, 1, 1, 2)
        if self.qtype in EIGHT_BIT:  # [T, blocks, pairs, 32] bytes
            qs = self.qs[group]
            picked = qs.gather(3, lanes.expand(t, blocks, qs.shape[2], 2))
            q = picked.view(torch.int8).reshape(t, k).float()
        else:  # [T, blocks, rows, 32] words, row c's bits 4e on holding pair 4c + e
            qs = self.qs[group].view(torch.int16).to(torch.int32) & 0xFFFF
            picked = qs.gather(3, lanes.expand(t, blocks, qs.shape[2], 2))
            nibbles = [(picked >> (4 * e)) & 0xF for e in range(4)]
            q = torch.stack(nibbles, dim=3).reshape(t, k).float()  # [T, blocks, c, e, parity]

        def per_block(s: torch.Tensor) -> torch.Tensor:
            at = column.view(t, 1, 1).expand(t, blocks, 1)
            return s[group].gather(2, at).view(t, blocks).float().repeat_interleave(BLOCK, dim=1)

        scale = per_block(self.d)
        if self.qtype == Q8_S:  # weights 16-31 of each block take e
            first = torch.arange(k) % BLOCK < BLOCK // 2
            return torch.where(first, scale, per_block(self.m)) * q
        if self.qtype == Q4_0:
            return scale * (q - 8)
        if self.qtype == Q4_Z:
            return scale * (q - per_block(self.m))
        w = scale * q
        return w + per_block(self.m) if self.qtype in ADDS_MINIMUM else w


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
    if qtype in EIGHT_BIT:
        qs = words.to(torch.int8).contiguous().view(torch.uint8)
    else:  # pairs 4c to 4c + 3 share row c of 16-bit words, pair 4c + e in bits 4e on
        pairs = words.view(groups, blocks, 4, 4, 2 * GROUP).to(torch.int32)
        row = sum(pairs[:, :, :, e] << (4 * e) for e in range(4))
        qs = row.to(torch.uint16).contiguous().view(torch.uint8)

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
