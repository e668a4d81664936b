"""Tensor-parallel weight loading from safetensors: each rank's loaders read only their shard
of a checkpoint tensor (never the whole of a sharded one), and what they load is exactly the
slice of the full tensor that arithmetic by hand says belongs to that rank."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill.worker import parallel_state
from tokenmill.worker.layers.embedding import VocabParallelEmbedding
from tokenmill.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.worker.model_loader import CheckpointTensor

HIDDEN, HEAD, HEADS = 8, 2, 4


class RecordingTensor(CheckpointTensor):
    """Remembers how many elements each read of it took."""

    def __init__(self, file, name: str, reads: list) -> None:
        super().__init__(file, name)
        self.name, self.reads = name, reads

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        out = super().narrow(dim, start, length)
        self.reads.append((self.name, out.numel()))
        return out

    def load(self) -> torch.Tensor:
        out = super().load()
        self.reads.append((self.name, out.numel()))
        return out


@pytest.fixture
def checkpoint(tmp_path):
    generator = torch.Generator().manual_seed(0)
    full = {
        "q": torch.randn(HEADS * HEAD, HIDDEN, generator=generator),
        "k": torch.randn(2 * HEAD, HIDDEN, generator=generator),  # 2 KV heads
        "k1": torch.randn(1 * HEAD, HIDDEN, generator=generator),  # 1 KV head
        "gate": torch.randn(6, HIDDEN, generator=generator),
        "up": torch.randn(6, HIDDEN, generator=generator),
        "down": torch.randn(HIDDEN, 6, generator=generator),
        "down_bias": torch.randn(HIDDEN, generator=generator),
        "embed": torch.randn(11, HIDDEN, generator=generator),  # 11 rows: the last rank pads
    }
    path = tmp_path / "model.safetensors"
    save_file(full, str(path))
    with safe_open(str(path), framework="pt") as f:
        yield full, lambda name, reads: RecordingTensor(f, name, reads)


@pytest.fixture
def tp_rank(monkeypatch):
    def set_rank(rank: int, size: int = 2) -> None:
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        monkeypatch.setattr(parallel_state, "_TP_SIZE", size)

    return set_rank


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_and_holds_only_its_shard(checkpoint, tp_rank, rank: int) -> None:
    full, open_tensor = checkpoint
    tp_rank(rank)
    reads: list[tuple[str, int]] = []

    qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, 2, bias=False)
    for shard in ("q", "k"):
        qkv.weight.weight_loader(qkv.weight, open_tensor(shard, reads), shard)
    q_rows = slice(rank * 4, rank * 4 + 4)  # 2 of 4 heads x 2 dims
    assert torch.equal(qkv.weight[:4], full["q"][q_rows])
    assert torch.equal(qkv.weight[4:6], full["k"][rank * 2 : rank * 2 + 2])  # 1 of 2 KV heads

    merged = MergedColumnParallelLinear(HIDDEN, [6, 6])
    for i, shard in enumerate(("gate", "up")):
        merged.weight.weight_loader(merged.weight, open_tensor(shard, reads), i)
    rows = slice(rank * 3, rank * 3 + 3)
    assert torch.equal(merged.weight, torch.cat([full["gate"][rows], full["up"][rows]]))

    down = RowParallelLinear(6, HIDDEN, bias=True)
    down.weight.weight_loader(down.weight, open_tensor("down", reads))
    assert torch.equal(down.weight, full["down"][:, rank * 3 : rank * 3 + 3])
    # Every sharded tensor was read once, half of it.
    assert reads == [(name, full[name].numel() // 2) for name in ("q", "k", "gate", "up", "down")]
    # The row-parallel bias, added once after the all-reduce, is read whole.
    down.bias.weight_loader(down.bias, open_tensor("down_bias", reads))
    assert reads[-1] == ("down_bias", HIDDEN) and torch.equal(down.bias, full["down_bias"])

    embed = VocabParallelEmbedding(11, HIDDEN)
    reads.clear()
    embed.weight.weight_loader(embed.weight, open_tensor("embed", reads))
    assert embed.weight.shape == (6, HIDDEN)  # ceil(11 / 2) rows per rank
    own = full["embed"][rank * 6 : rank * 6 + 6]
    assert torch.equal(embed.weight[: len(own)], own) and reads == [("embed", own.numel())]
    assert not embed.weight[len(own) :].any()  # padding rows stay zero


def test_fewer_kv_heads_than_ranks_are_replicated(checkpoint, tp_rank) -> None:
    full, open_tensor = checkpoint
    for rank in (0, 1):
        tp_rank(rank)
        qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, 1, bias=False)
        assert qkv.num_kv_heads == 1 and qkv.kv_replicas == 2
        qkv.weight.weight_loader(qkv.weight, open_tensor("k1", []), "k")
        assert torch.equal(qkv.weight[4:6], full["k1"])  # both ranks hold the one KV head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matmul_weights_packed_for_onednn_compute_the_same(dtype: torch.dtype) -> None:
    """Packed weights replace the plain ones (same shape) and give x @ W.T + b, checked in
    float64; the LM head that shares the embedding's weight gets its own packed copy."""
    from tokenmill.worker.layers.embedding import ParallelLMHead
    from tokenmill.worker.layers.linear import ColumnParallelLinear, matmul, pack_cpu_weights

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    g = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        column = ColumnParallelLinear(96, 160, bias=True)
        row = RowParallelLinear(160, 96)
        embedding = VocabParallelEmbedding(300, 96)
        head = ParallelLMHead(300, 96)
    head.weight = embedding.weight  # tied
    for param in (column.weight, column.bias, row.weight, embedding.weight):
        param.data = torch.randn(param.shape, generator=g).to(dtype)
    plain = {name: m.weight.detach().double() for name, m in
             (("column", column), ("row", row), ("head", head))}  # fmt: skip
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed, widened = pack_cpu_weights([column, row, head])
    assert packed == 3
    # Without a bf16 GEMM on this CPU, bf16 weights are widened to fp32 (and multiplied so).
    assert widened == (3 if dtype == torch.bfloat16 and not bf16_native else 0)
    assert column.weight.is_mkldnn and row.weight.is_mkldnn and head.weight.is_mkldnn
    assert not embedding.weight.is_mkldnn  # the embedding still looks rows up
    assert column.weight.shape == (160, 96) and head.weight.shape == (300, 96)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 rounds the output to 8 bits
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        y = column(x)
        want = x.double() @ plain["column"].T + column.bias.double()
        assert y.shape == (rows, 160)
        assert y.dtype == dtype and (y.double() - want).abs().max() < tol * want.abs().max()
        h = torch.randn(rows, 160, generator=g).to(dtype)
        want = h.double() @ plain["row"].T
        assert (row(h).double() - want).abs().max() < tol * want.abs().max()
        want = x.double() @ plain["head"].T
        assert (head(x).double() - want).abs().max() < tol * want.abs().max()
        if widened:  # as torch's own bf16 GEMM (fp32 accumulation): within one bf16 step
            ref = torch.nn.functional.linear(x, plain["column"].to(dtype), column.bias.to(dtype))
            step = ref.double().abs().clamp(min=1e-3) * 2**-7
            assert ((y.double() - ref.double()).abs() <= step).all()
    # A plain weight still runs through F.linear.
    w = torch.randn(5, 96, generator=g)
    assert torch.allclose(matmul(torch.ones(2, 96), w), torch.ones(2, 96) @ w.T, atol=1e-5)
