"""The batched LoRA matmuls (shrink: y = scale * x @ A^T, expand: out += y @ B^T, each row by
its own adapter slot): the torch reference (kernels/punica.py) against per-row products
worked out row by row, then the CPU kernels (kernels/cpu/lora.py, on every instruction set
this CPU runs) and the Triton kernels (kernels/lora.py; in the interpreter on the CPU) against
the reference. Shapes are SmolLM2-135M's projections; adapters of ranks 8 and 16 share slots
of rank 16."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import require_triton

from tokenmill.kernels import cpu, punica
from tokenmill.kernels.cpu import lora as cpu_lora
from tokenmill.kernels.punica import LoRAMapping
from tokenmill.protocol import envs

RANK = 16  # the slots' rank; slot 0 holds a rank-8 adapter padded with zeros
SLOTS = 4  # slot 3 stays unused
SCALES = torch.tensor([2.0, 0.5, 1.0, 3.0])  # alpha / rank per slot
# (K, the slices' N): a packed q/k/v, a packed gate/up, the down projection.
LAYERS = {"qkv": (576, (576, 192, 192)), "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}


def _adapters(k: int, slices: tuple[int, ...], dtype: torch.dtype, seed: int):
    """A [S, slices * R, K] (the slices' A stacked along R, as a packed layer shrinks once) and
    each slice's B [S, N, R]; slot 0's adapter has rank 8."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, len(slices) * RANK, k, generator=g) / k**0.5
    bs = [torch.randn(SLOTS, n, RANK, generator=g) for n in slices]
    for i in range(len(slices)):
        a[0, i * RANK + 8 : (i + 1) * RANK] = 0
    for b in bs:
        b[0, :, 8:] = 0
    return a.to(dtype), [b.to(dtype) for b in bs]


def _row_slots(tokens: int, seed: int) -> torch.Tensor:
    """Slots -1..2 at random, each present once there are rows enough."""
    slots = torch.randint(-1, SLOTS - 1, (tokens,), generator=torch.Generator().manual_seed(seed))
    if tokens >= 4:
        slots[:4] = torch.tensor([-1, 0, 1, 2])
    return slots


# ------------------------------------------------------------------ the mapping
def test_mapping_groups_rows_by_slot_in_row_order() -> None:
    mapping = LoRAMapping.of(torch.tensor([2, -1, 0, 2, 1, -1, 0]), num_slots=4)
    assert mapping.sorted_rows.tolist() == [1, 5, 2, 6, 4, 0, 3]
    assert mapping.starts.tolist() == [2, 4, 5, 7, 7]  # two rows of no adapter; slot 3 empty
    segments = [(slot, rows.tolist()) for slot, rows in mapping.segments()]
    assert segments == [(0, [2, 6]), (1, [4]), (2, [0, 3])]


def test_mapping_refuses_slots_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"-1\.\.3"):
        LoRAMapping.of(torch.tensor([0, 4]), num_slots=4)
    with pytest.raises(ValueError, match="-2"):
        LoRAMapping.of(torch.tensor([-2]), num_slots=4)


# -------------------------------------------------------- the reference, by hand
def test_reference_shrink_and_expand_are_the_per_row_products() -> None:
    """Small integers (exact in fp32 and bf16): the grouped matmuls equal each row's own."""
    g = torch.Generator().manual_seed(0)
    tokens, k, n, offset = 9, 12, 5, 3
    x = torch.randint(-3, 4, (tokens, k), generator=g).float()
    a = torch.randint(-2, 3, (SLOTS, RANK, k), generator=g).float()
    b = torch.randint(-2, 3, (SLOTS, n, RANK), generator=g).float()
    slots = _row_slots(tokens, seed=1)
    mapping = LoRAMapping.of(slots, SLOTS)

    y = punica.lora_shrink(x, a, mapping, SCALES)
    out = torch.randint(-50, 50, (tokens, offset + n + 2), generator=g).float()
    want = out.clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            assert (y[t] == 0).all()
            continue
        row = [SCALES[s] * sum(x[t, i] * a[s, r, i] for i in range(k)) for r in range(RANK)]
        assert y[t].tolist() == torch.stack(row).tolist()
        for j in range(n):
            want[t, offset + j] += sum(y[t, r] * b[s, j, r] for r in range(RANK))
    for dtype in (torch.float32, torch.bfloat16):
        got = out.clone().to(dtype)
        punica.lora_expand(y, b.to(dtype), mapping, got, offset)
        assert torch.equal(got.float(), want.to(dtype).float())


