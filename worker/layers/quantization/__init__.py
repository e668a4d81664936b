"""Quantized checkpoints: a method per format loads a layer's weights as the file holds them,
re-lays them out once for the kernels and runs the layer's matmul on them (vLLM's
`QuantizationConfig` / `LinearMethodBase`). Layers and models stay format-blind: a quantized
weight arrives through the layer's own `weight_loader`, and `finalize` turns what was loaded
into the layer's run-time form.

Formats: "gguf" (llama.cpp's block formats; automatic for a GGUF model: gguf.py), "awq" and
"gptq" (int4 safetensors checkpoints, turned into the kernels' int4 blocks at load: int4.py),
"int8" (W8A8, any unquantized checkpoint quantized at load: int8.py).
"""

from __future__ import annotations

from tokenmill.protocol.config import QUANTIZATION_METHODS

__all__ = ["QUANTIZATION_METHODS"]
