"""Pooling models (embeddings) against HF transformers, fp32 on the CPU: a random Qwen3 causal
LM run with runner="pooling" (convert="embed": the final norm's hidden states pooled). Its
vectors match HF's `AutoModel` last_hidden_state pooled the same way, for text and token
prompts, a batch of mixed lengths, prompts chunked across steps, prefix-cache hits (LAST),
MEAN and CLS pooling, unnormalized and Matryoshka-cut outputs; the sentence-transformers files
of a Qwen3-Embedding-style folder choose the pooling; bad requests fail alone."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill import (
    LLM,
    AsyncLLM,
    EmbeddingRequestOutput,
    EngineArgs,
    PoolingParams,
    PoolingRequestOutput,
    SamplingParams,
)
from tokenmill.protocol.config import PoolerConfig
from tokenmill.protocol.messages import EngineCoreRequest, check_request
from tokenmill.worker.pooler import Pooler

VOCAB = 512
MATRYOSHKA = [16, 32, 64]
BLOCK = 8
BUDGET = 32  # max_num_batched_tokens: the longer prompts run in several chunks
COSINE = 0.999


def _words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the model's vocabulary ("w3" is token 3), so that text
    prompts reach tokenmill and HF alike."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def embedder(tiny_model, tmp_path_factory) -> Path:
    """Qwen3-Embedding's layout in miniature: a Qwen3ForCausalLM checkpoint, modules.json
    with a last-token Pooling module and a Normalize module, Matryoshka sizes, a tokenizer."""
    folder = tmp_path_factory.mktemp("embedder")
    shutil.copytree(tiny_model("qwen3"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA
    (folder / "config.json").write_text(json.dumps(config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}  # fmt: skip
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    _write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def hf_states(embedder):
    """Each prompt's last_hidden_state from HF's AutoModel (the base model: no LM head)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(embedder), dtype=torch.float32).eval()

    def states(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return states


def reference(states: torch.Tensor, kind: str, normalize: bool = True, dims=None):
    pooled = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind]
    pooled = pooled[:dims] if dims else pooled
    return F.normalize(pooled, dim=-1) if normalize else pooled


def assert_close(got, want: torch.Tensor, values: bool = False) -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == want.shape
    assert F.cosine_similarity(got, want, dim=0).item() >= COSINE
    if values:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, block_size=BLOCK,
               max_num_batched_tokens=BUDGET, **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def last_llm(embedder):
    """runner="auto": the sentence-transformers files make it a LAST, normalized embedder.
    A spawned engine core: the vectors cross the process boundary."""
    llm = engine(embedder)
    yield llm
    llm.shutdown()