def test_reference_takes_one_scale_for_all_slots() -> None:
    x, a = torch.randn(5, 32), torch.randn(SLOTS, RANK, 32)
    mapping = LoRAMapping.of(torch.tensor([0, 1, -1, 2, 1]), SLOTS)
    assert torch.equal(
        punica.lora_shrink(x, a, mapping, 0.5),
        punica.lora_shrink(x, a, mapping, torch.full((SLOTS,), 0.5)),
    )
    with pytest.raises(ValueError, match="fit"):
        punica.lora_expand(torch.zeros(5, RANK), torch.zeros(SLOTS, 8, RANK), mapping,
                           torch.zeros(5, 10), offset=4)  # fmt: skip


# ------------------------------------------------------------------ CPU kernels
@pytest.fixture(scope="module")
def kernels() -> None:
    if shutil.which("c++") is None and not cpu.build_dir(envs.TOKENMILL_CACHE).exists():
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    assert cpu.load(envs.TOKENMILL_CACHE), "the CPU kernels failed to build (see the log)"


def _levels() -> list[int]:
    if shutil.which("c++") is None or not cpu.load(envs.TOKENMILL_CACHE):
        return [-1]
    return list(range(cpu.cpu_isa(), -2, -1))


@pytest.fixture(params=_levels(), ids=lambda level: f"isa{level}")
def isa(request, kernels) -> int:
    """The kernels capped at each instruction set level this CPU runs, in turn."""
    full = cpu.limit_isa(3)
    assert cpu.limit_isa(request.param) == request.param
    yield request.param
    cpu.limit_isa(full)


def _assert_sums_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor,
                       terms: int) -> None:  # fmt: skip
    """got equals want up to what the order of an fp32 sum of `terms` terms may change
    (terms * 2^-24 of the sum of their magnitudes), and in bf16 one place of the rounding."""
    bound = terms * 2.0**-24 * magnitude
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-7 * torch.maximum(want.float().abs(), got.float().abs())
    diff = (got.float() - want.float()).abs()
    assert (diff <= bound).all(), (diff - bound).max()


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_kernels_equal_the_reference(isa, layer, dtype) -> None:
    k, slices = LAYERS[layer]
    a, bs = _adapters(k, slices, dtype, seed=k + len(slices))
    for tokens in (1, 7, 64, 300):
        slots = _row_slots(tokens, seed=tokens)
        mapping = LoRAMapping.of(slots, SLOTS)
        none = slots < 0
        x = torch.randn(tokens, k).to(dtype)
        y = cpu_lora.lora_shrink(x, a, mapping, SCALES)
        want_y = punica.lora_shrink(x, a, mapping, SCALES)
        assert y.dtype == torch.float32 and y.shape == want_y.shape
        assert (y[none] == 0).all()
        magnitude = punica.lora_shrink(x.abs(), a.abs(), mapping, SCALES)
        _assert_sums_close(y, want_y, magnitude, k)

        # Each slice from the same y (the reference's), into its columns of one output.
        base = torch.randn(tokens, sum(slices)).to(dtype)
        got, want, magnitude = base.clone(), base.clone(), base.float().abs()
        offset = 0
        for i, b in enumerate(bs):
            y_slice = want_y[:, i * RANK : (i + 1) * RANK]  # strided: rows of slices * R
            cpu_lora.lora_expand(y_slice, b, mapping, got, offset)
            punica.lora_expand(y_slice, b, mapping, want, offset)
            punica.lora_expand(y_slice.abs(), b.abs(), mapping, magnitude, offset)
            offset += b.shape[1]
        assert torch.equal(got[none], base[none])
        _assert_sums_close(got, want, magnitude, RANK + 1)


