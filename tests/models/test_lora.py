"""LoRA adapters in the engine against HF + peft: a batch mixing the base model and two
adapters (ranks 8 and 16, made with peft here, B drawn large enough to change the output)
gives every request peft's greedy tokens (fp32), at TP=1 and TP=2, with chunked prefill,
prefix hits (the same prompt under each adapter: no block is shared across adapters),
preemption, async scheduling, n-gram speculation and one device slot (max_loras=1: the
scheduler runs one adapter per step, the slot is swapped). Adapters are added before use or
on first use, removed, listed; what cannot run is refused by name, and the request ends with
the error while others go on."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tokenmill import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 12


def make_adapter(base_path: str, folder, rank: int, seed: int, modules=MODULES) -> str:
    """A PEFT LoRA adapter of `rank` on the base model, with random B (peft initialises B to
    zeros, which would change nothing)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.15)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


def peft_greedy(base_path: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


# Lengths that each grow by a block while decoding (preemption), and a periodic prompt whose
# n-grams the proposer finds.
PROMPTS = [[(13 * i + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((9, 23, 40))]
PROMPTS.append([3 + j % 5 for j in range(61)])


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = str(tiny_model("llama-gqa"))
    folder = tmp_path_factory.mktemp("adapters")
    adapters = {
        "r8": LoRARequest("r8", 1, make_adapter(path, folder / "r8", 8, seed=1)),
        "r16": LoRARequest("r16", 2, make_adapter(path, folder / "r16", 16, seed=2)),
    }
    # Every prompt under the base model and each adapter: the same prompt thrice, so that
    # prefix hits would cross adapters if the cache keys did not hold the adapter.
    cases = [(p, lora) for p in PROMPTS for lora in (None, adapters["r8"], adapters["r16"])]
    expected = [
        peft_greedy(path, None if lora is None else lora.lora_path, p, MAX_TOKENS)
        for p, lora in cases
    ]
    # The adapters change every prompt's greedy tokens, and differently.
    for i in range(0, len(cases), 3):
        assert expected[i] != expected[i + 1] and expected[i] != expected[i + 2]
        assert expected[i + 1] != expected[i + 2]
    return path, adapters, cases, expected


def generate(path: str, cases, **engine_args) -> tuple[list[list[int]], dict]:
    engine_args.setdefault("max_loras", 2)
    engine_args.setdefault("max_model_len", 128)
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=16, skip_tokenizer_init=True,
              **engine_args)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False,
            lora_request=[lora for _, lora in cases],
        )  # fmt: skip
        return [o.outputs[0].token_ids for o in outputs], llm.get_stats()
    finally:
        llm.shutdown()


SETTINGS = {
    "default": {},
    "chunked-16": dict(max_num_batched_tokens=16, enable_chunked_prefill=True),
    "preemption": dict(num_gpu_blocks_override=7, max_model_len=96, enable_prefix_caching=False),
    "async": dict(async_scheduling=True),
    "ngram": dict(
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
            "auto_disable": False,
        }
    ),  # fmt: skip
    # The draft (the base model itself) proposes without adapters; the target verifies
    # each row under its own, so greedy tokens stay peft's.
    "draft-model": dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}),
    "one-slot": dict(max_loras=1, max_cpu_loras=1),
    "tp2": dict(tensor_parallel_size=2),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_adapters_match_peft(setup, setting: str) -> None:
    path, _, cases, expected = setup
    kwargs = SETTINGS[setting]
    if setting == "draft-model":
        kwargs = dict(speculative_config={**kwargs["speculative_config"], "model": path})
    actual, stats = generate(path, cases, **kwargs)
    assert actual == expected
    if setting == "preemption":
        assert stats["num_preemptions"] > 0, stats
    if setting in ("ngram", "draft-model"):
        assert stats["spec_decode_num_drafts"] > 0, stats


def test_prefix_hits_stay_within_an_adapter(setup) -> None:
    """Sent twice in turn, the second round hits the cache, each prompt under its own
    adapter's blocks only, and still gives peft's tokens."""
    path, _, cases, expected = setup
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              skip_tokenizer_init=True, max_model_len=128)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p, _ in cases]
        loras = [lora for _, lora in cases]
        for i in range(len(cases)):  # one at a time: later ones may hit earlier ones' blocks
            out = llm.generate(prompts[i], params, use_tqdm=False, lora_request=loras[i])
            assert out[0].outputs[0].token_ids == expected[i]
            assert out[0].num_cached_tokens == 0  # never another adapter's blocks
        again = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert all(o.num_cached_tokens >= 16 for o in again if len(o.prompt_token_ids) > 16)
    finally:
        llm.shutdown()


