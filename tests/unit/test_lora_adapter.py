"""PEFT adapter folders read by worker/lora/adapter.py, against peft itself: adapters made
with `peft` on a small random Llama (every projection targeted, random B so the adapter
changes the output) give the same A and B matrices under tokenmill's module names (q/k/v in
qkv_proj, gate/up in gate_up_proj), PEFT's scaling (lora_alpha / r, rsLoRA's / sqrt(r)), and
the same output change as peft's own layer (scaling * x A^T B^T). What the engine does not
run is refused by name; LoRARequest is vLLM's."""

from __future__ import annotations

import json
import math
import os
import re

import msgspec
import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tokenmill.protocol.lora import LoRARequest  # noqa: E402
from tokenmill.worker.lora.adapter import adapter_folder, load_lora_model  # noqa: E402
from tokenmill.worker.models.llama import LlamaForCausalLM as OurLlama  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PACKED = OurLlama.packed_modules_mapping


def make_adapter(folder, **lora) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = peft.get_peft_model(
        LlamaForCausalLM(config),
        peft.LoraConfig(
            **{
                "r": 8,
                "lora_alpha": 16,
                "target_modules": MODULES,
                "init_lora_weights": False,
                **lora,
            }
        ),  # fmt: skip
    )
    model.save_pretrained(str(folder))
    return model


def test_adapter_matches_peft(tmp_path) -> None:
    model = make_adapter(tmp_path)
    ours = load_lora_model(str(tmp_path), 16, PACKED)
    assert ours.rank == 8 and ours.scaling == 2.0
    assert len(ours.layers) == 2 * len(MODULES)
    q = model.base_model.model.model.layers[1].self_attn.q_proj
    a, b = q.lora_A["default"].weight, q.lora_B["default"].weight
    mine = ours.layers[("model.layers.1.self_attn.qkv_proj", "q")]
    assert torch.equal(mine.lora_a, a.detach()) and torch.equal(mine.lora_b, b.detach())
    up = ours.layers[("model.layers.0.mlp.gate_up_proj", 1)]
    assert up.lora_a.shape == (8, 64) and up.lora_b.shape == (96, 8)
    assert ("model.layers.0.self_attn.o_proj", None) in ours.layers
    # peft's layer adds scaling * x A^T B^T to the base output: the same matrices, by hand.
    x = torch.randn(5, 64)
    with torch.no_grad():
        delta = q(x) - q.base_layer(x)
    by_hand = ours.scaling * (x @ mine.lora_a.T @ mine.lora_b.T)
    torch.testing.assert_close(delta, by_hand, rtol=1e-5, atol=1e-5)


def test_rslora_scaling(tmp_path) -> None:
    make_adapter(tmp_path, r=16, lora_alpha=8, use_rslora=True)
    assert load_lora_model(str(tmp_path), 16, PACKED).scaling == 8 / math.sqrt(16)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 32}, "LoRA rank 32 is greater than max_lora_rank 16."),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ],
)
def test_what_the_engine_does_not_run_is_refused(tmp_path, lora, message) -> None:
    make_adapter(tmp_path, **lora)
    with pytest.raises(ValueError, match=message):
        load_lora_model(str(tmp_path), 16, PACKED)


def test_folders_without_weights_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_lora_model(str(tmp_path), 16, PACKED)
    make_adapter(tmp_path)
    os.remove(tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="doesn't contain tensors"):
        load_lora_model(str(tmp_path), 16, PACKED)
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle"):
        load_lora_model(str(tmp_path), 16, PACKED)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(ValueError, match="trains biases"):
        load_lora_model(str(tmp_path), 16, PACKED)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"r": None}, "Missing required configuration fields: ['r']"),
        ({"lora_alpha": None}, "Missing required configuration fields: ['lora_alpha']"),
        ({"r": 0}, "r must be a positive integer, got 0"),
        ({"r": "8"}, "r must be a positive integer, got '8'"),
        ({"lora_alpha": "x"}, "lora_alpha must be a number, got 'x'"),
    ],
)
def test_config_fields_are_checked_by_name(tmp_path, change, message) -> None:
    make_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_lora_model(str(tmp_path), 16, PACKED)


def test_unreadable_weights_and_missing_folders_are_value_errors(tmp_path) -> None:
    make_adapter(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        load_lora_model(str(tmp_path), 16, PACKED)
    with pytest.raises(ValueError, match="^Loading lora x failed: No adapter found for /no/such"):
        adapter_folder("x", "/no/such")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        adapter_folder("x", "")
    home = os.path.expanduser("~")
    assert adapter_folder("x", "~") == home


def test_lora_request_is_vllms() -> None:
    request = LoRARequest("sql", 1, "/adapters/sql")
    assert request == LoRARequest("sql", 2) and request != LoRARequest("chat", 1)
    assert len({request, LoRARequest("sql", 3)}) == 1
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=LoRARequest)
    assert (decoded.lora_name, decoded.lora_int_id, decoded.lora_path) == (
        "sql",
        1,
        "/adapters/sql",
    )
    assert (request.name, request.adapter_id, request.path) == ("sql", 1, "/adapters/sql")
    # Prefix-cache keys: by id too (a reloaded adapter gets a new one), never ambiguous.
    salts = {
        r.cache_salt
        for r in (
            request,
            LoRARequest("sql", 2, "/adapters/sql"),
            LoRARequest("a:b", 1, "c"),
            LoRARequest("a", 1, "b:c"),
        )
    }
    assert len(salts) == 4
    for bad in (0, -1):
        with pytest.raises(ValueError, match="lora_int_id must be > 0"):
            LoRARequest("x", bad)
