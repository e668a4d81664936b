"""The batch-invariant mode of tokenmill's CPU kernels (kernels/batch_invariant.py,
csrc/batch_invariant.h): with it on, a row's output is the same bits alone and among any
number of other rows (matmuls, RMSNorm) or requests of other lengths (decode attention, whose
contexts are cut every kInvariantPart keys), on every instruction set level this CPU runs; and
decode attention in the mode is still attention (against its torch reference)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import batch_invariant as bi
from tokenmill.kernels.cpu import gguf as G
from tokenmill.kernels.cpu import int8 as I
from tokenmill.kernels.cpu import linear as L

ROWS = (2, 7, 33, 100, 300)  # batch sizes a row is checked in (beside 1: alone)
PART = 256  # csrc/attention.cpp's kInvariantPart


# On AMX the mode's bf16 matmuls run oneDNN's AMX tiles at every row count (1-4 rows
# included); whether the tiles sum a row alike at every row count has not been seen on an
# AMX machine yet. Run there, these show XPASS (make them strict then) or XFAIL (a defect).
AMX_UNVERIFIED = pytest.mark.xfail(
    strict=False, reason="AMX tiles' row invariance not yet verified on an AMX CPU"
)


@pytest.fixture(autouse=True)
def invariant(kernels):
    """The mode on for the test (the C++ switch too), restored after."""
    before = bi.batch_invariant()
    bi.set_batch_invariant(True)
    yield
    bi.set_batch_invariant(before)


def _assert_rows_invariant(product, x: torch.Tensor) -> None:
    """Row i of product(x[:b]) is product(x[i:i + 1]) bit for bit, for every b in ROWS."""
    alone = torch.cat([product(x[i : i + 1]) for i in range(x.shape[0])])
    for b in ROWS:
        got = product(x[:b])
        for i in range(b):
            assert torch.equal(got[i], alone[i]), f"row {i} of {b} differs from it alone"


def _rows(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(max(ROWS), k, generator=g).to(dtype)


# ------------------------------------------------------------------------------ matmuls
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(1536, 576), (128, 130)])
def test_linear_rows_are_batch_invariant(request, isa, dtype, n, k) -> None:
    if isa == 3 and dtype == torch.bfloat16:
        request.applymarker(AMX_UNVERIFIED)
    torch.manual_seed(n + k)
    packed = L.pack_weight(torch.randn(n, k).to(dtype))
    bias = torch.randn(n).to(dtype)
    x = _rows(k, dtype, seed=n)
    _assert_rows_invariant(lambda rows: L.linear(rows, packed, bias), x)
    _assert_rows_invariant(lambda rows: L.linear_silu_mul(rows, packed, bias), x)


def _gguf_weight(qtype: int, n: int, k: int) -> G.PackedGGUF:
    """A random weight of the type, its scales (and minimums) of a model's size."""
    g = torch.Generator().manual_seed(qtype)
    blocks = k // G.BLOCK
    raw = torch.randint(0, 256, (n, blocks, G.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    raw[..., 0:2] = (torch.rand(n, blocks, 1, generator=g) * 0.02).half().view(torch.uint8)
    if qtype == G.Q4_1:
        raw[..., 2:4] = (torch.randn(n, blocks, 1, generator=g) * 0.05).half().view(torch.uint8)
    return G.repack(raw.view(n, -1), qtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qtype", [G.Q4_0, G.Q4_1, G.Q8_0], ids=lambda t: G.NAMES[t])
def test_gguf_linear_rows_are_batch_invariant(isa, qtype, dtype) -> None:
    n, k = 256, 576
    weight = _gguf_weight(qtype, n, k)
    bias = torch.randn(n).to(dtype)
    _assert_rows_invariant(lambda rows: G.gguf_linear(rows, weight, bias), _rows(k, dtype, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_rows_are_batch_invariant(isa, dtype) -> None:
    torch.manual_seed(8)
    weight = I.pack(torch.randn(256, 576))
    bias = torch.randn(256).to(dtype)
    x = _rows(576, dtype, seed=8)
    _assert_rows_invariant(lambda rows: I.int8_linear(rows, weight, bias), x)
    _assert_rows_invariant(lambda rows: I.int8_linear_silu_mul(rows, weight, bias), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [576, 100])
def test_rms_norm_rows_are_batch_invariant(isa, dtype, d) -> None:
    weight = torch.randn(d).to(dtype)

    def norm(rows: torch.Tensor) -> torch.Tensor:  # rows: [x | residual]
        residual = rows[:, d:].clone()  # added to in place
        out = torch.ops.tokenmill.rms_norm(rows[:, :d].contiguous(), weight, 1e-6, residual)
        return torch.cat((out, residual), dim=-1)

    _assert_rows_invariant(norm, _rows(2 * d, dtype, seed=d))


@pytest.mark.parametrize("d", [640, 256])  # Gemma 3 270M's hidden size and head size
def test_gemma_norm_rows_are_batch_invariant(d) -> None:
    """Gemma's (1 + w) norm stays torch's on the CPU: its mean over a row of these widths
    is reduced per row, in one order at every row count."""
    from tokenmill.worker.models.gemma import GemmaRMSNorm

    norm = GemmaRMSNorm(d)
    norm.weight.data = torch.randn(d) * 0.3
    norm = norm.to(torch.bfloat16)
    _assert_rows_invariant(norm.forward_cpu, _rows(d, torch.bfloat16, seed=d))


# ---------------------------------------------------------------------- decode attention
# Contexts shorter than a part, exactly one, just past one and two, and several parts long.
LENGTHS = [1, 17, 200, PART - 1, PART, PART + 1, 2 * PART + 1, 600, 1000, 1100]
KV_HEADS, GROUP, D, BLOCK_SIZE = 3, 3, 64, 16


def _requests(dtype: torch.dtype, cache_dtype: torch.dtype):
    """64 requests of mixed lengths (LENGTHS and random ones) over one cache: queries, the
    block table, the lengths."""
    from tokenmill.kernels.reference import to_cache

    g = torch.Generator().manual_seed(64)
    lengths = LENGTHS + torch.randint(1, 1200, (64 - len(LENGTHS),), generator=g).tolist()
    width = 1200 // BLOCK_SIZE + 1
    cache = to_cache(torch.randn(4 * width, 2, BLOCK_SIZE, KV_HEADS, D, generator=g), cache_dtype)
    table = torch.randint(0, 4 * width, (64, width), generator=g)
    query = torch.randn(64, KV_HEADS * GROUP, D, generator=g).to(dtype)
    return query, cache, table, torch.tensor(lengths)


CACHE_CASES = [(torch.bfloat16, "same"), (torch.float32, "same"), (torch.bfloat16, "fp8")]


@pytest.mark.parametrize("dtype, cache_kind", CACHE_CASES)
@pytest.mark.parametrize("window, softcap", [(None, None), (300, None), (None, 30.0)])
def test_decode_attention_requests_are_batch_invariant(
    isa, dtype, cache_kind, window, softcap
) -> None:
    """A request's output is the same bits alone and among 1, 2, 8 or 64 requests of other
    lengths (which split their contexts differently when the mode is off)."""
    from tokenmill.kernels.cpu.attention import decode_attention

    cache_dtype = dtype if cache_kind == "same" else torch.float8_e4m3fn
    query, cache, table, lengths = _requests(dtype, cache_dtype)

    def attend(rows: list[int]) -> torch.Tensor:
        return decode_attention(
            query[rows], cache, table[rows], lengths[rows], D**-0.5, window, softcap
        )

    alone = torch.cat([attend([b]) for b in range(64)])
    g = torch.Generator().manual_seed(1)
    for size in (1, 2, 8, 64):
        for _ in range(3):
            rows = torch.randperm(64, generator=g)[:size].tolist()
            got = attend(rows)
            for i, b in enumerate(rows):
                assert torch.equal(got[i], alone[b]), (
                    f"request {b} (length {lengths[b]}) differs among {size} requests"
                )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window, softcap", [(None, None), (300, 20.0)])
def test_decode_attention_in_the_mode_equals_the_reference(isa, dtype, window, softcap) -> None:
    from tokenmill.kernels.cpu.attention import decode_attention
    from tokenmill.kernels.reference import paged_attention

    query, cache, table, lengths = _requests(dtype, dtype)
    got = decode_attention(query, cache, table, lengths, D**-0.5, window, softcap)
    want = paged_attention(
        query, cache, table.tolist(), lengths.tolist(), [1] * 64, D**-0.5, window, softcap
    )
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)


def test_the_switch_reaches_the_kernels() -> None:
    """set_batch_invariant switches the C++ side too: a request split by the step when the
    mode is off (one request: a part per thread) is cut at fixed keys when it is on."""
    from tokenmill.kernels.cpu.attention import decode_attention

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: the step never splits a context")
    query, cache, table, lengths = _requests(torch.float32, torch.float32)
    rows = [LENGTHS.index(600), 0]  # 600 keys: 256 + 256 + 88 in the mode, else by the step

    def first_of(batch: list[int]) -> torch.Tensor:
        return decode_attention(query[batch], cache, table[batch], lengths[batch], D**-0.5)[0]

    invariant = first_of(rows[:1])
    assert torch.equal(first_of(rows), invariant)
    bi.set_batch_invariant(False)
    differs = [not torch.equal(first_of(rows[:1]), first_of(rows[:1] * n)) for n in (2, 3, 5)]
    assert any(differs), "the mode off never split differently by batch: not a test of it"


def test_layers_the_mode_cannot_cover_are_named() -> None:
    """A weight the packed layout does not take (N = 300, not a multiple of 16) stays on
    oneDNN, which blocks by the row count: variant_layers names it (the engine warns), and
    not the packed one beside it."""
    from tokenmill.worker.layers.embedding import ParallelLMHead
    from tokenmill.worker.layers.linear import ColumnParallelLinear, pack_cpu_weights
    from tokenmill.worker.platform import variant_layers

    model = torch.nn.Module()
    model.proj = ColumnParallelLinear(96, 160, bias=False)
    model.lm_head = ParallelLMHead(300, 96)
    pack_cpu_weights([model.proj, model.lm_head], own_kernels=True)
    assert variant_layers(model) == ["lm_head"]
