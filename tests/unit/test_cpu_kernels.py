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


def _levels() -> list[int]:
    """Every instruction set level this CPU runs: the lesser builds run too, capped."""
    if not cpu.load(envs.TOKENMILL_CACHE):
        return [-1]
    return list(range(cpu.cpu_isa(), -2, -1))


@pytest.fixture(params=_levels(), ids=lambda level: f"isa{level}")
def isa(request) -> int:
    """Runs a test with the kernels capped at each instruction set level in turn."""
    full = cpu.limit_isa(3)
    assert cpu.limit_isa(request.param) == request.param
    yield request.param
    cpu.limit_isa(full)


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
def test_linear_equals_the_reference(isa, dtype, n, k, with_bias) -> None:
    torch.manual_seed(n + k)
    weight = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    packed = cpu_linear.pack_weight(weight)
    assert packed is not None and torch.equal(cpu_linear.unpack_weight(packed), weight)
    for m in (1, 2, 3, 4, 17, 48, 256, 300):  # decode rows, odd counts, one and two row blocks
        x = torch.randn(m, k).to(dtype)
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        got = cpu_linear.linear(x, packed, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        magnitude = F.linear(x.float().abs(), weight.float().abs())
        _assert_sums_close(got, want, magnitude, k + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter, k", [(1536, 576), (64, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_silu_mul_is_silu_and_mul_of_linear_bit_for_bit(
    isa, dtype, inter, k, with_bias
) -> None:
    from tokenmill.kernels.cpu.layers import silu_and_mul

    torch.manual_seed(inter + k)
    weight = torch.randn(2 * inter, k).to(dtype)  # [gate; up]
    bias = torch.randn(2 * inter).to(dtype) if with_bias else None
    packed = cpu_linear.pack_weight(weight)
    assert cpu_linear.fuses_silu_mul(packed)
    for m in (1, 2, 4, 5, 17, 48, 256, 300):  # the few-row loop, padded tails, two row blocks
        x = torch.randn(m, k).to(dtype)
        got = cpu_linear.linear_silu_mul(x, packed, bias)
        want = silu_and_mul(cpu_linear.linear(x, packed, bias))
        assert got.dtype == dtype and got.shape == (m, inter)
        assert torch.equal(got, want), (m, (got.float() - want.float()).abs().max())
    with pytest.raises(RuntimeError, match="whole blocks"):
        cpu_linear.linear_silu_mul(x, cpu_linear.pack_weight(torch.randn(48, k).to(dtype)))


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


# ------------------------------------------------------------- elementwise layers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 100, 576, 1536])
def test_rms_norm_equals_the_torch_path(isa, dtype, d) -> None:
    from tokenmill.kernels.cpu.layers import rms_norm
    from tokenmill.worker.layers.layernorm import rms_norm_native

    torch.manual_seed(d)
    weight = (1 + 0.1 * torch.randn(d)).to(dtype)
    for rows in (1, 7, 300):
        x = (3 * torch.randn(rows, d)).to(dtype)
        residual = torch.randn(rows, d).to(dtype)
        want_residual = residual + x
        for given, summed in ((None, x), (residual, want_residual)):
            got = rms_norm(x, weight, 1e-5, given)
            want = rms_norm_native(summed, weight, 1e-5)
            if given is not None:
                assert torch.equal(given, want_residual)  # the residual, in place
            # The mean of squares may differ in its last fp32 place (another summation
            # order): a bf16 result then rounds at most one place (and its product once more).
            tolerance = 2 * 2.0**-7 if dtype == torch.bfloat16 else 1e-5
            bound = tolerance * torch.maximum(want.float().abs(), got.float().abs()) + 1e-6
            assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1536, 1000])
