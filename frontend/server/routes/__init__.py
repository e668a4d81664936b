"""The server's routes, one module per concern, each an APIRouter that build_app
(server/app.py) includes: generate.py (/v1/completions, /v1/chat/completions,
/invocations), embeddings.py (/v1/embeddings, a pooling model's), models.py (/v1/models,
/tokenize, /detokenize), health.py (/health, /version, /metrics) and lora.py
(/v1/load_lora_adapter, /v1/unload_lora_adapter, with runtime LoRA updating on). They read
the shared ServerState (server/state.py) and raise ServingError, which server/errors.py turns
into the error body.
"""
