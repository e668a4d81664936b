"""KV sizing through a real engine on a small random model: auto-fitted max_model_len, the
clear error when memory is short, and the stats the engine reports."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

# The tiny models: 2 layers, 2 KV heads of 16 dims (hidden 64 / 4 heads), fp32.
BYTES_PER_BLOCK = 2 * (2 * 16 * 2 * 16 * 4)  # layers * (K and V * block * heads * dim * 4 B)


def test_max_model_len_auto_fits_the_cache(tiny_model) -> None:
    blocks = 40
    llm = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        dtype="float32",  # the 4-byte elements BYTES_PER_BLOCK counts
        max_model_len=-1,
        kv_cache_memory_bytes=blocks * BYTES_PER_BLOCK,
    )
    try:
        stats = llm.get_stats()
        assert stats["num_blocks"] == blocks
        assert stats["max_model_len"] == (blocks - 1) * 16  # the null block holds nothing
        # The fitted limit is what the frontend enforces.
        with pytest.raises(ValueError, match="max_model_len=624"):
            llm.generate({"prompt_token_ids": [5] * 625}, use_tqdm=False)
        out = llm.generate(
            {"prompt_token_ids": [5] * 600},
            SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
            use_tqdm=False,
        )
        # Generation stops at the fitted max_model_len.
        assert len(out[0].outputs[0].token_ids) == 24
        assert out[0].outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_too_little_kv_memory_is_a_clear_error(tiny_model, multiprocess: bool) -> None:
    # In-process the ValueError itself; from a spawned core, its message.
    error = RuntimeError if multiprocess else ValueError
    with pytest.raises(error, match=r"needs \d+ bytes .* only 5000 bytes .* available"):
        LLM(
            model=str(tiny_model("llama-gqa")),
            multiprocess=multiprocess,
            skip_tokenizer_init=True,
            max_model_len=512,
            kv_cache_memory_bytes=5000,
        )


def test_stats_count_preemptions_and_prefix_hits(tiny_model, monkeypatch) -> None:
    # The core runs in this process and steps only when asked: "while a request runs" below
    # must not race a spawned core that may finish it between two questions.
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    llm = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        max_model_len=96,
        num_gpu_blocks_override=8,  # 7 usable blocks of 16 tokens
    )
    try:
        shared = list(range(10, 58))  # three full blocks
        prompts = [{"prompt_token_ids": shared + [100 + i, 200 + i]} for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["prefix_cache_hits"] >= 3 * 48
        assert stats["prefix_cache_queries"] >= 4 * 50
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["kv_cache_usage"] == 0.0
        assert llm.reset_prefix_cache()
        out = llm.generate(prompts[0], params, use_tqdm=False)
        assert out[0].num_cached_tokens == 0

        # While a request holds blocks, the reset is refused and nothing is forgotten.
        engine = llm.llm_engine
        engine.add_request("running", prompts[1], params)
        while llm.get_stats()["num_running"] == 0:
            engine.step()
        assert llm.reset_prefix_cache() is False
        while engine.has_unfinished_requests():
            engine.step()
        again = llm.generate(prompts[1], params, use_tqdm=False)
        assert again[0].num_cached_tokens == 48  # its prefix survived the refused reset
        assert llm.reset_prefix_cache() is True
    finally:
        llm.shutdown()


def test_auto_fit_without_chunked_prefill_stays_within_the_token_budget(tiny_model) -> None:
    """A prompt longer than max_num_batched_tokens could never be scheduled without chunked
    prefill: the fitted max_model_len stops at the budget, and such a prompt is refused."""
    llm = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        max_model_len=-1,
        enable_chunked_prefill=False,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=200 * BYTES_PER_BLOCK,  # 3184 tokens of cache
    )
    try:
        assert llm.get_stats()["max_model_len"] == 256
        with pytest.raises(ValueError, match="max_model_len=256"):
            llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": [5] * 250}, params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6  # stops at max_model_len
    finally:
        llm.shutdown()


def test_every_engine_argument_is_a_flag_of_the_daemon() -> None:
    """The daemon's flags come from EngineArgs itself, lists included."""
    import dataclasses

    from tokenmill.core.daemon import build_parser
    from tokenmill.protocol.config import EngineArgs, engine_args_from

    parser = build_parser()
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= flags
    args = parser.parse_args(
        ["--address", "ipc:///tmp/x", "--cudagraph-capture-sizes", "1", "8",
         "--enforce-eager", "true", "--max-model-len", "-1", "--gpu-memory-utilization", "0.5"]
    )  # fmt: skip
    engine = engine_args_from(args)
    assert engine.cudagraph_capture_sizes == [1, 8] and engine.enforce_eager is True
    assert engine.max_model_len == -1 and engine.gpu_memory_utilization == 0.5
    assert engine.attention_backend is None and engine.max_logprobs == 20
