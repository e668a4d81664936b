"""int8 W8A8 (quantization="int8") for any bf16/fp32/fp16 checkpoint: after the checkpoint's
weights are loaded, each linear layer's weight [N, K] is quantized per output column into the
CPU kernel's layout (kernels/cpu/int8.py), and each call quantizes its activations per row
(token). The embedding and the LM head stay in the model's dtype (vLLM's W8A8 schemes leave
them too: the logits are where int8's error would show most). A layer whose shape the kernel
does not take keeps its weight, with one log line naming how many.
"""

from __future__ import annotations

import logging

from torch import nn

from tokenmill.kernels.cpu import int8 as kernels

logger = logging.getLogger(__name__)


def finalize(model: nn.Module, kernels_in_use: bool, triton: bool = False) -> None:
    """Every linear layer's weight quantized (see the module's doc)."""
    from tokenmill.worker.layers.linear import LinearBase

    quantized = kept = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or module.qweight is not None:
            continue
        weight = module.weight
        if weight.dim() != 2 or not kernels.supported((weight.shape[0], weight.shape[1])):
            kept += 1
            continue
        module.qweight = kernels.pack(weight.data, kernel=kernels_in_use, triton=triton)
        weight.data = weight.data.new_empty(0)  # the values live in the int8 copy
        quantized += 1
    logger.info("int8 W8A8: %d linear layers quantized per output column%s", quantized,
                f", {kept} kept in the model's dtype (shapes the kernel does not take)"
                if kept else "")  # fmt: skip
