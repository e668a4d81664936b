"""The worker's adapters (owned by the model runner): every adapter added (its LoRARequest, to
read it again), the ones read into host memory (an LRU of `max_cpu_loras`), and the device
slots (`max_loras`, LRU) that each linear layer's `LoRALayer` holds. A step asks for the
adapters its rows run (the scheduler admits at most `max_loras` of them) and gets their
slots; an adapter not in a slot is copied in, evicting the least recently used one that the
step does not run."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import torch
from torch import nn

from tokenmill.protocol.lora import LoRAConfig, LoRARequest
from tokenmill.worker.layers.linear import LinearBase
from tokenmill.worker.lora.adapter import (
    LoRALayerWeights,
    LoRAModel,
    adapter_folder,
    load_lora_model,
)
from tokenmill.worker.lora.layers import LoRALayer

# The layers adapters may target, by tokenmill's module names (PEFT's q/k/v and gate/up are
# read into the packed ones).
TARGET_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        kind: str,
    ) -> None:
        """kind: the kernels the layers run ("cpu", "triton" or "native")."""
        self.config = config
        self.packed = dict(getattr(model, "packed_modules_mapping", {}))
        self.scales = torch.zeros(config.max_loras, dtype=torch.float32, device=device)
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and name.rpartition(".")[2] in TARGET_LAYERS:
                module.lora = LoRALayer(
                    module, config.max_loras, config.max_lora_rank, self.scales, dtype, device,
                    kind,
                )  # fmt: skip
                self.layers[name] = module.lora
        if not self.layers:
            raise ValueError(
                f"enable_lora: {type(model).__name__} has no layers LoRA can target "
                f"({', '.join(TARGET_LAYERS)})"
            )
        self.added: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(config.max_loras - 1, -1, -1))

    def add(self, request: LoRARequest) -> bool:
        """Reads the adapter into host memory (a ValueError naming what is wrong if it cannot
        run); False if an adapter of this id was added already. An id names one adapter: a
        request naming the id with another path is refused."""
        known = self.added.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already {known.lora_name!r} "
                    f"({known.lora_path}), not {request.lora_path!r}"
                )
            self._host_model(request.lora_int_id)
            return False
        self.added[request.lora_int_id] = request
        try:
            self._host_model(request.lora_int_id)
        except Exception:
            del self.added[request.lora_int_id]
            raise
        return True

    def remove(self, lora_id: int) -> bool:
        """Forgets the adapter (its slot frees); False if it was not added."""
        if self.added.pop(lora_id, None) is None:
            return False
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.scales[slot] = 0.0
            self.free_slots.append(slot)
        return True

    def list(self) -> set[int]:
        """The adapters added and not removed."""
        return set(self.added)

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Each of these adapters' slot (by lora_int_id), copying in those not in one; at most
        max_loras. An adapter removed while requests still ran it is added again from their
        LoRARequest."""
        if len(requests) > self.config.max_loras:
            raise ValueError(
                f"a step runs {len(requests)} adapters, above max_loras={self.config.max_loras}"
            )
        for lora_id in requests:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id, request in requests.items():
            if lora_id in self.slot_of:
                continue
            if lora_id not in self.added:
                self.add(request)
            slot = self.free_slots.pop() if self.free_slots else self._evict(requests.keys())
            self._load_slot(slot, self._host_model(lora_id))
            self.slot_of[lora_id] = slot
        return {lora_id: self.slot_of[lora_id] for lora_id in requests}

    def _evict(self, keep: Collection[int]) -> int:
        """Frees the least recently used slot whose adapter is not in `keep`."""
        victim = next(lora_id for lora_id in self.slot_of if lora_id not in keep)
        return self.slot_of.pop(victim)

    def _host_model(self, lora_id: int) -> LoRAModel:
        """The adapter as read into host memory, read (again) from its folder if it is not
        among the max_cpu_loras most recently used."""
        model = self.host.get(lora_id)
        if model is not None:
            self.host.move_to_end(lora_id)
            return model
        request = self.added[lora_id]
        path = adapter_folder(request.lora_name, request.lora_path)
        model = load_lora_model(path, self.config.max_lora_rank, self.packed)
        unknown = {name for name, _ in model.layers} - self.layers.keys()
        if unknown:
            raise ValueError(
                f"{request.lora_path}: the adapter targets {sorted(unknown)[0]!r}, which this "
                f"model does not have (LoRA targets {', '.join(TARGET_LAYERS)})"
            )
        for name, weights in _by_layer(model).items():
            self.layers[name].check(name, weights)
        self.host[lora_id] = model
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return model

    def _load_slot(self, slot: int, model: LoRAModel) -> None:
        by_layer = _by_layer(model)
        for name, layer in self.layers.items():
            layer.set_slot(slot, by_layer.get(name, {}))
        self.scales[slot] = model.scaling


def _by_layer(model: LoRAModel) -> dict[str, dict[str | int | None, LoRALayerWeights]]:
    """The adapter's matrices by layer, then by slice."""
    by_layer: dict[str, dict[str | int | None, LoRALayerWeights]] = {}
    for (name, slice_id), weights in model.layers.items():
        by_layer.setdefault(name, {})[slice_id] = weights
    return by_layer
