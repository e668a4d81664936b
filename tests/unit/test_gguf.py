"""GGUF block formats: the plain-torch de-quantization against gguf-py's own, the CPU kernel
`gguf_linear` against de-quantize-then-matmul (every instruction set this CPU runs, rows 1 to
512), and the loader's pieces (narrowing a quantized tensor, q/k's row order)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.kernels.cpu import gguf as G
from tokenmill.worker.layers.quantization.gguf import GGUFWeight, _reverse_permute

TYPES = [G.Q4_0, G.Q4_1, G.Q8_0]
# Q4_Z: the int4 checkpoints' (AWQ, GPTQ) blocks; Q4_F, Q8_F, Q8_S: Q4_K's, Q5_K's and
# Q6_K's, rewritten
KERNEL_TYPES = TYPES + [G.Q4_Z, G.Q4_F, G.Q8_F, G.Q8_S]


def random_blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of random blocks [n, k / 32 * block bytes] with the format's extremes: whole blocks
    of the smallest and largest integers, scales of zero, of fp16's largest magnitude and
    subnormal, negative scales and minimums."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    raw = torch.randint(0, 256, (n, blocks, G.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    d = torch.randn(n, blocks, generator=g) * 0.02
    d[0, 0], d[1, 0], d[2, 0], d[3, 0] = 0.0, 65504.0, -65504.0, 6e-8
    raw[..., 0:2] = d.half().view(torch.uint8).view(n, blocks, 2)
    start = 2
    if qtype == G.Q4_1:
        m = torch.randn(n, blocks, generator=g) * 0.05
        m[4, 0] = -65504.0
        raw[..., 2:4] = m.half().view(torch.uint8).view(n, blocks, 2)
        start = 4
    if qtype in (G.Q4_F, G.Q8_F):  # fp32 scales and minimums (as d * sc and -dmin * m are)
        raw[..., 0:4] = (d.float() * 63).view(torch.uint8).view(n, blocks, 4)
        m = -torch.rand(n, blocks, generator=g) * 0.5
        raw[..., 4:8] = m.view(torch.uint8).view(n, blocks, 4)
        start = 8
    if qtype == G.Q8_S:  # two fp32 scales (d * scale, scale an int8: -128 among them)
        raw[..., 0:4] = (d.float() * -128).view(torch.uint8).view(n, blocks, 4)
        e = torch.randn(n, blocks, generator=g) * 0.02 * 127
        e[4, 0] = 0.0
        raw[..., 4:8] = e.view(torch.uint8).view(n, blocks, 4)
        start = 8
    if qtype == G.Q4_Z:  # integer zero points, 0 and 15 among them
        z = torch.randint(0, 16, (n, blocks), generator=g).float()
        z[4, 0], z[5, 0] = 0.0, 15.0
        raw[..., 2:4] = z.half().view(torch.uint8).view(n, blocks, 2)
        start = 4
    raw[5, 0, start:] = 0x00  # q = 0 (Q4), 0 (Q8)
    raw[6, 0, start:] = 0xFF  # q = 15 (Q4), -1 (Q8)
    raw[7, 0, start:] = 0x80  # q = 0 and 8 (Q4), -128 (Q8)
    raw[8, 0, start:] = 0x7F  # q = 15 and 7 (Q4), 127 (Q8)
    return raw.view(n, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: G.NAMES[t])
def test_dequantize_equals_gguf_py(qtype: int) -> None:
    raw = random_blocks(qtype, 64, 256, seed=qtype)
    ours = G.dequantize(raw, qtype)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)))


def test_q5_0_rewritten_as_q8_0_holds_the_same_weights() -> None:
    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (64, 4, 22), dtype=torch.uint8, generator=g)
    raw[..., 0:2] = (torch.randn(64, 4, 1, generator=g) * 0.05).half().view(torch.uint8)
    raw[0, 0, 2:] = 0xFF  # every q = 31
    raw[1, 0, 2:] = 0x00  # every q = 0
    raw = raw.view(64, -1)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q5_0)
    ours = G.dequantize(G.q5_0_as_q8_0(raw), G.Q8_0)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)))


def test_q4_k_rewritten_as_q4_f_holds_the_same_weights() -> None:
    g = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (16, 2, 144), dtype=torch.uint8, generator=g)
    raw[..., 0:4] = (torch.rand(16, 2, 2, generator=g) * 0.02).half().view(torch.uint8)
    raw[0, 0, 4:16] = 0xFF  # every 6-bit scale and minimum 63
    raw = raw.view(16, -1)
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K)
    ours = G.dequantize(G.q4_k_as_q4_f(raw), G.Q4_F)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)))


def k_quant_blocks(qtype: gguf.GGMLQuantizationType, rows: int, seed: int) -> torch.Tensor:
    """Random super-blocks of 256 weights (every byte random but the fp16 scales, which are
    finite), with one of all-ones bytes (the largest q, scales, minimums: 0xFF) and one of
    zeros."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, 2, size), dtype=torch.uint8, generator=g)
    scales = (torch.randn(rows, 2, 2, generator=g) * 0.02).half().view(torch.uint8)
    raw[1, 0], raw[2, 0] = 0xFF, 0x00
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # d last
        raw[..., size - 2 :] = scales[..., 0:2]
    else:  # d and dmin first
        raw[..., 0:4] = scales
    return raw.view(rows, -1)


@pytest.mark.parametrize(
    "name, rewrite, target",
    [("Q5_K", G.q5_k_as_q8_f, G.Q8_F), ("Q6_K", G.q6_k_as_q8_s, G.Q8_S)],
)
def test_k_quants_rewritten_as_eight_bit_blocks_hold_the_same_weights(
    name, rewrite, target
) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    raw = k_quant_blocks(qtype, 16, seed=int(qtype))
    theirs = gguf.quants.dequantize(raw.numpy(), qtype)
    ours = G.dequantize(rewrite(raw), target)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)))


