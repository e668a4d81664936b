"""/v1/embeddings: texts, token ids or a chat -> OpenAI's embeddings, as vLLM serves them
from a pooling model (`--runner pooling`).

Each input is one pooling request (prefill only: the core ends it when its prompt has run,
with the pooled vector); a list of inputs runs as many requests at once, batched by the
scheduler. `encoding_format: "base64"` sends each vector's float32 bytes (little-endian) in
base64, as OpenAI's client decodes them. A client that goes away has its requests aborted.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request

from tokenmill.frontend.outputs import PoolingRequestOutput
from tokenmill.frontend.server.protocol import EmbeddingChatRequest, EmbeddingCompletionRequest
from tokenmill.frontend.server.serving import (
    OpenAIServing,
    ServingError,
    _message_dict,
    until_disconnect,
)
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import PoolingParams

EmbeddingRequest = EmbeddingCompletionRequest | EmbeddingChatRequest


class OpenAIServingEmbedding(OpenAIServing):
    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        lora_request, model_name = self.resolve_model(body.model)
        prompts = await self._prompts(body)
        prompts = [self.truncated(p, body.truncate_prompt_tokens) for p in prompts]
        field = "messages" if isinstance(body, EmbeddingChatRequest) else "input"
        for prompt in prompts:
            self.check_length(len(prompt["prompt_token_ids"]), None, prompt=field)
        params = self._pooling_params(body)
        request_id = f"embd-{uuid.uuid4().hex}"
        outputs = await self._run(raw, prompts, params, request_id, body.priority, lora_request)
        data = [
            {"index": i, "object": "embedding", "embedding": _encoded(out, body.encoding_format)}
            for i, out in enumerate(outputs)
        ]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": model_name,
            "data": data,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }

    async def _prompts(self, body: EmbeddingRequest) -> list[dict[str, Any]]:
        if isinstance(body, EmbeddingCompletionRequest):
            return await self.prompts(body.input, body.add_special_tokens, "input")
        messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
        prompt = await self.render_chat(
            messages,
            body.chat_template,
            body.add_generation_prompt,
            body.continue_final_message,
            body.add_special_tokens,
            template_kwargs=body.chat_template_kwargs,
        )
        return [prompt]

    def _pooling_params(self, body: EmbeddingRequest) -> PoolingParams:
        try:
            params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
            params.verify(self.engine.model_config)
        except ValueError as e:
            raise ServingError(str(e), 400, "dimensions") from None
        return params

    async def _run(
        self,
        raw: Request,
        prompts: list[dict[str, Any]],
        params: PoolingParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> list[PoolingRequestOutput]:
        """Every prompt's pooled output, in order; all checked before any is sent."""
        requests = await self._prepare(prompts, params, request_id, priority, lora_request)

        async def last(request: Any) -> PoolingRequestOutput:
            final = None
            async for out in self.engine.encode(request):
                final = out
            assert final is not None
            return final

        outputs = await until_disconnect(raw, asyncio.gather(*(last(r) for r, _ in requests)))
        for out in outputs:
            if out.error is not None:
                raise ServingError(out.error, 400)
        return outputs


def _encoded(out: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    vector = out.outputs.data.float().numpy()
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float64).tolist()