def test_cpu_kernels_take_no_rows_and_rows_of_no_adapter(kernels) -> None:
    a, (b,) = _adapters(64, (32,), torch.float32, seed=0)
    for slots in (torch.zeros(0, dtype=torch.int64), torch.full((5,), -1)):
        mapping = LoRAMapping.of(slots, SLOTS)
        x, out = torch.randn(len(slots), 64), torch.randn(len(slots), 32)
        y = cpu_lora.lora_shrink(x, a, mapping, 1.0)
        assert y.shape == (len(slots), RANK) and (y == 0).all()
        before = out.clone()
        cpu_lora.lora_expand(y, b, mapping, out)
        assert torch.equal(out, before)


def test_cpu_kernels_refuse_bad_arguments_clearly(kernels) -> None:
    a, (b,) = _adapters(64, (32,), torch.float32, seed=0)
    mapping = LoRAMapping.of(torch.tensor([0, 1, -1]), SLOTS)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="bf16 or both fp32"):
        torch.ops.tokenmill.lora_shrink(x, a.bfloat16(), mapping.sorted_rows, mapping.starts,
                                        SCALES)  # fmt: skip
    with pytest.raises(RuntimeError, match="features"):
        cpu_lora.lora_shrink(torch.randn(3, 48), a, mapping, 1.0)
    with pytest.raises(RuntimeError, match="starts"):
        cpu_lora.lora_shrink(x, a, LoRAMapping.of(torch.tensor([0, 1, -1]), SLOTS + 1), 1.0)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_lora.lora_expand(torch.zeros(3, RANK), b, mapping, torch.zeros(3, 40), offset=9)


def test_without_the_kernels_the_reference_runs(monkeypatch) -> None:
    """Not loaded (TOKENMILL_CPU_KERNELS=0, no compiler), or a dtype the kernels do not take:
    the reference's results, bit for bit."""
    a, (b,) = _adapters(64, (32,), torch.float32, seed=0)
    mapping = LoRAMapping.of(torch.tensor([0, 1, -1, 2]), SLOTS)
    x, out = torch.randn(4, 64), torch.randn(4, 32)
    want_y = punica.lora_shrink(x, a, mapping, SCALES)
    want = out.clone()
    punica.lora_expand(want_y, b, mapping, want)
    monkeypatch.setattr(cpu, "loaded", lambda: False)
    assert torch.equal(cpu_lora.lora_shrink(x, a, mapping, SCALES), want_y)
    cpu_lora.lora_expand(want_y, b, mapping, out)
    assert torch.equal(out, want)
    monkeypatch.undo()
    half = punica.lora_shrink(x.half(), a.half(), mapping, SCALES)
    assert torch.equal(cpu_lora.lora_shrink(x.half(), a.half(), mapping, SCALES), half)


# --------------------------------------------------------------- Triton kernels
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_triton_kernels_equal_the_reference(tokens) -> None:
    """Small shapes (the interpreter is slow); fp32 only off a GPU, where the interpreter
    computes 16-bit types wrongly."""
    require_triton()
    from tokenmill.kernels import lora as triton_lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]
    k, slices = 80, (48, 16)
    for dtype in dtypes:
        a, bs = _adapters(k, slices, dtype, seed=tokens)
        slots = _row_slots(tokens, seed=tokens)
        x, base = torch.randn(tokens, k).to(dtype), torch.randn(tokens, sum(slices)).to(dtype)
        mapping = LoRAMapping.of(slots, SLOTS)
        want_y = punica.lora_shrink(x, a, mapping, SCALES)
        want = base.clone()
        on = LoRAMapping.of(slots.to(device), SLOTS)
        y = triton_lora.lora_shrink(x.to(device), a.to(device), on, SCALES.to(device))
        got = base.clone().to(device)
        offset = 0
        for i, b in enumerate(bs):
            punica.lora_expand(want_y[:, i * RANK : (i + 1) * RANK], b, mapping, want, offset)
            triton_lora.lora_expand(y[:, i * RANK : (i + 1) * RANK], b.to(device), on, got, offset)
            offset += b.shape[1]
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.cpu(), want_y, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tolerance, atol=tolerance)
        assert torch.equal(got.cpu()[slots < 0], base[slots < 0])