def test_silu_and_mul_equals_the_torch_path(isa, dtype, n) -> None:
    from tokenmill.kernels.cpu.layers import silu_and_mul
    from tokenmill.worker.layers.activation import SiluAndMul

    torch.manual_seed(n)
    x = 4 * torch.randn(3, 11, 2 * n)
    x[0, 0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    x = x.to(dtype)
    got = silu_and_mul(x.clone())
    want = SiluAndMul().forward_native(x.clone())
    assert got.shape == want.shape and got.dtype == dtype
    # exp is a polynomial within 2 fp32 places of torch's: a bf16 SiLU may round one place
    # the other way, and its product once more.
    tolerance = 2 * 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    bound = tolerance * torch.maximum(want.float().abs(), got.float().abs()) + 1e-30
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotary_is_the_torch_path_bit_for_bit(isa, dtype, d) -> None:
    from tokenmill.kernels.cpu.layers import rotary_embedding_
    from tokenmill.worker.layers.rotary import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(d, 4096, {"rope_theta": 10000.0})
    heads, kv_heads, tokens = 9, 3, 37
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d).to(dtype)
    positions = torch.randint(0, 4096, (tokens,))
    qk = qkv[:, : heads + kv_heads]  # a view inside the fused output, as the layers pass it
    want = apply_rotary(qk.clone(), rope.cos_sin(positions, dtype))
    v_before = qkv[:, heads + kv_heads :].clone()
    rotary_embedding_(qk, positions, rope.cos, rope.sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # the values untouched
    with pytest.raises(RuntimeError, match="position"):
        rotary_embedding_(qk, torch.full((tokens,), 4096), rope.cos, rope.sin)


# ----------------------------------------------------------------------- attention
def _filled_cache(blocks: int, block_size: int, kv_heads: int, d: int, dtype) -> torch.Tensor:
    from tokenmill.kernels.reference import to_cache

    return to_cache(torch.randn(blocks, 2, block_size, kv_heads, d), dtype)


# The cache in the queries' dtype, or in fp8 (e4m3: kv_cache_dtype="fp8") beside them (on
# fewer shapes: the fp8 loads are the same code for every group and head size).
CACHES = ["same", "fp8"]
ATTENTION_CASES = [(g, d, "same") for g in (1, 3, 4, 8) for d in (64, 128, 256)] + [
    (1, 64, "fp8"), (3, 128, "fp8"), (8, 256, "fp8")
]  # fmt: skip


def _cache_dtype(cache: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if cache == "same" else torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group, d, cache_kind", ATTENTION_CASES)
def test_decode_attention_equals_the_reference(isa, dtype, group, d, cache_kind) -> None:
    from tokenmill.kernels.cpu.attention import decode_attention
    from tokenmill.kernels.reference import paged_attention

    torch.manual_seed(group * d)
    kv_heads, block_size = 2, 16
    cache = _filled_cache(64, block_size, kv_heads, d, _cache_dtype(cache_kind, dtype))
    # Odd lengths, one shorter than a block, one long enough to be split across threads;
    # requests share blocks (a prefix hit) and the table is wider than any of them.
    seq_lens = [1, 17, 300, 45, 129]
    table = torch.randint(1, 64, (len(seq_lens), 24))
    table[3, :2] = table[1, :2]
    query = torch.randn(len(seq_lens), kv_heads * group, d).to(dtype)
    for window, softcap in ((None, None), (32, None), (None, 30.0), (100, 20.0)):
        got = decode_attention(query, cache, table, torch.tensor(seq_lens), d**-0.5, window,
                               softcap)  # fmt: skip
        want = paged_attention(query, cache, table.tolist(), seq_lens, [1] * len(seq_lens),
                               d**-0.5, window, softcap)  # fmt: skip
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, want, **tol)


def test_decode_attention_splits_and_merges_a_long_context_for_one_request(isa) -> None:
    """One request, one KV head: its context is split among the threads and merged, which
    must give the whole context's answer (fp32, tightly)."""
    from tokenmill.kernels.cpu.attention import decode_attention
    from tokenmill.kernels.reference import paged_attention

    cache = _filled_cache(40, 16, 1, 64, torch.float32)
    table = torch.arange(1, 40)[None, :]
    query = torch.randn(1, 4, 64)
    for length in (64, 65, 600):
        got = decode_attention(query, cache, table, torch.tensor([length]), 0.125)
        want = paged_attention(query, cache, table.tolist(), [length], [1], 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group, d, cache_kind", ATTENTION_CASES)
def test_prefill_attention_equals_the_reference(isa, dtype, group, d, cache_kind) -> None:
    from tokenmill.kernels.cpu.attention import prefill_attention
    from tokenmill.kernels.reference import paged_attention

    torch.manual_seed(group * d + 1)
    kv_heads, block_size = 2, 16
    cache = _filled_cache(64, block_size, kv_heads, d, _cache_dtype(cache_kind, dtype))
    # Whole prompts (one of a single token, one longer than a query block and a key chunk),
    # later chunks after earlier context (odd lengths, not on block edges), a verify-sized
    # chunk of 4, requests sharing blocks (a prefix hit); the table is wider than any.
    query_lens = [1, 37, 300, 16, 4, 50]
    seq_lens = [1, 37, 300, 59, 133, 181]
    table = torch.randint(1, 64, (len(seq_lens), 24))
    table[3, :2] = table[1, :2]
    starts = torch.tensor([0] + query_lens).cumsum(0)
    tokens = int(starts[-1])
    # The queries as the layers pass them: a view inside the fused q/k/v output.
    qkv = torch.randn(tokens, kv_heads * (group + 2), d).to(dtype)
    query = qkv[:, : kv_heads * group]
    for window, softcap in ((None, None), (32, None), (None, 30.0), (100, 20.0)):
        got = torch.full_like(query, float("nan"))
        prefill_attention(got, query, cache, table, starts, torch.tensor(seq_lens), d**-0.5,
                          window, softcap)  # fmt: skip
        want = paged_attention(query, cache, table.tolist(), seq_lens, query_lens, d**-0.5,
                               window, softcap)  # fmt: skip
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, want, **tol)


def test_prefill_attention_writes_only_its_rows() -> None:
    """The decodes' rows of the output (before the prefills') are left as they are."""
    from tokenmill.kernels.cpu.attention import prefill_attention
    from tokenmill.kernels.reference import paged_attention

    cache = _filled_cache(8, 16, 1, 64, torch.float32)
    table = torch.tensor([[1, 2, 3]])
    query = torch.randn(5, 2, 64)
    out = torch.zeros(5, 2, 64)
    prefill_attention(out[2:], query[2:], cache, table, torch.tensor([0, 3]), torch.tensor([40]),
                      0.125)  # fmt: skip
    assert torch.equal(out[:2], torch.zeros(2, 2, 64))
    want = paged_attention(query[2:], cache, table.tolist(), [40], [3], 0.125)
    torch.testing.assert_close(out[2:], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="request 0"):
        prefill_attention(out, query, cache, table, torch.tensor([0, 5]), torch.tensor([60]), 0.1)


@pytest.mark.parametrize("cache_kind", CACHES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_cache_write_equals_the_reference(dtype, cache_kind) -> None:
    from tokenmill.kernels.cpu.attention import kv_cache_write
    from tokenmill.kernels.reference import write_kv_cache

    cache = torch.zeros(8, 2, 16, 3, 64, dtype=_cache_dtype(cache_kind, dtype))
    want = cache.clone()
    key, value = torch.randn(5, 3, 64).to(dtype), torch.randn(5, 3, 64).to(dtype)
    # fp8's extremes: past its largest value (saturated), its smallest subnormal and below,
    # a tie between two fp8 values (to even)
    key[0, 0, :6] = torch.tensor([1e4, -600.0, 2.0**-9, 2.0**-11, 1.0625, -3.75])
    slots = torch.tensor([0, 17, 18, 127, 64])
    kv_cache_write(cache, key, value, slots)
    write_kv_cache(want, key, value, slots)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))  # bit for bit
    with pytest.raises(RuntimeError, match="slot"):
        kv_cache_write(cache, key[:1], value[:1], torch.tensor([128]))
