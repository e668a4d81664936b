"""The torch attention backend against the per-request reference in kernels/reference.py,
and the reference against dense causal attention over unpaged tensors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.reference import paged_attention, write_kv_cache
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import StepAttentionInputs
from tokenmill.worker.attention.torch_backend import (
    TorchAttentionBackend,
    decode_query_per_head,
)


def make_batch(query_lens, seq_lens, num_blocks, block_size, kv_heads, head_size, seed=0):
    """Random block tables (disjoint blocks, never block 0) and K/V for earlier positions
    already in the cache. Returns everything both implementations need."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(cdiv(s, block_size) for s in seq_lens)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for s in seq_lens:
        n = cdiv(s, block_size)
        tables.append([perm.pop() for _ in range(n)])
    cache = torch.zeros(num_blocks, 2, block_size, kv_heads, head_size)
    # Earlier context lives in the cache already.
    for table, s, q in zip(tables, seq_lens, query_lens):
        past = s - q
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(past)]
        )
        if past:
            write_kv_cache(
                cache,
                torch.randn(past, kv_heads, head_size, generator=g),
                torch.randn(past, kv_heads, head_size, generator=g),
                slots,
            )
    slot_mapping = np.array(
        [
            table[p // block_size] * block_size + p % block_size
            for table, s, q in zip(tables, seq_lens, query_lens)
            for p in range(s - q, s)
        ]
    )
    block_table = np.zeros((len(seq_lens), max_blocks), dtype=np.int64)
    for r, table in enumerate(tables):
        block_table[r, : len(table)] = table
    return tables, cache, slot_mapping, block_table, g


def step_inputs(
    num_decodes, query_lens, seq_lens, block_table, slot_mapping, block_size
) -> StepAttentionInputs:  # fmt: skip
    """The step description these tests hand to build_metadata (fp32 activations)."""
    return StepAttentionInputs(
        num_decodes=num_decodes,
        query_lens=np.array(query_lens),
        seq_lens=np.array(seq_lens),
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=block_size,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (None, 2.5), (9, 3.0)])
@pytest.mark.parametrize("group_blocks", [None, 12])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_torch_backend_matches_reference(
    heads: int, kv_heads: int, group_blocks, window, softcap
) -> None:
    """With a sliding window (shorter than most contexts, and than the fresh 7-token prompt)
    and Gemma 2's soft-capping too."""
    block_size, head_size, num_blocks = 4, 16, 200
    # Decodes first (in unsorted, ragged contexts of up to 10 blocks: with a 12-block group
    # limit they form groups of one to three), then prefill chunks with and without earlier
    # context.
    num_decodes = 19
    rng = np.random.default_rng(0)
    query_lens = [1] * num_decodes + [7, 5, 1 + 2]
    seq_lens = list(rng.integers(1, 40, num_decodes)) + [7, 23, 12]
    tables, cache, slot_mapping, block_table, g = make_batch(
        query_lens, seq_lens, num_blocks, block_size, kv_heads, head_size
    )
    total = sum(query_lens)
    q = torch.randn(total, heads, head_size, generator=g)
    k = torch.randn(total, kv_heads, head_size, generator=g)
    v = torch.randn(total, kv_heads, head_size, generator=g)
    scale = head_size**-0.5

    ref_cache = cache.clone()
    write_kv_cache(ref_cache, k, v, torch.from_numpy(slot_mapping))
    expected = paged_attention(q, ref_cache, tables, seq_lens, query_lens, scale, window, softcap)
    if window is not None or softcap is not None:  # they change the result
        plain = paged_attention(q, ref_cache, tables, seq_lens, query_lens, scale)
        assert (plain - expected).abs().max() > 1e-3

    page_bytes = 2 * block_size * kv_heads * head_size * 4
    backend = TorchAttentionBackend(
        decode_group_bytes=None if group_blocks is None else group_blocks * page_bytes
    )
    backend.set_block_bytes(page_bytes)
    meta = backend.build_metadata(
        step_inputs(num_decodes, query_lens, seq_lens, block_table, slot_mapping, block_size)
    )
    if group_blocks is None:
        assert len(meta.decode_groups) == 1
    else:
        assert len(meta.decode_groups) > 3
        assert all(gr.size * gr.num_blocks <= group_blocks for gr in meta.decode_groups)
    assert sum(gr.size for gr in meta.decode_groups) == num_decodes
    first_cache = cache.clone()
    out = backend.forward(q, k, v, cache, meta, scale, window, softcap)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # A second layer reuses the scratch copies of the first.
    again = backend.forward(q, k, v, first_cache, meta, scale, window, softcap)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (6, 2)])
