"""A GGUF model run as the file holds it (quantization="gguf"): the default model from its
Q4_1 file (Q8_0 embeddings and tied LM head) against the engine on the same weights
de-quantized to fp32 (the default model's converted folder)."""

from __future__ import annotations

import math
import os

import pytest
from helpers import smollm2_prompts
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.default_model import default_gguf_file

MAX_TOKENS = 24
# Where the two engines' greedy tokens part, the reference's top two must lie this close (in
# log-probability): fp32 sums in another order (the kernels multiply the blocks' integers and
# scale each block's sum; the reference multiplies the de-quantized values) move logits by
# ~1e-5 here, so only a near-tie may flip.
NEAR_TIE = 1e-3
# Log-probabilities of the tokens both chose: the same arithmetic up to the order of fp32 sums
# over 576-1536 terms, through 30 layers.
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def gguf_llm():
    llm = LLM(str(default_gguf_file()), max_model_len=1024, kv_cache_memory_bytes=256 << 20,
              dtype="float32")  # fmt: skip
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_default_model_from_its_q4_1_file_matches_the_dequantized_engine(
    smollm2_path: str, smollm2_llm: LLM, gguf_llm: LLM
) -> None:
    assert gguf_llm.llm_engine.config.model_config.quantization == "gguf"
    prompts = smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    # All prompts in one batch (decode steps of 8 rows: the de-quantize-then-multiply path,
    # in fp32 the reference's own arithmetic) and three (decodes of up to 4 rows: the
    # kernels' dot products on the blocks' integers).
    for batch in (prompts, prompts[:3]):
        _compare(gguf_llm, smollm2_llm, batch, params)


def _compare(gguf_llm: LLM, ref_llm: LLM, prompts: list[list[int]], params) -> None:
    requests = [{"prompt_token_ids": p} for p in prompts]
    ours = gguf_llm.generate(requests, params, use_tqdm=False)
    ref = ref_llm.generate(requests, params, use_tqdm=False)
    near_ties = compared = 0
    for a, b in zip(ours, ref):
        tokens, ref_tokens = a.outputs[0].token_ids, b.outputs[0].token_ids
        for i, (t, r) in enumerate(zip(tokens, ref_tokens)):
            ref_top = b.outputs[0].logprobs[i]
            if t != r:
                assert t in ref_top, (i, t, r)
                gap = ref_top[r].logprob - ref_top[t].logprob
                assert gap < NEAR_TIE, f"parted at {i} without a near-tie ({gap})"
                near_ties += 1
                break
            lp, ref_lp = a.outputs[0].logprobs[i][t].logprob, ref_top[r].logprob
            assert math.isclose(lp, ref_lp, abs_tol=LOGPROB_TOLERANCE), (i, lp, ref_lp)
            compared += 1
    assert near_ties <= 1 and compared >= len(prompts) * MAX_TOKENS // 2, (near_ties, compared)


def test_quantization_is_checked_by_name(tiny_model) -> None:
    path = str(tiny_model("llama-gqa"))
    with pytest.raises(ValueError, match="quantization.*GGUF model"):
        LLM(path, quantization="gguf", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization must be one of.*got 'fp4'"):
        LLM(path, quantization="fp4", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization must be gguf \\(or unset\\) for a GGUF"):
        LLM(str(default_gguf_file()), quantization="int8", skip_tokenizer_init=True)


@pytest.mark.slow
def test_without_the_cpu_kernels_gguf_weights_are_dequantized(
    monkeypatch, smollm2_llm: LLM
) -> None:
    """TOKENMILL_CPU_KERNELS=0: the file's blocks are de-quantized at load and the torch path
    runs them: the converted model's tokens, log-probabilities within the tolerance above (the
    reference runs on the kernels: fp32 sums in another order)."""
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    llm = LLM(str(default_gguf_file()), max_model_len=512, kv_cache_memory_bytes=64 << 20,
              dtype="float32", multiprocess=True)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        ours = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    ref = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for t, got, want in zip(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                b.outputs[0].logprobs):  # fmt: skip
            assert math.isclose(got[t].logprob, want[t].logprob, abs_tol=LOGPROB_TOLERANCE)


@pytest.mark.slow
def test_worker_memory_holds_the_file_not_a_copy() -> None:
    """The worker's memory with the Q4_1 default model: its tensors, and what loading it
    added to the worker process's resident set, at most 1.5x the file (its de-quantized fp32
    copy was 5.5x), with the KV cache on top as its own budget (get_stats' model_memory)."""
    from tokenmill.kernels import cpu
    from tokenmill.protocol import envs

    if not envs.TOKENMILL_CPU_KERNELS or not cpu.load(envs.TOKENMILL_CACHE):
        pytest.skip("without the CPU kernels GGUF weights are de-quantized at load")
    file_bytes = os.path.getsize(default_gguf_file())
    llm = LLM(str(default_gguf_file()), max_model_len=512, kv_cache_memory_bytes=64 << 20,
              skip_tokenizer_init=True, multiprocess=True)  # fmt: skip
    try:
        memory = llm.get_stats()["model_memory"]
    finally:
        llm.shutdown()
    print(f"model memory: {memory}; file {file_bytes}")
    assert memory["weights_bytes"] <= 1.5 * file_bytes, (memory, file_bytes)
    assert memory["load_bytes"] <= 1.5 * file_bytes, (memory, file_bytes)


def test_the_tensor_table_reads_the_file_as_gguf_py_does(tmp_path) -> None:
    """The table written beside a GGUF model (its scalar metadata and tensors' places) gives
    the tensors gguf-py's reader gives, without parsing the tokenizer's arrays at each load."""
    import numpy as np

    from tokenmill.worker.layers.quantization.gguf import read_gguf, write_tensor_table

    link = tmp_path / "model.gguf"
    link.symlink_to(default_gguf_file())
    fields_by_gguf_py, tensors_by_gguf_py = read_gguf(link)  # no table yet
    write_tensor_table(default_gguf_file(), tmp_path)
    fields, tensors = read_gguf(link)
    assert fields == fields_by_gguf_py and fields["general.architecture"] == "llama"
    assert len(tensors) == len(tensors_by_gguf_py) == 272
    for ours, theirs in zip(tensors, tensors_by_gguf_py, strict=True):
        assert (ours.name, ours.tensor_type, ours.shape) == (
            theirs.name, theirs.tensor_type, theirs.shape,
        )  # fmt: skip
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data), ours.name
