"""The benchmark's check of a peer's GGUF file: its tensor count read from the header, as
gguf-py's reader counts them (a conversion that wrote only the tokenizer holds none)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_throughput import gguf_tensor_count  # noqa: E402


@pytest.mark.parametrize("tensors", [0, 3])
def test_tensor_count_matches_gguf_py(tmp_path: Path, tensors: int) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for i in range(tensors):
        writer.add_tensor(f"t{i}", np.full((4, 8), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_tensor_count(path) == len(gguf.GGUFReader(str(path)).tensors) == tensors


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_tensor_count(path)
