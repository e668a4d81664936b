"""Tensor parallelism on the CPU (gloo): greedy tokens at TP > 1 equal TP = 1, through an
in-process client, a spawned core and an engine-core daemon; and each rank holds only its
share of the weights and KV heads. Engines are shared between tests where they can be."""

from __future__ import annotations

import pytest
from helpers import running_daemon, smollm2_prompts

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
# Ragged lengths, one over the chunk budget below: chunked prefill, decodes and prefills mixed.
TOKEN_PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(n)]}
    for i, n in enumerate((1, 5, 9, 17, 40, 64, 130, 200))
]


def tiny_llm(path, tp: int, **engine_args) -> LLM:
    return LLM(
        str(path),
        multiprocess=False,  # the executor lives in this process, so tests can reach it
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        dtype="float32",  # TP=1 and TP=2 sum in other orders: bf16 ties would differ
        # Resolved by the core after KV sizing: the workers must get the settled value.
        max_model_len=-1,
        kv_cache_memory_bytes=32 << 20,
        max_num_batched_tokens=128,
        block_size=8,
        **engine_args,
    )


@pytest.fixture(scope="module", params=["llama-gqa", "qwen3"])
def tiny_pair(request, tiny_model):
    """(name, TP=1 outputs, a running TP=2 engine). llama-gqa splits its 2 KV heads; qwen3
    has 1 KV head for 2 ranks, so both ranks hold a copy."""
    path = tiny_model(request.param)
    reference = tiny_llm(path, 1)
    try:
        expected = [o.outputs[0].token_ids for o in reference.generate(TOKEN_PROMPTS, GREEDY)]
    finally:
        reference.shutdown()
    llm = tiny_llm(path, 2)
    yield request.param, expected, llm
    llm.shutdown()


