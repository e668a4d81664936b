"""Frontend pieces: incremental detokenization against a full decode, engine-argument
validation, and resolution of the default model's names."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tokenmill import LLM
from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.protocol.config import EngineArgs
from tokenmill.protocol.cpu_features import native_bf16
from tokenmill.protocol.default_model import resolve_model

TEXTS = [
    "Hello world! Ünïcödé ☃ and emoji 🦙🚀 in one line.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "日本語のテキストと中文混合",
    "def f(x):\n    return x ** 2  # squares",
]


@pytest.mark.slow
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_detokenizer_equals_full_decode(smollm2_path: str, skip_special: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    rng = random.Random(0)
    prompt = tokenizer.encode("Say something:")
    for text in TEXTS:
        ids = tokenizer.encode(text) + [2] + tokenizer.encode(" after")
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special)
        pieces = []
        i = 0
        while i < len(ids):  # feed in uneven chunks, as steps would
            n = rng.randint(1, 3)
            pieces.append(detok.update(ids[i : i + n]))
            i += n
        full = tokenizer.decode(ids, skip_special_tokens=skip_special)
        assert "".join(pieces) == detok.output_text == full


@pytest.mark.slow
def test_a_character_cut_off_by_the_end_is_emitted_at_finish(smollm2_path: str) -> None:
    """Tokens that end inside a multi-token character (max_tokens reached there) decode, in
    full, to text ending in the replacement character; the request's text must equal that
    full decode, not stop short of it."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer.encode("Emoji: 🦙🚀")
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "no prefix of the text ends inside a character: the case is not exercised"
    for n in cuts:
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
        held = detok.update(ids[:n])
        assert not held.endswith("\ufffd")  # while the request runs, the character waits
        assert held + detok.finish() == detok.output_text == tokenizer.decode(ids[:n])
        assert detok.finish() == ""  # nothing is emitted twice


@pytest.mark.slow
def test_default_model_aliases_resolve_to_one_folder(smollm2_path: str) -> None:
    from pathlib import Path

    from tokenmill.protocol.default_model import default_gguf_file

    # The names give the HF folder; no model at all, the shipped Q4_1 file as it is stored.
    for name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == smollm2_path
    native = Path(resolve_model(None))
    assert (native / "model.gguf").resolve() == default_gguf_file().resolve()
    assert (native / "config.json").is_file() and not (native / "model.safetensors").exists()


def test_unknown_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model("meta-llama/Llama-3-8B")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1, got 0"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        (dict(dtype="int8"), "dtype must be"),
        (dict(device="tpu"), "device must be"),
        (dict(load_format="pt"), "load_format must be"),
        (dict(max_model_len=10**6), "max_model_len must be <="),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "max_num_batched_tokens"),
        (dict(tensor_parallel_size=2), "a divisor of the model's 9 attention heads"),
        (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of .* got 'fp8_e5m2'"),
    ],
)
def test_engine_args_name_the_bad_field(smollm2_path: str, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineArgs(model=smollm2_path, **kwargs).create_engine_config()


def test_kv_heads_that_do_not_split_are_refused_before_any_worker_starts(tmp_path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="a divisor or a multiple of the model's 3 KV heads"):
        args.create_engine_config()
    # Fewer KV heads than ranks: each rank gets a copy of one.
    EngineArgs(model=str(tmp_path), tensor_parallel_size=6).create_engine_config()


def test_llm_rejects_unknown_arguments() -> None:
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(no_such_arg=1)


@pytest.mark.slow
def test_engine_config_defaults(smollm2_path: str) -> None:
    config = EngineArgs(model=smollm2_path, device="cpu").create_engine_config()
    # The CPU's default: bf16 where it multiplies bf16 natively, as vLLM's CPU backend
    assert config.model_config.dtype == ("bfloat16" if native_bf16() else "float32")
    assert config.model_config.max_model_len == 8192
    assert config.model_config.eos_token_ids == (2,)
    assert config.model_config.num_kv_heads == 3 and config.model_config.head_size == 64
    # The architecture, parsed once from config.json, is what the model is built from.
    assert config.model_config.intermediate_size == 1536
    assert config.model_config.tie_word_embeddings
    assert config.model_config.rope_parameters == {"rope_theta": 100000.0, "rope_type": "default"}


def test_legacy_rope_settings_are_read_into_rope_parameters() -> None:
    folder = Path(__file__).parents[2] / "scripts" / "configs" / "qwen2.5-0.5b"
    config = EngineArgs(model=str(folder), device="cpu").create_engine_config()
    model = config.model_config
    assert model.rope_parameters == {"rope_theta": 1000000.0, "rope_type": "default"}
    assert model.architecture == "Qwen2ForCausalLM" and model.num_kv_heads == 2
    assert config.scheduler_config.enable_chunked_prefill


def test_delta_streams_hold_back_what_a_stop_string_may_cut() -> None:
    """Stop "END" arrives one character per token: no delta ever shows a piece of it, and
    the deltas add up to the final text."""
    from tokenmill.frontend.output_processor import OutputProcessor
    from tokenmill.protocol.messages import (
        EngineCoreOutput,
        EngineCoreRequest,
        RequestOutputKind,
        SamplingParams,
    )

    class OneCharTokenizer:
        chars = {1: "b", 2: "c", 3: "E", 4: "N", 5: "D", 6: "z"}

        def decode(self, ids, **kwargs) -> str:
            return "".join(self.chars.get(i, "") for i in ids)

    processor = OutputProcessor(OneCharTokenizer())
    params = SamplingParams(stop=["END"], output_kind=RequestOutputKind.DELTA, max_tokens=20)
    processor.add_request(EngineCoreRequest("r", [6], params, [0], 0.0), None)
    deltas, finished = [], False
    for token in [1, 2, 3, 4, 5, 6]:
        outputs, _ = processor.process_outputs([EngineCoreOutput("r", [token])])
        for out in outputs:
            deltas.append(out.outputs[0].text)
            finished = out.finished
        if finished:
            break
    assert finished and "".join(deltas) == "bc"
    assert all("E" not in d and "N" not in d for d in deltas), deltas