def test_bf16_decodes_in_either_query_form(heads: int, kv_heads: int) -> None:
    """bf16 decodes whose KV heads serve two query heads attend with a query row per head,
    those with three with the heads stacked as rows (decode_query_per_head): both against the
    fp32 reference on the same rounded inputs, to bf16's precision."""
    assert decode_query_per_head(torch.bfloat16, heads // kv_heads) == (heads // kv_heads == 2)
    block_size, head_size, num_blocks = 4, 16, 200
    rng = np.random.default_rng(1)
    seq_lens = [int(n) for n in rng.integers(1, 40, 9)]
    query_lens = [1] * len(seq_lens)
    tables, cache, slot_mapping, block_table, g = make_batch(
        query_lens, seq_lens, num_blocks, block_size, kv_heads, head_size
    )
    q, k, v = (
        torch.randn(len(seq_lens), n, head_size, generator=g).bfloat16()
        for n in (heads, kv_heads, kv_heads)
    )
    cache = cache.bfloat16()
    ref_cache = cache.float()
    write_kv_cache(ref_cache, k.float(), v.float(), torch.from_numpy(slot_mapping))
    scale = head_size**-0.5
    expected = paged_attention(q.float(), ref_cache, tables, seq_lens, query_lens, scale)
    backend = TorchAttentionBackend()
    backend.set_block_bytes(2 * block_size * kv_heads * head_size * 2)
    decodes = len(seq_lens)
    inputs = step_inputs(decodes, query_lens, seq_lens, block_table, slot_mapping, block_size)
    meta = backend.build_metadata(dataclasses.replace(inputs, dtype=torch.bfloat16))
    out = backend.forward(q, k, v, cache, meta, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


def test_reference_matches_dense_causal_attention() -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head_size, block_size, n = 4, 2, 8, 4, 11
    q = torch.randn(n, heads, head_size, generator=g)
    k = torch.randn(n, kv_heads, head_size, generator=g)
    v = torch.randn(n, kv_heads, head_size, generator=g)
    cache = torch.zeros(8, 2, block_size, kv_heads, head_size)
    table = [5, 2, 7]  # positions 0..10 over three non-consecutive blocks
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
    write_kv_cache(cache, k, v, slots)
    out = paged_attention(q, cache, [table], [n], [n], head_size**-0.5)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_cpu_cache_sizes_come_from_sysfs(tmp_path) -> None:
    from tokenmill.worker.attention.torch_backend import cpu_cache_bytes

    for index, (level, kind, size) in enumerate(
        [
            (1, "Data", "48K"),
            (1, "Instruction", "32K"),
            (2, "Unified", "1024K"),
            (3, "Unified", "32M"),
        ]
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert cpu_cache_bytes(1, str(tmp_path)) == 48 << 10  # the data cache, not instructions
    assert cpu_cache_bytes(2, str(tmp_path)) == 1 << 20
    assert cpu_cache_bytes(3, str(tmp_path)) == 32 << 20


# ------------------------------------------------------------------ the backend registry
def test_the_registry_holds_every_configurable_backend_under_its_name() -> None:
    from tokenmill.protocol.config import ATTENTION_BACKENDS
    from tokenmill.worker.attention.registry import BACKENDS, backend_class

    assert sorted(BACKENDS) == sorted(ATTENTION_BACKENDS)
    for name in BACKENDS:
        backend = backend_class(name)
        assert backend.name == name
        assert backend.kv_cache_shape(7, 16, 3, 64) == (7, 2, 16, 3, 64)
    assert backend_class("TRITON_ATTN").captures_steps
    assert torch.float16 not in backend_class("CPU_ATTN").dtypes
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        backend_class("FLASH_ATTN")


@pytest.mark.parametrize("dtype, expected", [("bfloat16", "CPU_ATTN"), ("float16", "TORCH_SDPA")])
def test_cpu_attn_gives_way_where_it_does_not_take_the_dtype(tiny_model, dtype, expected) -> None:
    from tokenmill.kernels import cpu
    from tokenmill.protocol import envs
    from tokenmill.protocol.config import EngineArgs
    from tokenmill.worker.attention.registry import make_attention_backend

    if not cpu.load(envs.TOKENMILL_CACHE):
        pytest.skip("the CPU kernels cannot be built here")
    args = EngineArgs(model=str(tiny_model("llama-gqa")), device="cpu", dtype=dtype)
    config = args.create_engine_config()
    assert config.device_config.attention_backend == "CPU_ATTN"
    assert make_attention_backend(config, torch.device("cpu")).name == expected


def test_fp16_runs_on_the_torch_path_beside_the_cpu_kernels(tiny_model) -> None:
    """The CPU kernels take fp32 and bf16: in fp16 the layers and attention run on torch. Its
    first greedy token is among the fp32 engine's two most likely (fp16 rounds too coarsely
    on a random model's flat logits to ask for more)."""
    from tokenmill import LLM, SamplingParams

    path = str(tiny_model("llama-gqa"))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    outs = {}
    for dtype in ("float16", "float32"):
        llm = LLM(path, dtype=dtype, multiprocess=False, skip_tokenizer_init=True,
                  max_model_len=128, kv_cache_memory_bytes=8 << 20)  # fmt: skip
        try:
            runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
            assert runner.layer_kernels() in ("cpu", "native")
            if dtype == "float16":
                assert runner.layer_kernels() == "native"
                assert runner.attn_backend.name == "TORCH_SDPA"
            prompt = [{"prompt_token_ids": [5, 17, 99, 3]}]
            outs[dtype] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.shutdown()
    assert len(outs["float16"].token_ids) == 8
    assert outs["float16"].token_ids[0] in outs["float32"].logprobs[0]