def test_tp2_greedy_equals_tp1(tiny_pair) -> None:
    _, expected, llm = tiny_pair
    outputs = llm.generate(TOKEN_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(len(tokens) == 16 for tokens in expected)


# Per-rank shapes at TP=2, worked out by hand from the tiny configs (tests/conftest.py:
# hidden 64, 4 query heads, intermediate 128, vocabulary 512, 2 layers).
EXPECTED_TP2 = {
    # 2 of 4 query heads and 1 of 2 KV heads, each of 16 dims: (2 + 2 * 1) * 16 rows.
    "llama-gqa": {
        "qkv_proj.weight": [64, 64],
        "o_proj.weight": [64, 32],
        "kv_cache_heads": 1,
        "head_size": 16,
    },
    # head_dim 32; the single KV head is replicated: (2 + 2 * 1) * 32 rows.
    "qwen3": {
        "qkv_proj.weight": [128, 64],
        "o_proj.weight": [64, 64],
        "kv_cache_heads": 1,
        "head_size": 32,
    },
}


def test_each_rank_holds_its_share(tiny_pair) -> None:
    name, _, llm = tiny_pair
    executor = llm.llm_engine.client.engine_core.executor
    ranks = executor.collective_rpc("describe_shards")
    assert len(ranks) == 2
    want = EXPECTED_TP2[name]
    for shapes in ranks:
        layer = "model.layers.0."
        assert shapes[layer + "self_attn.qkv_proj.weight"] == want["qkv_proj.weight"]
        assert shapes[layer + "self_attn.o_proj.weight"] == want["o_proj.weight"]
        assert shapes[layer + "mlp.gate_up_proj.weight"] == [128, 64]  # 2 * 128 / 2 rows
        assert shapes[layer + "mlp.down_proj.weight"] == [64, 64]  # 128 / 2 columns
        assert shapes["model.embed_tokens.weight"] == [256, 64]  # half the vocabulary
        assert shapes["lm_head.weight"] == [256, 64]
        # Norms are replicated, whole on every rank.
        assert shapes[layer + "input_layernorm.weight"] == [64]
        assert shapes["model.norm.weight"] == [64]
        # [blocks, K/V, block_size, kv heads on this rank, head size]
        kv = shapes["kv_cache"]
        assert kv[1:] == [2, 8, want["kv_cache_heads"], want["head_size"]]
    # The CPU's KV budget is per host: the two ranks split it (and hold equal block counts).
    assert ranks[0]["kv_cache"][0] == ranks[1]["kv_cache"][0]
    per_rank_block = 2 * 8 * want["kv_cache_heads"] * want["head_size"] * 4 * 2  # 2 layers
    assert ranks[0]["kv_cache"][0] == (32 << 20) // 2 // per_rank_block


def test_collective_rpc_futures_single_replies_and_errors(tiny_pair) -> None:
    _, expected, llm = tiny_pair
    executor = llm.llm_engine.client.engine_core.executor
    future = executor.collective_rpc("describe_shards", non_block=True)
    ranks = future.result(timeout=30)
    assert len(ranks) == 2 and all("kv_cache" in shapes for shapes in ranks)
    # One rank's answer, itself rather than a list.
    assert executor.collective_rpc("describe_shards", unique_reply_rank=1) == ranks[1]
    with pytest.raises(RuntimeError, match=r"worker rank [01] failed in initialize_kv_cache: "):
        executor.collective_rpc("initialize_kv_cache", args=("not a config", 1))
    # A ValueError (an argument the worker refuses) comes back as one, with its message, as
    # a call in the core's own process would raise it.
    with pytest.raises(ValueError, match=r"^LoRA is not enabled \(start the engine"):
        executor.collective_rpc("remove_lora", args=(1,))
    # A call that failed alike on every rank leaves them in step: the engine still serves.
    outputs = llm.generate(TOKEN_PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:2]


def test_a_refusal_is_a_value_error_only_when_every_answer_refused() -> None:
    """Ranks that disagree (one refuses, another fails otherwise or succeeds) are out of
    step, the workers' fault: a RuntimeError naming the first rank, not the caller's
    ValueError."""
    from concurrent.futures import Future

    from tokenmill.core.executor.multiproc import _Call

    def call(refused: str | None, other_failure: bool, results: dict) -> BaseException:
        c = _Call("add_lora", Future(), set(), False, results, "worker rank 0 failed in "
                  "add_lora: ValueError: no", 0.0, refused, other_failure)  # fmt: skip
        return c.exception()

    assert type(call("no", False, {})) is ValueError and str(call("no", False, {})) == "no"
    assert type(call("no", True, {})) is RuntimeError
    assert type(call("no", False, {1: True})) is RuntimeError
    assert "worker rank 0 failed in add_lora" in str(call(None, True, {}))


def test_a_rank_that_fails_to_start_is_named_with_its_error(tiny_model, tmp_path) -> None:
    # A config without weights: every rank builds its shard of the model, then fails to load.
    (tmp_path / "config.json").write_text((tiny_model("llama-gqa") / "config.json").read_text())
    with pytest.raises(RuntimeError, match=r"worker rank [01] failed to start: FileNotFoundError"):
        tiny_llm(tmp_path, 2)


# ------------------------------------------------------------------------ SmolLM2 at TP=3
@pytest.fixture(scope="module")
def smollm2_expected(smollm2_llm: LLM) -> tuple[list, list[list[int]]]:
    """The parity prompts (as token ids), and SmolLM2's greedy answers to them at TP=1."""
    ids = smollm2_prompts(smollm2_llm.get_tokenizer())
    prompts = [{"prompt_token_ids": p} for p in ids]
    outputs = smollm2_llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_smollm2_tp3_spawned_core_equals_tp1(smollm2_path: str, smollm2_expected) -> None:
    prompts, expected = smollm2_expected
    # 9 query heads and 3 KV heads: 3 and 1 per rank.
    llm = LLM(smollm2_path, tensor_parallel_size=3, max_model_len=1024, dtype="float32",
              kv_cache_memory_bytes=256 << 20)  # fmt: skip
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.slow
def test_smollm2_tp3_daemon_equals_tp1(smollm2_path: str, smollm2_expected) -> None:
    prompts, expected = smollm2_expected
    extra = ("--tensor-parallel-size", "3", "--max-model-len", "1024")
    with running_daemon(smollm2_path, *extra, kv_cache_bytes=256 << 20) as (_, address):
        llm = LLM(engine_address=address)
        try:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert llm.get_stats()["max_model_len"] == 1024
        finally:
            llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_tp2_triton_backend_equals_tp1(tiny_pair, tiny_model) -> None:
    """The Triton backend and layers (Triton's interpreter on the CPU) at TP=2, on each rank's
    share of the heads, give the TP=1 torch engine's tokens."""
    from helpers import require_triton

    require_triton()
    name, expected, _ = tiny_pair
    llm = tiny_llm(
        tiny_model(name), 2, attention_backend="TRITON_ATTN", device="cpu", enforce_eager=True
    )
    try:
        prompts = TOKEN_PROMPTS[:4]  # few and short: the interpreter is slow
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected[:4]
    finally:
        llm.shutdown()
