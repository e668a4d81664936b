"""Routes about the served model: /v1/models (its name and max_model_len, then its LoRA
adapters: serving_models.py) and /tokenize and /detokenize (its tokenizer, with the chat
template for messages; an adapter shares the base model's).

Included by build_app (server/app.py). Tokenizer work runs on AsyncLLM's tokenizer thread; a
request naming another model, or a bad prompt or token id, raises ServingError (a 400 or 404).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from tokenmill.frontend.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.frontend.server.serving import ServingError, _message_dict
from tokenmill.frontend.server.state import State
from tokenmill.frontend.server.tool_choice import check_tools

router = APIRouter()


@router.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": state.models.model_cards(int(state.started))}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    engine = state.engine
    state.models.resolve(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ServingError("give either prompt or messages", 400, "prompt")
    if body.messages is not None:
        messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
        if body.tools is not None:
            check_tools(body.tools, None)
        prompt = await state.chat.render_chat(
            messages,
            None,
            body.add_generation_prompt,
            body.continue_final_message,
            False,  # the template holds the special tokens
            body.tools,
            body.chat_template_kwargs,
        )
    else:
        assert body.prompt is not None
        prompt = await engine.encode_prompt(body.prompt, body.add_special_tokens)
    tokens = prompt["prompt_token_ids"]
    result: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": engine.model_config.max_model_len,
        "tokens": tokens,
        "token_strs": None,  # present as null when not asked for, as in vLLM
    }
    if body.return_token_strs:
        result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(tokens)
    return result


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, str]:
    state.models.resolve(body.model)
    vocab = state.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ServingError(f"tokens holds ids outside [0, {vocab}): {bad[:8]}", 400, "tokens")
    return {"prompt": await state.engine.decode(body.tokens)}