# ------------------------------------------------------------------------ parameters
def test_pooling_params_cross_the_wire() -> None:
    params = PoolingParams(dimensions=32, normalize=False, truncate_prompt_tokens=7)
    request = EngineCoreRequest("r", [5, 6, 7], None, [2], 0.0, pooling_params=params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.pooling_params == params and decoded.sampling_params is None
    assert check_request(request) == request
    with pytest.raises(ValueError, match="exactly one"):
        check_request(EngineCoreRequest("r", [5], None, [2], 0.0))
    with pytest.raises(ValueError, match="exactly one"):
        check_request(EngineCoreRequest("r", [5], SamplingParams(), [2], 0.0,
                                        pooling_params=params))  # fmt: skip
    with pytest.raises(ValueError, match="greater than 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="task"):
        PoolingParams(task="classify")


def test_engine_args_resolve_the_runner(embedder, tiny_model) -> None:
    config = EngineArgs(model=str(embedder)).create_engine_config()
    model = config.model_config
    assert (model.runner_type, model.convert_type) == ("pooling", "embed")
    assert model.pooler_config == PoolerConfig("LAST", True, None)
    assert model.is_matryoshka and model.matryoshka_dimensions == MATRYOSHKA
    assert config.cache_config.enable_prefix_caching and config.device_config.enforce_eager
    # The explicit pooler config wins over the folder's files.
    mean = EngineArgs(model=str(embedder), pooler_config={"pooling_type": "mean",
                      "normalize": False}).create_engine_config()  # fmt: skip
    assert mean.model_config.pooler_config == PoolerConfig("MEAN", False, None)
    assert not mean.cache_config.enable_prefix_caching  # (MEAN needs every token's state)
    plain = tiny_model("qwen3")
    assert EngineArgs(model=str(plain)).create_engine_config().model_config.runner_type == (
        "generate"
    )
    with pytest.raises(ValueError, match="ALL and STEP"):
        EngineArgs(model=str(plain), runner="pooling",
                   pooler_config={"pooling_type": "ALL"}).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="convert"):
        EngineArgs(model=str(plain), runner="generate", convert="embed").create_engine_config()
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(model=str(plain), runner="pooling",
                   speculative_config={"method": "ngram"}).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="does not support matryoshka"):
        EngineArgs(model=str(plain), runner="pooling",
                   pooler_config={"dimensions": 16}).create_engine_config()  # fmt: skip


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooler_across_chunks_matches_torch(kind: str) -> None:
    """Three requests in three steps of mixed chunks (one ends in step 1, one spans all
    three), against pooling each whole prompt at once."""
    g = torch.Generator().manual_seed(1)
    lengths = {"a": 5, "b": 23, "c": 11}
    states = {r: torch.randn(n, 8, generator=g) for r, n in lengths.items()}
    chunks = [  # per step: (request, start, length)
        [("a", 0, 5), ("b", 0, 9), ("c", 0, 4)],
        [("b", 9, 6), ("c", 4, 7)],
        [("b", 15, 8)],
    ]
    params = {"a": PoolingParams(normalize=False), "b": PoolingParams(dimensions=4),
              "c": PoolingParams()}  # fmt: skip
    pooler = Pooler(PoolerConfig(kind, True, None))
    got: dict[str, np.ndarray] = {}
    for step in chunks:
        hidden = torch.cat([states[r][s : s + n] for r, s, n in step])
        cu = np.concatenate(([0], np.cumsum([n for _, _, n in step])))
        finals = np.array([s + n == lengths[r] for r, s, n in step])
        got |= pooler.pool(hidden, [r for r, _, _ in step], np.array([s for _, s, _ in step]),
                           cu, finals, params)  # fmt: skip
    assert set(got) == set(lengths) and not pooler.partial
    for r in lengths:
        want = reference(states[r], kind, params[r].normalize is not False, params[r].dimensions)
        torch.testing.assert_close(torch.from_numpy(got[r]), want)


# ------------------------------------------------------------------------- the engine
def test_text_and_token_prompts_match_hf(last_llm, hf_states) -> None:
    """Strings and token ids, one batch of lengths 1 to 77 (the longest in three chunks of
    the 32-token budget), in input order."""
    ids = prompts_of([9, 1, 77, 33, 16, 40])
    prompts = [_words(p) if i in (0, 3) else {"prompt_token_ids": p} for i, p in enumerate(ids)]
    outputs = last_llm.embed(prompts, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    for prompt, out in zip(ids, outputs):
        assert out.prompt_token_ids == prompt and out.outputs.hidden_size == 64
        assert_close(out.outputs.embedding, reference(hf_states(prompt), "LAST"), values=True)
    one = last_llm.embed(_words(ids[0]), use_tqdm=False)
    assert len(one) == 1 and one[0].outputs.embedding == pytest.approx(
        outputs[0].outputs.embedding, abs=1e-5
    )


def test_prefix_cache_hits_save_compute_and_keep_vectors(last_llm, hf_states) -> None:
    """The same prompts twice: the second time their full blocks come from the cache (a
    prompt that is all cached blocks still computes its last token)."""
    ids = prompts_of([24, 57, 8], seed=3)  # (24 and 8: whole blocks)
    prompts = [{"prompt_token_ids": p} for p in ids]
    first = last_llm.encode(prompts, use_tqdm=False)
    again = last_llm.encode(prompts, use_tqdm=False)
    assert all(isinstance(o, PoolingRequestOutput) for o in again)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0]
    assert [o.num_cached_tokens for o in again] == [16, 56, 0]
    for prompt, a, b in zip(ids, first, again):
        want = reference(hf_states(prompt), "LAST")
        assert_close(a.outputs.data, want, values=True)
        assert_close(b.outputs.data, want, values=True)


