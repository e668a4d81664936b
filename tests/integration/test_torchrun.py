"""torchrun launches: `torch.distributed.run --nproc-per-node 2 scripts/torchrun_generate.py`
on a tiny random model whose heads divide by 2, and the same as two "nodes" of one process
each (`--nnodes 2`, rendezvousing on loopback). Each rank runs its own engine (external
launcher); both must print the same outputs, equal to TP=1 in this process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port_pair

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
    assert_ranks_agree_with_tp1(path, tmp_path)


def test_two_node_torchrun_on_loopback_agrees_with_tp1(tiny_model, tmp_path) -> None:
    """`torchrun --nnodes 2 --node-rank R --master-addr A --master-port P --nproc-per-node 1`
    twice, as two "nodes" rendezvousing on a loopback address: each node's one process is
    one TP rank of the engine."""
    path = tiny_model("llama-gqa")
    port = free_port_pair()
    nodes = []
    try:
        for node_rank in (0, 1):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--nproc-per-node", "1",
                str(SCRIPT), "--model", str(path), "--skip-tokenizer-init",
                "--max-tokens", "16", "--kv-cache-memory-bytes", str(32 << 20),
                "--output-dir", str(tmp_path), "--dtype", "float32",
            ]  # fmt: skip
            quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            nodes.append(subprocess.Popen(command, start_new_session=True, **quiet))
        for node in nodes:
            _, err = node.communicate(timeout=240)
            assert node.returncode == 0, err.decode(errors="replace")[-3000:]
    finally:
        for node in nodes:  # torchrun and the rank it started, whatever happened
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(10)
    assert_ranks_agree_with_tp1(path, tmp_path)


def assert_ranks_agree_with_tp1(path, output_dir) -> None:
    """Both ranks wrote the same outputs (rank-R.json), equal to TP=1 in this process."""
    first, second = (json.loads((output_dir / f"rank-{r}.json").read_text()) for r in (0, 1))
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