def test_adapters_added_listed_removed_and_refused(setup, tmp_path) -> None:
    path, adapters, cases, expected = setup
    r8, r16 = adapters["r8"], adapters["r16"]
    big = LoRARequest("r32", 3, make_adapter(path, tmp_path / "r32", 32, seed=3))
    empty = tmp_path / "empty"
    empty.mkdir()
    config = os.path.join(r16.lora_path, "adapter_config.json")
    (empty / "adapter_config.json").write_text(open(config).read())
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              skip_tokenizer_init=True, max_model_len=128)  # fmt: skip
    try:
        assert llm.add_lora(r8) is True
        assert llm.add_lora(r8) is False
        assert llm.list_loras() == {1}
        with pytest.raises(ValueError, match="LoRA rank 32 is greater than max_lora_rank 16"):
            llm.add_lora(big)
        with pytest.raises(ValueError, match="doesn't contain tensors"):
            llm.add_lora(LoRARequest("empty", 4, str(empty)))
        assert llm.list_loras() == {1}
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        # A request naming an adapter that cannot run ends with the error; the others go on.
        i = 1  # PROMPTS[0] under r8
        outputs = llm.generate(
            [{"prompt_token_ids": cases[i][0]}] * 3, params, use_tqdm=False,
            lora_request=[r8, big, r16],
        )  # fmt: skip
        assert outputs[0].outputs[0].token_ids == expected[1]
        assert outputs[2].outputs[0].token_ids == expected[2]
        assert outputs[1].outputs[0].finish_reason == "error" or outputs[1].error
        assert llm.list_loras() == {1, 2}  # r16 was added by its request
        assert llm.remove_lora(1) is True and llm.remove_lora(1) is False
        assert llm.list_loras() == {2}
        # Removed, then named again: read again.
        again = llm.generate({"prompt_token_ids": cases[1][0]}, params, use_tqdm=False,
                             lora_request=r8)  # fmt: skip
        assert again[0].outputs[0].token_ids == expected[1]
    finally:
        llm.shutdown()


def test_removed_while_running_finishes_with_it_then_leaves_the_workers(setup, tmp_path) -> None:
    """An adapter removed (and its folder deleted) while a request runs it: the request ends
    with peft's tokens (no step reads the folder again), the adapter is no longer listed,
    and the workers drop it once the request ends."""
    path, adapters, cases, expected = setup
    folder = shutil.copytree(adapters["r8"].lora_path, tmp_path / "r8")
    r8 = LoRARequest("r8", 1, str(folder))
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_lora_rank=16, skip_tokenizer_init=True, max_model_len=128,
              multiprocess=False)  # fmt: skip
    try:
        engine = llm.llm_engine
        core = engine.client.engine_core
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": cases[1][0]}, params, lora_request=r8)
        produced = engine.step()
        assert engine.has_unfinished_requests()
        assert llm.remove_lora(1) is True and llm.list_loras() == set()
        shutil.rmtree(folder)
        assert _in_workers(core) == [{1}]  # still running it
        # Another adapter's request meanwhile: it waits for the one slot until "a" ends.
        engine.add_request("b", {"prompt_token_ids": cases[2][0]}, params,
                           lora_request=adapters["r16"])  # fmt: skip
        while engine.has_unfinished_requests():
            produced += engine.step()
        final = {o.request_id: o for o in produced if o.finished}
        assert final["a"].outputs[0].token_ids == expected[1]
        assert final["b"].outputs[0].token_ids == expected[2]
        assert _in_workers(core) == [{2}]
        assert llm.list_loras() == {2}
    finally:
        llm.shutdown()


def _in_workers(core) -> list[set[int]]:
    return [set(ids) for ids in core.executor.collective_rpc("list_loras")]


def test_adapter_of_another_model_is_refused_when_added(setup, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    path, adapters, cases, expected = setup
    other = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))  # fmt: skip
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=MODULES, init_lora_weights=False)
    peft.get_peft_model(other, config).save_pretrained(str(tmp_path / "other"))
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=16,
              skip_tokenizer_init=True, max_model_len=128)  # fmt: skip
    try:
        with pytest.raises(ValueError, match=r"do not fit the model's layer.*another base model"):
            llm.add_lora(LoRARequest("other", 5, str(tmp_path / "other")))
        with pytest.raises(ValueError, match="No adapter found for /no/such/folder"):
            llm.add_lora(LoRARequest("gone", 6, "/no/such/folder"))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": cases[1][0]}] * 2, params, use_tqdm=False,
            lora_request=[LoRARequest("other", 5, str(tmp_path / "other")), adapters["r8"]],
        )  # fmt: skip
        assert outputs[0].outputs[0].finish_reason == "error" or outputs[0].error
        assert outputs[1].outputs[0].token_ids == expected[1]
        assert llm.list_loras() == {1}
    finally:
        llm.shutdown()


