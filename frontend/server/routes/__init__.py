"""The server's routes, one module per concern, each an APIRouter that build_app
(server/app.py) includes: generate.py (/v1/completions, /v1/chat/completions,
/invocations), embeddings.py (/v1/embeddings, a pooling model's), models.py (/v1/models,
/tokenize, /detokenize) and health.py (/health, /version, /metrics). They read the shared
ServerState (server/state.py) and raise ServingError, which server/errors.py turns into the
error body.
"""