def test_triton_kernels_tile_large_ranks() -> None:
    """max_lora_rank 64 on a packed q/k/v stacks 192 ranks: the shrink tiles them over its
    grid, the expand loops over them (fp32 under the interpreter; rank 72 is off the tiles)."""
    require_triton()
    from tokenmill.kernels import lora as triton_lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(3)
    tokens, k, rank, slices = 5, 40, 72, (24, 8, 8)
    a = torch.randn(SLOTS, len(slices) * rank, k, generator=g) / k**0.5
    bs = [torch.randn(SLOTS, n, rank, generator=g) for n in slices]
    slots = _row_slots(tokens, seed=1)
    x, base = torch.randn(tokens, k, generator=g), torch.randn(tokens, sum(slices), generator=g)
    mapping, on = LoRAMapping.of(slots, SLOTS), LoRAMapping.of(slots.to(device), SLOTS)
    want_y = punica.lora_shrink(x, a, mapping, SCALES)
    y = triton_lora.lora_shrink(x.to(device), a.to(device), on, SCALES.to(device))
    torch.testing.assert_close(y.cpu(), want_y, rtol=1e-5, atol=1e-5)
    want, got, offset = base.clone(), base.clone().to(device), 0
    for i, b in enumerate(bs):
        punica.lora_expand(want_y[:, i * rank : (i + 1) * rank], b, mapping, want, offset)
        triton_lora.lora_expand(y[:, i * rank : (i + 1) * rank], b.to(device), on, got, offset)
        offset += b.shape[1]
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [5, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_kernels_take_ranks_and_widths_off_their_blocks(isa, rank, dtype) -> None:
    """Ranks that are not a multiple of 16 and slices narrower than, or not a multiple of, the
    expand's 64-column blocks (the AVX-512 build transposes B 16 x 16 values at a time)."""
    g = torch.Generator().manual_seed(rank)
    k, slices = 72, (40, 3000)
    a = (torch.randn(SLOTS, len(slices) * rank, k, generator=g) / k**0.5).to(dtype)
    bs = [torch.randn(SLOTS, n, rank, generator=g).to(dtype) for n in slices]
    for tokens in (1, 23):
        slots = _row_slots(tokens, seed=tokens)
        mapping = LoRAMapping.of(slots, SLOTS)
        x = torch.randn(tokens, k, generator=g).to(dtype)
        y = cpu_lora.lora_shrink(x, a, mapping, SCALES)
        want_y = punica.lora_shrink(x, a, mapping, SCALES)
        _assert_sums_close(y, want_y, punica.lora_shrink(x.abs(), a.abs(), mapping, SCALES), k)
        base = torch.randn(tokens, sum(slices), generator=g).to(dtype)
        got, want, magnitude = base.clone(), base.clone(), base.float().abs()
        offset = 0
        for i, b in enumerate(bs):
            y_slice = want_y[:, i * rank : (i + 1) * rank]
            cpu_lora.lora_expand(y_slice, b, mapping, got, offset)
            punica.lora_expand(y_slice, b, mapping, want, offset)
            punica.lora_expand(y_slice.abs(), b.abs(), mapping, magnitude, offset)
            offset += b.shape[1]
        assert torch.equal(got[slots < 0], base[slots < 0])
        _assert_sums_close(got, want, magnitude, rank + 1)