def test_lora_off_refuses_adapters(setup) -> None:
    path, adapters, cases, _ = setup
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate({"prompt_token_ids": cases[0][0]}, lora_request=adapters["r8"])
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.add_lora(adapters["r8"])
    finally:
        llm.shutdown()


def test_lora_settings_are_checked(tiny_model) -> None:
    """vLLM's LoRA engine arguments: lora_dtype takes 'auto' or the model's own dtype (the
    kernels multiply adapters in it); a bad setting names its field and value."""
    from tokenmill.protocol.config import EngineArgs

    path = str(tiny_model("llama-gqa"))

    def config(**kwargs):
        args = EngineArgs(model=path, dtype="float32", enable_lora=True, **kwargs)
        return args.create_engine_config().lora_config

    assert config(lora_dtype="float32") == config(lora_dtype="auto")
    assert config(lora_dtype="fp32") == config(lora_dtype=torch.float32)  # dtype='s spellings
    assert config(max_loras=3).max_cpu_loras == 3  # vLLM's default: max_loras
    with pytest.raises(ValueError, match=r"lora_dtype='float16' is not supported.*float32"):
        config(lora_dtype="float16")
    with pytest.raises(ValueError, match=r"max_lora_rank \(24\) must be one of"):
        config(max_lora_rank=24)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        config(max_loras=2, max_cpu_loras=1)
    # Without enable_lora the LoRA settings are not read (as vLLM).
    off = EngineArgs(model=path, dtype="float32", lora_dtype="float16", max_lora_rank=24)
    assert off.create_engine_config().lora_config is None


def test_smollm2_async_adapter_with_structured_outputs(smollm2_path: str, tmp_path) -> None:
    """On the real model, through AsyncLLM: an adapter's greedy text is peft's, and a
    structured-output request under the adapter answers one of its choices, beside a base
    request that gives the base model's tokens."""
    import asyncio

    from tokenmill import AsyncLLM
    from tokenmill.protocol.messages import StructuredOutputsParams

    modules = ["q_proj", "v_proj", "down_proj"]
    adapter = LoRARequest("smol", 1, make_adapter(smollm2_path, tmp_path / "smol", 8, 4, modules))
    prompt = [1, 504, 3458, 282, 4649, 314, 253]  # any ids: no tokenizer is needed to compare
    expected = peft_greedy(smollm2_path, adapter.lora_path, prompt, MAX_TOKENS)
    base_expected = peft_greedy(smollm2_path, None, prompt, MAX_TOKENS)
    assert expected != base_expected
    choices = ["red", "green", "blue"]

    async def run() -> tuple[list[int], list[int], str]:
        engine = AsyncLLM(smollm2_path, dtype="float32", enable_lora=True, max_lora_rank=8,
                          max_model_len=256, kv_cache_memory_bytes=64 << 20)  # fmt: skip
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            choose = SamplingParams(
                temperature=0.0, max_tokens=8,
                structured_outputs=StructuredOutputsParams(choice=choices),
            )  # fmt: skip

            async def last(prompt_, params, request_id, lora):
                outs = [o async for o in engine.generate(prompt_, params, request_id,
                                                         lora_request=lora)]  # fmt: skip
                return outs[-1].outputs[0]

            tokens = {"prompt_token_ids": prompt}
            a, b, c = await asyncio.gather(
                last(tokens, greedy, "adapter", adapter),
                last(tokens, greedy, "base", None),
                last("The colour of the sky is", choose, "choice", adapter),
            )
            return list(a.token_ids), list(b.token_ids), c.text
        finally:
            engine.shutdown()

    adapted, base, chosen = asyncio.run(run())
    assert adapted == expected
    assert base == base_expected
    assert chosen in choices


def test_triton_layers_match_peft(setup, monkeypatch) -> None:
    """The Triton backend (its interpreter on the CPU, compiled on a GPU): the adapters run
    through the Triton shrink and expand kernels (launch counters: a torch fallback cannot
    pass) and give peft's tokens."""
    from helpers import require_triton

    require_triton()
    from tokenmill.kernels.launches import LAUNCHES

    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")  # in this process, to read the counters
    path, _, cases, expected = setup
    LAUNCHES.clear()
    chosen = [0, 1, 2, 7, 8]  # the first prompt under base, r8 and r16; the third under r8, r16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    actual, _ = generate(path, [cases[i] for i in chosen], attention_backend="TRITON_ATTN",
                         device=device, enforce_eager=True)  # fmt: skip
    assert actual == [expected[i] for i in chosen]
    assert LAUNCHES["lora_shrink"] > 0 and LAUNCHES["lora_expand"] > 0, dict(LAUNCHES)
