"""torchrun launches: `torch.distributed.run --nproc-per-node 2 scripts/torchrun_generate.py`
on a tiny random model whose heads divide by 2. Each rank runs its own engine (external
launcher); both must print the same outputs, equal to TP=1 in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams

SCRIPT = Path(__file__).parents[2] / "scripts" / "torchrun_generate.py"


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "async"])
def test_torchrun_ranks_agree_with_tp1(tiny_model, tmp_path, overlap: bool) -> None:
    path = tiny_model("llama-gqa")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--model", str(path), "--skip-tokenizer-init", "--max-tokens", "16",
        "--kv-cache-memory-bytes", str(32 << 20), "--output-dir", str(tmp_path),
        "--dtype", "float32",  # compared with TP=1, whose sums run in another order
        *(["--async-scheduling"] if overlap else []),
    ]  # fmt: skip
    # torchrun stops every rank when one fails; the timeout stops torchrun itself.
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert (first["rank"], second["rank"]) == (0, 1)
    assert first["prompts"] == second["prompts"] and len(first["prompts"]) == 8
    assert first["outputs"] == second["outputs"]

    llm = LLM(str(path), multiprocess=False, skip_tokenizer_init=True, dtype="float32",
              kv_cache_memory_bytes=32 << 20, max_model_len=1024)  # fmt: skip
    try:
        prompts = [{"prompt_token_ids": p} for p in first["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=16)
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert first["outputs"] == expected
