"""The pure-torch attention backend: the CPU path, and the reference for faster ones.

New K/V are written into the layer's cache through flat slot indices. Decodes are batched in
consecutive groups (the model runner orders them by context length, so a group's lengths are
close): for each group one `index_select` for K and one for V copy its requests' blocks
(whole blocks, padded with the null block) into scratch buffers, then one SDPA call attends
(decode_query_per_head: a query row per head, or the heads that share a KV head stacked as
query rows, whichever the CPU kernel runs faster for the dtype). On the CPU a
group's copies are kept small enough to stay in the core caches until SDPA reads them (see
CPU_DECODE_GROUP_BYTES); on a GPU all decodes go in one group. Prefill chunks run one
request at a time; a chunk with no earlier context attends to its own K/V directly.
The KV cache is zeroed when it is allocated, so padded reads never meet non-finite values.
A layer's sliding window is a mask (built once per step and window, for the layers that
share it); soft-capped scores (Gemma 2) go through plain ops instead of SDPA, which has no
such option.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.kernels.reference import to_cache
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs
from tokenmill.worker.staging import to_device

# Bytes of K plus V one decode group may copy out of the cache on the CPU: by default one
# core's L2 cache (cpu_decode_group_bytes), this when the machine does not say. Copying every
# decode's context at once and then attending reads it from DRAM twice more (write, read
# back); a group this small is still in the caches when SDPA reads it. Measured for SmolLM2
# (24 KiB blocks, 64 decodes of 150-384 tokens, 2 AVX-512 cores): 2 MiB groups take the
# decode attention from 120-140 ms to 90-95 ms per step; 1 request per group is slower than
# either (too few heads to keep both threads busy). On 2 AMX cores with 2 MiB L2 each, one
# L2 beats both L2s together (8 layers cycled from DRAM, per layer): 43 decodes with 8/4
# heads 1.15-1.18 against 1.21-1.26 ms, 64 decodes 1.67 against 1.84-1.90; SmolLM2's 9/3
# heads 1.41-1.53 against 1.52-1.55; 1 MiB groups match 2, 8 MiB take 1.39-1.46.
CPU_DECODE_GROUP_BYTES = 2 << 20
_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def cpu_cache_bytes(level: int, cache_dir: str = _CACHE_DIR) -> int | None:
    """The size of one core's data (or unified) cache at `level`, from sysfs, else from
    sysconf; None where neither says."""
    try:
        for index in sorted(os.listdir(cache_dir)):
            path = os.path.join(cache_dir, index)
            if not index.startswith("index"):
                continue
            with open(os.path.join(path, "level")) as f:
                if int(f.read()) != level:
                    continue
            with open(os.path.join(path, "type")) as f:
                if f.read().strip() not in ("Data", "Unified"):
                    continue
            with open(os.path.join(path, "size")) as f:
                size = f.read().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        pass
    name = {1: "SC_LEVEL1_DCACHE_SIZE", 2: "SC_LEVEL2_CACHE_SIZE", 3: "SC_LEVEL3_CACHE_SIZE"}
    try:
        value = os.sysconf(name[level])
        return value if value > 0 else None
    except (KeyError, ValueError, OSError):
        return None


def cpu_decode_group_bytes() -> int:
    """One core's L2 (see CPU_DECODE_GROUP_BYTES), CPU_DECODE_GROUP_BYTES where its size is
    unknown."""
    l2 = cpu_cache_bytes(2)
    return CPU_DECODE_GROUP_BYTES if l2 is None else l2


@dataclass
class DecodeGroup:
    start: int  # first decode (= token) of the group in the flattened batch
    size: int
    num_blocks: int  # blocks per request in this group (its longest context, rounded up)
    # [size * num_blocks] the pages (see TorchAttentionBackend.forward) of the group's blocks'
    # keys and values, block table rows back to back.
    key_pages: torch.Tensor
    value_pages: torch.Tensor
    mask: torch.Tensor  # [size, 1, 1, num_blocks * block_size]: 0 attended, -inf padding
    seq_lens: torch.Tensor  # [size] the requests' context lengths
    # Masks that also hide keys outside a sliding window, by window (made when first used).
    window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None, block_size: int) -> torch.Tensor:
        if window is None:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            pos = torch.arange(self.num_blocks * block_size, device=self.mask.device)
            early = pos[None, :] <= self.seq_lens[:, None] - 1 - window
            mask = self.mask.masked_fill(early[:, None, None, :], float("-inf"))
            self.window_masks[window] = mask
        return mask


@dataclass
class PrefillSpan:
    start: int  # first token in the flattened batch
    end: int
    seq_len: int  # context length after this chunk
    key_pages: torch.Tensor | None  # the request's blocks' key pages; None: no earlier context


@dataclass
class TorchAttentionMetadata:
    write_k_idx: torch.Tensor  # [T] rows of the flat cache view that take the new keys
    write_v_idx: torch.Tensor
    decode_groups: list[DecodeGroup]
    max_group_blocks: int  # the most blocks one decode group copies
    prefills: list[PrefillSpan]
    block_size: int


class TorchAttentionBackend(AttentionBackend):
    name = "TORCH_SDPA"

    def __init__(self, decode_group_bytes: int | None = CPU_DECODE_GROUP_BYTES) -> None:
        """decode_group_bytes: K+V bytes one decode group may copy (None: one group; the
        CPU model runner passes cpu_decode_group_bytes())."""
        self.decode_group_bytes = decode_group_bytes
        # The most blocks one decode group may copy (None: no limit); set_block_bytes sets it.
        self.decode_group_blocks: int | None = None
        self._scratch: torch.Tensor | None = None  # reused copies of a group's K/V blocks

    def set_block_bytes(self, block_bytes: int) -> None:
        """The KV cache's page size (K+V of one block in one layer), which sizes the decode
        groups."""
        if self.decode_group_bytes is not None:
            self.decode_group_blocks = max(1, self.decode_group_bytes // block_bytes)

    def build_metadata(self, inputs: StepAttentionInputs) -> TorchAttentionMetadata:
        bs, device = inputs.block_size, inputs.device
        slots = inputs.slot_mapping.astype(np.int64)
        # A layer's cache viewed as [num_blocks * 2 * block_size, kv_heads, d]: the keys of
        # block b start at row 2*b*block_size, its values block_size rows later.
        write_k = (slots // bs) * (2 * bs) + slots % bs

        nd = inputs.num_decodes
        ctx_blocks = cdiv(inputs.seq_lens[:nd], bs)
        limit = self.decode_group_blocks
        spans = []  # per decode group: (first, size, width)
        first = 0
        while first < nd:
            # Grow the group while its padded copy fits the limit (at least one request).
            size, width = 1, int(ctx_blocks[first])
            while first + size < nd:
                wider = max(width, int(ctx_blocks[first + size]))
                if limit is not None and (size + 1) * wider > limit:
                    break
                size, width = size + 1, wider
            spans.append((first, size, width))
            first += size
        layout = prefill_layout(inputs)
        prefill_blocks = [(i, ids) for i, (_, _, _, ids) in enumerate(layout) if ids is not None]

        # What the device needs, in one copy: the cache rows to write, the decodes' lengths
        # (their masks are built there) and every group's and prefill's key pages.
        parts = [write_k, inputs.seq_lens[:nd]]
        parts += [2 * inputs.block_table[f : f + n, :w].reshape(-1) for f, n, w in spans]
        parts += [2 * ids for _, ids in prefill_blocks]
        packed = to_device(np.concatenate(parts).astype(np.int64), device)
        pieces = iter(torch.split(packed, [len(x) for x in parts]))
        write_k_t, seq_lens_t = next(pieces), next(pieces)

        groups = []
        for f, n, w in spans:
            # Additive float mask built once per step (SDPA would convert a boolean one in
            # every layer).
            padding = torch.arange(w * bs, device=device)[None, :] >= seq_lens_t[f : f + n, None]
            mask = torch.zeros(padding.shape, dtype=inputs.dtype, device=device)
            mask.masked_fill_(padding, float("-inf"))
            key_pages = next(pieces)
            groups.append(
                DecodeGroup(
                    f, n, w, key_pages, key_pages + 1, mask[:, None, None, :], seq_lens_t[f : f + n]
                )
            )
        max_group_blocks = max((g.size * g.num_blocks for g in groups), default=0)

        with_context = {i: next(pieces) for i, _ in prefill_blocks}
        prefills = [
            PrefillSpan(start, end, seq_len, with_context.get(i))
            for i, (start, end, seq_len, _) in enumerate(layout)
        ]
        return TorchAttentionMetadata(
            write_k_t, write_k_t + bs, groups, max_group_blocks, prefills, bs
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_kv_heads, head_size = key.shape[-2], key.shape[-1]
        # The memory-profiling run comes before the cache exists: it has no context to read.
        if kv_cache.numel():
            flat = kv_cache.view(-1, num_kv_heads, head_size)
            _bytes(flat).index_copy_(0, metadata.write_k_idx, _bytes(to_cache(key, flat.dtype)))
            _bytes(flat).index_copy_(0, metadata.write_v_idx, _bytes(to_cache(value, flat.dtype)))
            # The cache as pages of [bs, kvh, d]: block b's keys are page 2b, its values 2b + 1.
            # Copies select pages of this contiguous view (10-25% faster than blocks of the
            # strided K or V halves).
            pages = kv_cache.view(-1, *kv_cache.shape[2:])
        out = torch.empty_like(query)
        group_size = query.shape[1] // num_kv_heads
        one_row = softcap is None and decode_query_per_head(query.dtype, group_size)
        if metadata.decode_groups:
            k_scratch, v_scratch = self._scratch_blocks(kv_cache, metadata.max_group_blocks)
        for group in metadata.decode_groups:
            g, first, n = group.size, group.start, group.size * group.num_blocks
            # [n, bs, kvh, d] copies of the group's contexts, viewed as [g, kvh, len, d].
            k, v = k_scratch[:n], v_scratch[:n]
            torch.index_select(_bytes(pages), 0, group.key_pages, out=_bytes(k))
            torch.index_select(_bytes(pages), 0, group.value_pages, out=_bytes(v))
            k = k.view(g, -1, num_kv_heads, head_size).transpose(1, 2).to(query.dtype)
            v = v.view(g, -1, num_kv_heads, head_size).transpose(1, 2).to(query.dtype)
            # One query token per request (see decode_query_per_head): each head a row of its
            # own, or the heads sharing a KV head as query rows.
            q = query[first : first + g]
            q = q.unsqueeze(2) if one_row else q.view(g, num_kv_heads, group_size, head_size)
            mask = group.mask_for(window, metadata.block_size)
            o = _attend(q, k, v, scale, softcap, mask)
            out[first : first + g] = o.reshape(g, -1, head_size)
        if metadata.prefills:
            attend_prefills(query, key, value, kv_cache, metadata.prefills, out, scale, window,
                            softcap)  # fmt: skip
        return out

    def _scratch_blocks(
        self, kv_cache: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for num_blocks K blocks and as many V blocks. With bounded groups it is kept
        between layers and steps (and grows to the largest group seen); with one unbounded
        group it lives for the step only."""
        shape = (2, num_blocks, *kv_cache.shape[2:])
        if self.decode_group_blocks is None:
            buf = kv_cache.new_empty(shape)
            return buf[0], buf[1]
        buf = self._scratch
        if (
            buf is None
            or buf.shape[1] < num_blocks
            or buf.shape[2:] != shape[2:]
            or buf.dtype != kv_cache.dtype
            or buf.device != kv_cache.device
        ):
            buf = self._scratch = kv_cache.new_empty(shape)
        return buf[0], buf[1]