def test_q4_z_dequantizes_as_scale_times_q_minus_zero() -> None:
    raw = random_blocks(G.Q4_Z, 16, 64, seed=5)
    blocks = raw.view(16, 2, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [16, 2, 1]
    z = blocks[..., 2:4].contiguous().view(torch.float16).float()
    nibbles = blocks[..., 4:].long()
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).float()  # weights 0-15, then 16-31
    assert torch.equal(G.dequantize(raw, G.Q4_Z), (d * (q - z)).view(16, 64))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: G.NAMES[t])
def test_packed_rows_equal_the_dequantized_rows(qtype: int) -> None:
    raw = random_blocks(qtype, 128, 96, seed=11 + qtype)
    ids = torch.tensor([0, 5, 17, 127, 64, 5, 33])
    assert torch.equal(G.repack(raw, qtype).rows_native(ids), G.dequantize(raw, qtype)[ids])


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: G.NAMES[t])
def test_gguf_rows_kernel_equals_the_dequantized_rows(qtype: int, kernels) -> None:
    raw = random_blocks(qtype, 128, 96, seed=11 + qtype)
    packed = G.repack(raw, qtype)
    ids = torch.tensor([0, 5, 17, 127, 64, 5, 33])
    assert torch.equal(packed.rows(ids), G.dequantize(raw, qtype)[ids])
    with pytest.raises(RuntimeError, match=r"gguf_rows: id 128 is outside \[0, 128\)"):
        packed.rows(torch.tensor([128]))


def test_repack_refuses_shapes_the_kernels_do_not_take() -> None:
    assert not G.supported(G.Q4_0, (48, 64)) and G.supported(G.Q4_0, (64, 64))
    with pytest.raises(ValueError, match="does not fit"):
        G.repack(random_blocks(G.Q4_0, 48, 64, seed=1), G.Q4_0)
    with pytest.raises(ValueError, match="uint8"):
        G.repack(torch.zeros(64, 19, dtype=torch.uint8), G.Q4_0)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: G.NAMES[t])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gguf_linear_equals_dequantize_then_matmul(isa, qtype: int, dtype) -> None:
    n, k = 192, 320
    raw = random_blocks(qtype, n, k, seed=7 * qtype)
    scales = torch.rand(n, k // 32, 1) * 0.05  # moderate scales here: the extremes' products
    if qtype in G.FP32_SCALES:  # would swamp the bound below
        raw.view(n, k // 32, -1)[:, :, 0:4] = scales.view(torch.uint8)
        if qtype == G.Q8_S:
            raw.view(n, k // 32, -1)[:, :, 4:8] = (-scales).view(torch.uint8)
    else:
        raw.view(n, k // 32, -1)[:, :, 0:2] = scales.half().view(torch.uint8)
    weight = G.dequantize(raw, qtype)
    packed = G.repack(raw, qtype)
    bias = torch.randn(n)
    # the few-row loop (1-4; without AMX up to 64, 12 rows at a time, then 8, then the rest),
    # one and several row blocks
    for m in (1, 3, 4, 6, 8, 16, 21, 64, 65, 300, 512):
        x = torch.randn(m, k).to(dtype)
        got = G.gguf_linear(x, packed, bias.to(dtype))
        assert got.dtype == dtype and got.shape == (m, n)
        # De-quantize, then multiply in x's dtype (bf16 weights, fp32 sums), plus the bias.
        w = weight.to(dtype).float()
        want = x.float() @ w.T + bias.to(dtype).float()
        magnitude = x.float().abs() @ weight.abs().T + bias.abs()
        bound = (k + 1) * 2.0**-24 * magnitude
        if dtype == torch.bfloat16:
            # The few-row loop multiplies the exact weights (products in fp32), the reference
            # their bf16 roundings: within 2^-8 of each; then one place of bf16's rounding.
            bound = bound + 2.0**-8 * magnitude + 2.0**-7 * want.abs().maximum(got.float().abs())
        diff = (got.float() - want).abs()
        assert (diff <= bound).all(), (m, float((diff - bound).max()))


def test_gguf_linear_takes_the_extremes_of_each_format(kernels) -> None:
    for qtype in KERNEL_TYPES:
        raw = random_blocks(qtype, 64, 64, seed=qtype + 100)
        packed = G.repack(raw, qtype)
        x = torch.randn(2, 64)
        want = x @ G.dequantize(raw, qtype).T
        got = G.gguf_linear(x, packed)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_gguf_weight_narrows_rows_and_whole_blocks() -> None:
    raw = random_blocks(G.Q4_1, 16, 128, seed=3)
    w = GGUFWeight(raw.numpy(), G.Q4_1, 128)
    assert w.shape == (16, 128)
    full = w.load()
    assert torch.equal(w.narrow(0, 2, 3).load(), full[2:5])
    assert w.narrow(1, 64, 64).shape == (16, 64)
    assert torch.equal(w.narrow(1, 64, 64).load(), full[:, 64:])
    with pytest.raises(ValueError, match="whole blocks of 32"):
        w.narrow(1, 16, 64)


def test_reverse_permute_undoes_llama_cpp_q_k_interleaving() -> None:
    heads, dim = 3, 8  # head size 8: rotary halves of 4
    rows = np.arange(heads * dim * 2).reshape(heads * dim, 2)
    # llama.cpp's converter: per head, row order (0, 4, 1, 5, 2, 6, 3, 7).
    permuted = rows.reshape(heads, 2, dim // 2, 2).swapaxes(1, 2).reshape(rows.shape)
    assert np.array_equal(_reverse_permute(permuted, heads), rows)
