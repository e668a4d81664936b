"""Rotary position embedding (rotate-half / NeoX style, as HF Llama applies it).

cos/sin tables for every position up to max_position are computed once, in fp32, exactly
as HF computes them, so that results match HF bit for bit. The model prepares the step's
rotation once (`prepare`: the torch path looks up cos/sin for the step's positions) and every
layer applies it (`StepRotation.apply`; the Triton path rotates in place from the tables).
Supports rope_type "default", "linear", "llama3" and "longrope" (Phi-3's "su" scaling).

LongRoPE has two frequency sets, short and long, both scaled by one attention factor; the
table holds the short set's rows for positions 0..max-1, then the long set's (`offset` rows
later). HF switches a whole forward to the long set once its sequence passes
`original_max_position_embeddings`; `LongRope.table_rows` reproduces that per token (a token
takes the long rows when its position, or its request's prompt, passes the threshold), so that
chunked prefills and batching change nothing. The model runner asks it for every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.worker.layers.custom_op import CustomOp


def _inv_freq(head_size: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(
    head_size: int, max_position: int, params: dict[str, Any]
) -> tuple[list[torch.Tensor], float, int]:
    """([short inv_freq, long inv_freq], attention factor, original max positions), as HF
    computes them."""
    base = float(params.get("rope_theta", 10000.0))
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    sets = [
        1.0 / (torch.tensor(params[name], dtype=torch.float32) * base**exponents)
        for name in ("short_factor", "long_factor")
    ]
    return sets, float(attention), original


@dataclass(frozen=True)
class LongRope:
    threshold: int  # the original context (original_max_position_embeddings)
    offset: int  # where the long rows start in the table

    def table_rows(self, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """The table's row for each token at `positions` of a request with `prompt_lens`."""
        long = (positions >= self.threshold) | (prompt_lens > self.threshold)
        return positions + self.offset * long


class RotaryEmbedding(CustomOp):
    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        rope_type = params.get("rope_type", "default")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError(
                f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']} is "
                "not supported (only whole heads rotate)"
            )
        self.long_rope: LongRope | None = None  # (see above)
        scale = 1.0
        inv_freq = _inv_freq(head_size, float(params.get("rope_theta", 10000.0)))
        freq_sets = [inv_freq]
        if rope_type == "linear":
            freq_sets = [inv_freq / params["factor"]]
        elif rope_type == "llama3":
            freq_sets = [_llama3_inv_freq(inv_freq, params)]
        elif rope_type in ("longrope", "su"):
            freq_sets, scale, threshold = _longrope(head_size, max_position, params)
            self.long_rope = LongRope(threshold, offset=max_position)
        elif rope_type != "default":
            raise NotImplementedError(
                f"rope_type={rope_type!r} is not supported (default, linear, llama3, longrope are)"
            )
        positions = torch.arange(max_position, dtype=torch.float32)
        emb = torch.cat(
            [torch.cat((f, f), dim=-1) for f in (torch.outer(positions, s) for s in freq_sets)]
        )
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotation:
        """The step's rotation, for every layer to apply to its queries and keys."""
        if self.use_triton:
            return TritonRotation(positions, self.cos, self.sin)
        if self.kind == "cpu":
            return CpuRotation(positions, self.cos, self.sin)
        return TorchRotation(*self.cos_sin(positions, dtype))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotation, each [T, 1, d] to broadcast over heads: cos, and sin with
        its first half negated (see apply_rotary)."""
        half = self.cos.shape[-1] // 2
        sin = self.sin[positions]
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return self.cos[positions].unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates x: [T, heads, d] (queries and keys may come stacked as one tensor).

    HF computes x * cos + cat(-x2, x1) * sin. Rolling x by half gives cat(x2, x1), and the
    sign moves onto sin's first half: the same products, bit for bit, in fewer ops."""
    cos, signed_sin = cos_sin
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class StepRotation:
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotates x: [T, heads, d]; the result may be x itself, rotated in place."""
        raise NotImplementedError


class TorchRotation(StepRotation):
    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self.cos_sin = (cos, signed_sin)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos_sin)


class CpuRotation(StepRotation):
    """tokenmill's CPU kernel: one pass, in place, in the torch path's arithmetic."""

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.positions, self.cos, self.sin = positions, cos, sin

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            x = x.contiguous()
        from tokenmill.kernels.cpu.layers import rotary_embedding_

        return rotary_embedding_(x, self.positions, self.cos, self.sin)


class TritonRotation(StepRotation):
    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.positions, self.cos, self.sin = positions, cos, sin

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.layers import rotary_embedding_

        rotary_embedding_(x, self.positions, self.cos, self.sin)
        return x
