"""A PEFT LoRA adapter folder read into the per-layer A and B matrices the worker's slots
hold, keyed by tokenmill's module names (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`,
as each model's `packed_modules_mapping` says).

What PEFT can write but this engine does not run is refused by name, before any weight is
read: DoRA (`use_dora`), `modules_to_save` (whole replaced modules), LoRA biases, per-module
rank or alpha patterns, Conv1D layouts (`fan_in_fan_out`), target parameters, and modules
outside q/k/v/o and gate/up/down. Weights come only from safetensors (never a pickle).
Scaling is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

# The projections LoRA may target (PEFT's names, as HF's Llama-family checkpoints call them).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHTS = "adapter_model.safetensors"


@dataclass
class LoRALayerWeights:
    """One PEFT module's matrices: lora_a [r, in], lora_b [out, r] (as PEFT stores them)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass
class LoRAModel:
    """An adapter as read: its rank, scaling, and weights by (tokenmill module, slice); the
    slice is None for an unpacked module, else the packed part ("q"/"k"/"v", 0/1)."""

    rank: int
    scaling: float
    layers: dict[tuple[str, str | int | None], LoRALayerWeights]


def adapter_folder(lora_name: str, lora_path: str) -> str:
    """The folder a LoRARequest's path names (`~` expanded); vLLM's errors where it names none."""
    if not lora_path:
        raise ValueError(f"lora_path cannot be empty (adapter {lora_name!r})")
    path = os.path.expanduser(lora_path)
    if not os.path.exists(path):
        raise ValueError(f"Loading lora {lora_name} failed: No adapter found for {lora_path}")
    return path


def read_adapter_config(path: str, max_lora_rank: int) -> dict:
    """The adapter's config, checked: what this engine cannot run is a ValueError naming it."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} is not a PEFT adapter folder (no adapter_config.json)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LoRA")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (whole modules replaced by the adapter)",
        "lora_bias": "LoRA biases",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weight layouts)",
        "target_parameters": "target_parameters",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{path}: the adapter uses {what} ({key}), which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: the adapter trains biases (bias={config['bias']!r}), which "
                         "is not supported")  # fmt: skip
    missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if missing:
        raise ValueError(f"{config_path}: Missing required configuration fields: {missing}")
    rank, alpha = config["r"], config["lora_alpha"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    return config


def load_lora_model(
    path: str, max_lora_rank: int, packed_modules_mapping: dict[str, tuple[str, str | int]]
) -> LoRAModel:
    """Reads a PEFT adapter folder (see the module's docstring for what is refused)."""
    config = read_adapter_config(path, max_lora_rank)
    weights_path = os.path.join(path, _WEIGHTS)
    if not os.path.isfile(weights_path):
        bin_path = os.path.join(path, "adapter_model.bin")
        if os.path.isfile(bin_path):
            raise ValueError(f"{path} holds adapter_model.bin (a pickle), which is never "
                             f"loaded; save the adapter with safetensors")  # fmt: skip
        raise ValueError(f"{path} doesn't contain tensors ({_WEIGHTS} is missing)")
    rank, alpha = config["r"], float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} cannot be read: {e}") from None
    if not tensors:
        raise ValueError(f"{path} doesn't contain tensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, kind = _split(name, path)
        pairs.setdefault(module, {})[kind] = tensor
    layers = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: {module} has {sorted(pair)}, not lora_A and lora_B")
        parent, _, leaf = module.rpartition(".")
        if leaf not in SUPPORTED_MODULES:
            raise ValueError(
                f"While loading {path}, expected target modules in {list(SUPPORTED_MODULES)} "
                f"but received {leaf!r} ({module}). Please verify that the loaded LoRA module "
                "is correct"
            )
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{path}: {module}'s matrices {tuple(a.shape)} and "
                             f"{tuple(b.shape)} do not have rank r={rank}")  # fmt: skip
        packed = packed_modules_mapping.get(leaf)
        key = (f"{parent}.{packed[0]}", packed[1]) if packed else (module, None)
        layers[key] = LoRALayerWeights(a, b)
    return LoRAModel(rank, scaling, layers)


def _split(name: str, path: str) -> tuple[str, str]:
    """PEFT's `base_model.model.<module>.lora_A.weight` -> (<module>, "lora_A")."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"{path}: {name!r} is not a LoRA matrix (lora_A / lora_B); saved "
                         "base or embedding layers are not supported")  # fmt: skip
    module = ".".join(parts[:-2]).removeprefix("base_model.model.")
    return module, parts[-2]
