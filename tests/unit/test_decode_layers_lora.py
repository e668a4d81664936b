"""A decode step's layers as one call (worker/models/cpu_decode.py, csrc/decode_layers.cpp) with
LoRA slots on every projection: the same hidden states and residuals, bit for bit, as the
layers run one by one (LinearBase._matmul + LoRALayer.apply on the CPU kernels), in bf16 and
fp32, with and without biases, on every instruction set level this CPU runs. A small random
Llama built here; its rows run no adapter or one of three slots, one of them a rank-8 adapter
in slots of rank 16."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.punica import LoRAMapping
from tokenmill.protocol.config import ModelConfig
from tokenmill.worker.attention.cpu_backend import CpuAttentionBackend, CpuAttentionMetadata
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.layers.custom_op import layer_kernels
from tokenmill.worker.layers.linear import LinearBase, pack_cpu_weights
from tokenmill.worker.lora.adapter import LoRALayerWeights
from tokenmill.worker.lora.layers import LoRALayer
from tokenmill.worker.models.cpu_decode import DecodeLoop
from tokenmill.worker.models.llama import LlamaForCausalLM, LlamaModel

HIDDEN, INTER, HEADS, KV_HEADS, HEAD = 64, 128, 4, 2, 16
LAYERS, BLOCK, WIDTH = 2, 16, 4  # WIDTH: blocks a request
MAX_ROWS = 64
BLOCKS = MAX_ROWS * WIDTH
SLOTS, RANK = 4, 16  # slot 3 stays empty
SLOT_RANKS = (8, 16, 16)  # slot 0's adapter has rank 8, padded with zeros in the slots
SCALES = (2.0, 0.5, 1.0, 0.0)


def _model(dtype: torch.dtype, bias: bool, seed: int) -> LlamaModel:
    """Random weights packed for the CPU kernels, a random KV cache, LoRA slots on q/k/v, o,
    gate/up and down, slots 0-2 filled."""
    config = ModelConfig(
        model="random", tokenizer="random", dtype=str(dtype).removeprefix("torch."), seed=seed,
        max_model_len=BLOCKS * BLOCK, architecture="LlamaForCausalLM", vocab_size=32,
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD,
        max_position_embeddings=BLOCKS * BLOCK, eos_token_ids=(0,), attention_bias=bias,
        mlp_bias=bias,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with layer_kernels("cpu"):
            model = LlamaModel(config, CpuAttentionBackend(), bias, False,
                               LlamaForCausalLM.make_mlp)  # fmt: skip
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if "norm" in name else param.shape[-1] ** -0.5
            fill = torch.randn(param.shape, generator=g) * scale
            param.copy_(fill + 1.0 if "norm" in name else fill)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    packed, _ = pack_cpu_weights(linears, own_kernels=True)
    assert packed == len(linears)
    for layer in model.layers:
        shape = (BLOCKS, 2, BLOCK, KV_HEADS, HEAD)
        layer.self_attn.attn.kv_cache = torch.randn(shape, generator=g).to(dtype)
    scales = torch.tensor(SCALES)
    for linear in linears:
        linear.lora = LoRALayer(linear, SLOTS, RANK, scales, dtype, torch.device("cpu"), "cpu")
        for slot, rank in enumerate(SLOT_RANKS):
            k = linear.lora.in_features
            linear.lora.set_slot(slot, {
                slice_id: LoRALayerWeights(torch.randn(rank, k, generator=g) * k**-0.5,
                                           torch.randn(rows, rank, generator=g) * 0.2)
                for slice_id, _, rows in linear.lora.slices
            })  # fmt: skip
    return model


def _decode_step(rows: int, seed: int) -> tuple[torch.Tensor, CpuAttentionMetadata]:
    """Positions and attention metadata of a decode-only step: request b's context of 1-64
    tokens in blocks of its own."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, WIDTH * BLOCK + 1, (rows,), generator=g)
    table = torch.arange(rows * WIDTH).view(rows, WIDTH)
    positions = lens - 1
    slots = table.gather(1, (positions // BLOCK).view(-1, 1)).view(-1) * BLOCK + positions % BLOCK
    empty = torch.zeros(0, WIDTH, dtype=torch.int64)
    metadata = CpuAttentionMetadata(slots, table, lens, empty, torch.zeros(1, dtype=torch.int64),
                                    torch.zeros(0, dtype=torch.int64), None)  # fmt: skip
    return positions, metadata


def _row_slots(rows: int, seed: int) -> torch.Tensor:
    """Rows of no adapter (-1) and of slots 0-2, each present where there are rows enough."""
    slots = torch.randint(-1, 3, (rows,), generator=torch.Generator().manual_seed(seed))
    if rows >= 4:
        slots[:4] = torch.tensor([2, -1, 0, 1])
    return slots


def _layered(model: LlamaModel, x, positions, metadata, mapping):
    x = x.clone()  # (the first layer's residual is x, which its second norm adds into)
    with set_forward_context(metadata, mapping):
        rope = model.rotary_emb.prepare(positions, x.dtype)
        residual = None
        for layer in model.layers:
            x, residual = layer(rope, x, residual)
    return x, residual


def _looped(model: LlamaModel, x, positions, metadata, mapping):
    loop = DecodeLoop()
    with set_forward_context(metadata, mapping):
        done = loop.run(model.layers, x, model.rotary_emb.prepare(positions, x.dtype))
    assert done is not None, "the decode loop did not take the step"
    assert loop._plan is not None and loop._plan.lora_scales is not None
    return done


@pytest.mark.parametrize("rows", [1, 13, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_layers_with_lora_equal_the_layers_bit_for_bit(isa, dtype, bias, rows) -> None:
    if dtype == torch.bfloat16 and isa < 1:
        pytest.skip("without AVX-512 bf16 weights are widened to fp32, which the call refuses")
    model = _model(dtype, bias, seed=rows)
    positions, metadata = _decode_step(rows, seed=rows)
    row_slots = _row_slots(rows, seed=rows)
    mapping = LoRAMapping.of(row_slots, SLOTS)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)

    hidden, residual = _looped(model, x, positions, metadata, mapping)
    want_hidden, want_residual = _layered(model, x, positions, metadata, mapping)
    assert torch.equal(hidden, want_hidden) and torch.equal(residual, want_residual)

    # Without a mapping the adapters are not read: the step as without LoRA, the rows of no
    # adapter the same as with one, the others different.
    plain, plain_residual = _looped(model, x, positions, metadata, None)
    want_plain, want_plain_residual = _layered(model, x, positions, metadata, None)
    assert torch.equal(plain, want_plain) and torch.equal(plain_residual, want_plain_residual)
    none = row_slots < 0
    assert torch.equal(hidden[none], plain[none])
    assert not (hidden[~none] == plain[~none]).all(dim=1).any()


def test_decode_layers_refuse_a_mapping_of_other_rows(kernels) -> None:
    model = _model(torch.float32, False, seed=0)
    positions, metadata = _decode_step(5, seed=0)
    x = torch.randn(5, HIDDEN)
    with pytest.raises(RuntimeError, match="sorted_rows"):
        _looped(model, x, positions, metadata, LoRAMapping.of(_row_slots(6, seed=0), SLOTS))
