"""The model classes, by HF `architectures` name (the list lives in protocol/model_registry.py);
a family's module is imported when a model of it is built."""

from __future__ import annotations

import importlib

from torch import nn

from tokenmill.protocol.model_registry import ARCHITECTURES, check_architecture


def get_model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture, "the model")
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"tokenmill.worker.models.{module}"), name)
