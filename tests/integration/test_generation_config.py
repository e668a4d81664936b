"""--generation-config (vLLM's): "auto" takes sampling defaults from the model's
generation_config.json where a request leaves them out, "vllm" ignores the file, a folder
supplies its own. Checked on a random-weight model against explicit SamplingParams."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.config import sampling_defaults

PROMPTS = [{"prompt_token_ids": [3, 4, 5, 6]}, {"prompt_token_ids": [9, 8]}]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("with-defaults")
    shutil.copytree(tiny_model("llama-gqa"), folder, dirs_exist_ok=True)
    config = {"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5, "top_k": 7}
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_sampling_defaults_read_vllms_fields(model_with_defaults, tmp_path) -> None:
    assert sampling_defaults("auto", str(model_with_defaults)) == {
        "temperature": 0.0, "max_tokens": 5, "top_k": 7,
    }  # fmt: skip
    assert sampling_defaults("vllm", str(model_with_defaults)) == {}
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.5}')
    assert sampling_defaults(str(tmp_path), str(model_with_defaults)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(str(tmp_path / "missing"), str(model_with_defaults))


@pytest.mark.parametrize("generation_config", ["auto", "vllm"])
def test_llm_applies_the_models_defaults(model_with_defaults, generation_config) -> None:
    llm = LLM(str(model_with_defaults), multiprocess=False, skip_tokenizer_init=True,
              kv_cache_memory_bytes=32 << 20, generation_config=generation_config,
              dtype="float32")  # fmt: skip
    try:
        defaults = llm.get_default_sampling_params()
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, use_tqdm=False)]
        if generation_config == "auto":
            assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 5, 7)
            explicit = SamplingParams(temperature=0.0, max_tokens=5)
            want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, explicit, use_tqdm=False)]
            assert got == want and all(len(t) == 5 for t in got)
        else:
            assert defaults == SamplingParams()
            assert all(len(t) <= 16 for t in got)
    finally:
        llm.shutdown()