def prefill_layout(
    inputs: StepAttentionInputs,
) -> list[tuple[int, int, int, np.ndarray | None]]:
    """Per request still prefilling: (first token, end, context length after the chunk, its
    block ids where it has earlier context, else None)."""
    layout = []
    start = inputs.num_decodes
    for r in range(inputs.num_decodes, len(inputs.query_lens)):
        q_len, seq_len = int(inputs.query_lens[r]), int(inputs.seq_lens[r])
        blocks = None
        if seq_len > q_len:
            blocks = inputs.block_table[r, : cdiv(seq_len, inputs.block_size)]
        layout.append((start, start + q_len, seq_len, blocks))
        start += q_len
    return layout


def attend_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    prefills: list[PrefillSpan],
    out: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Each prefill chunk's attention, one SDPA call per request: causal over its own new
    tokens where it has no earlier context, else over its cached blocks (the new K/V already
    written there)."""
    num_kv_heads, head_size = key.shape[-2], key.shape[-1]
    pages = (
        kv_cache.view(-1, kv_cache.shape[2], num_kv_heads, head_size) if kv_cache.numel() else None
    )
    for span in prefills:
        n = span.end - span.start
        q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        s = span.seq_len
        if span.key_pages is None:
            k, v = key[span.start : span.end], value[span.start : span.end]
            if pages is not None and pages.dtype != key.dtype:  # as the cache holds them
                k, v = to_cache(k, pages.dtype), to_cache(v, pages.dtype)
        else:
            assert pages is not None
            raw = _bytes(pages)
            k = raw.index_select(0, span.key_pages).view(pages.dtype).flatten(0, 1)[:s]
            v = raw.index_select(0, span.key_pages + 1).view(pages.dtype).flatten(0, 1)[:s]
        k, v = k.to(query.dtype), v.to(query.dtype)  # (an fp8 cache's values, widened)
        mask = None  # causal over its own tokens
        if span.key_pages is not None or (window is not None and window < n):
            q_pos = torch.arange(s - n, s, device=q.device)[:, None]
            k_pos = torch.arange(s, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = _attend(q, k, v, scale, softcap, mask, causal=mask is None)
        out[span.start : span.end] = o[0].transpose(0, 1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's bytes (torch's CPU copies take no fp8 elements); others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def decode_query_per_head(dtype: torch.dtype, group_size: int) -> bool:
    """How a decode's query heads meet torch's CPU flash-attention kernel: True, as one query
    row per head ([B, heads, 1, d], grouped-query attention in the kernel); False, as the
    group_size heads that share a KV head stacked into query rows ([B, kv_heads, group, d]).

    The kernel's cost goes by its (request, head) tasks: a task with one query row costs about
    a third of one with several (bf16, 2 AMX cores, d=64, contexts of 64-400 tokens: 1 us
    against 3 us). In bf16, one row per head is the faster form while a KV head serves at most
    two query heads: 14 requests of 240 tokens with 8 query and 4 KV heads took 110 against
    160 us; with three per KV head the two forms are within 10% of each other, and with seven
    one row per head is twice as slow. In fp16 and fp32 stacked rows are faster at any group
    size (fp32, two per KV head: 150 against 220 us). Both forms compute the same sums."""
    return dtype == torch.bfloat16 and group_size <= 2


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    mask: torch.Tensor | None,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, Hq, n, d], k/v [B, Hkv, s, d] -> [B, Hq, n, d]. mask: additive (float) or which
    keys each query sees (bool); causal: over the last n of s positions. SDPA, or with
    soft-capping the same in plain ops, in fp32."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        # enable_gqa stays on the fused CPU kernel (bitwise equal to repeating the KV heads,
        # without the copies).
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if causal:
        n, s = scores.shape[-2:]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else (
            scores + mask.float()
        )  # fmt: skip
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