def test_normalize_false_and_matryoshka_dimensions(last_llm, hf_states) -> None:
    ids = prompts_of([30, 12], seed=4)
    prompts = [{"prompt_token_ids": p} for p in ids]
    raw = last_llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    cut = last_llm.embed(prompts, [PoolingParams(dimensions=16),
                                   PoolingParams(dimensions=32, normalize=False)],
                         use_tqdm=False)  # fmt: skip
    for prompt, r, c, (dims, norm) in zip(ids, raw, cut, [(16, True), (32, False)]):
        states = hf_states(prompt)
        assert_close(r.outputs.embedding, reference(states, "LAST", normalize=False), values=True)
        assert c.outputs.hidden_size == dims
        assert_close(c.outputs.embedding, reference(states, "LAST", norm, dims), values=True)
    with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\] matryoshka dimensions"):
        last_llm.embed(prompts, PoolingParams(dimensions=8), use_tqdm=False)
    truncated = last_llm.embed({"prompt_token_ids": ids[0]}, truncate_prompt_tokens=10,
                               use_tqdm=False)[0]  # fmt: skip
    assert truncated.prompt_token_ids == ids[0][-10:]  # (the last ones, as vLLM keeps)
    assert_close(truncated.outputs.embedding, reference(hf_states(ids[0][-10:]), "LAST"))


def test_generate_on_a_pooling_model_raises(last_llm) -> None:
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative"):
        last_llm.generate("w5 w6", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="only supported for generative"):
        last_llm.chat([{"role": "user", "content": "w5"}])


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_through_chunks(embedder, hf_states, monkeypatch, kind) -> None:
    """Prefix caching is off for them (a cached block's hidden states are not kept): the
    same prompts twice hit nothing, and pool the same."""
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    llm = engine(embedder, skip_tokenizer_init=True, pooler_config={"pooling_type": kind})
    try:
        ids = prompts_of([70, 3, 41, 32], seed=5)
        prompts = [{"prompt_token_ids": p} for p in ids]
        params = [PoolingParams(), PoolingParams(normalize=False), PoolingParams(dimensions=32),
                  PoolingParams()]  # fmt: skip
        for _ in range(2):
            outputs = llm.embed(prompts, params, use_tqdm=False)
            assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0]
            for prompt, p, out in zip(ids, params, outputs):
                want = reference(hf_states(prompt), kind, p.normalize is not False, p.dimensions)
                assert_close(out.outputs.embedding, want, values=True)
    finally:
        llm.shutdown()


def test_embed_on_a_generative_model_raises(tiny_model, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    llm = engine(tiny_model("qwen3"), skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match=r"LLM.embed\(\) is only supported for pooling"):
            llm.embed({"prompt_token_ids": [5, 6]})
        # The request itself is refused by the core too (a client that builds its own).
        engine_ = llm.llm_engine
        request = EngineCoreRequest("x", [5, 6], None, [2], 0.0, pooling_params=PoolingParams())
        engine_.submit([(request, None)])
        outputs = []
        while engine_.has_unfinished_requests():
            outputs += engine_.step()
        assert outputs[0].error and "generative model" in outputs[0].error
    finally:
        llm.shutdown()


def test_async_encode_bad_requests_fail_alone(embedder, hf_states) -> None:
    """AsyncLLM.encode with prompts, with a request made by process_inputs, and beside a
    request whose dimensions the model refuses (a ValueError before it is sent)."""
    ids = prompts_of([20, 45], seed=6)

    async def run() -> list:
        engine_ = AsyncLLM(str(embedder), dtype="float32", kv_cache_memory_bytes=16 << 20,
                           block_size=BLOCK, max_num_batched_tokens=BUDGET)  # fmt: skip
        try:
            assert engine_.model_config.runner_type == "pooling"

            async def one(prompt, params=None, request_id=None) -> PoolingRequestOutput:
                outs = [o async for o in engine_.encode(prompt, params, request_id)]
                assert len(outs) == 1 and outs[0].finished
                return outs[0]

            async def refused() -> None:
                with pytest.raises(ValueError, match="does not support|only supports"):
                    await one({"prompt_token_ids": ids[0]}, PoolingParams(dimensions=3))

            request, _ = await engine_.process_inputs("pre", _words(ids[1]), PoolingParams())
            results = await asyncio.gather(
                one({"prompt_token_ids": ids[0]}, request_id="a"), refused(), one(request)
            )
            with pytest.raises(ValueError, match="only supported for generative"):
                async for _ in engine_.generate("w5", SamplingParams(), "g"):
                    pass
            return [results[0], results[2]]
        finally:
            engine_.shutdown()

    first, second = asyncio.run(run())
    assert (first.request_id, second.request_id) == ("a", "pre")
    assert_close(first.outputs.data, reference(hf_states(ids[0]), "LAST"), values=True)
    assert_close(second.outputs.data, reference(hf_states(ids[1]), "LAST"), values=True)
