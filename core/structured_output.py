"""Structured outputs in the engine core, through xgrammar.

`StructuredOutputManager` compiles a request's constraint (JSON schema, regex, choice, EBNF
grammar, any JSON object) into an xgrammar grammar off the engine loop, in a small thread pool
(synchronously when `synchronous`, as under the torchrun launcher, where every rank must
schedule alike); compiled grammars are cached by their key. The tokenizer information xgrammar
needs is loaded once, on the first structured request. Each request then owns a
`GrammarMatcher`, advanced by the scheduler on every accepted token; it lives with the request
in the core, so a preempted request keeps its state along with its output tokens.

Per step, `fill_bitmask` writes one row of allowed tokens (a packed int32 bitmask, 32 tokens
per word) for every scheduled request that samples a token this step and has a grammar; the
rows travel to the workers in the SchedulerOutput and the sampler masks the logits with them.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import StructuredOutputsParams
from tokenmill.protocol.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_COMPILE_THREADS = 2


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, synchronous: bool = False) -> None:
        self.config = config
        self.synchronous = synchronous
        self.vocab_size = config.model_config.vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()  # one thread loads the tokenizer information
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar (or of the error that stopped it)."""
        if self.synchronous:
            future: Future = Future()
            try:
                future.set_result(self._compile(params))
            except Exception as e:
                future.set_exception(e)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        return self._pool.submit(self._compile, params)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind, text = params.key
        if kind == "json":
            try:
                json.loads(text)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            return compiler.compile_json_schema(
                text, any_whitespace=not params.disable_any_whitespace
            )
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            # Not ASCII-escaped: the grammar parser does not join escaped surrogate pairs.
            alternatives = " | ".join(
                json.dumps(c, ensure_ascii=False) for c in params.choice or []
            )
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "grammar":
            return compiler.compile_grammar(text)
        if params.disable_any_whitespace:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return compiler.compile_builtin_json_grammar()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                model = self.config.model_config
                tokenizer = AutoTokenizer.from_pretrained(model.tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(model.eos_token_ids) or None,
                )
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            return self._compiler

    @staticmethod
    def matcher(compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill_bitmask(
        self, out: SchedulerOutput, grammar_req_ids: set[str], requests: dict[str, Any]
    ) -> None:
        """Sets out.grammar_req_ids / out.grammar_bitmask for the requests of
        `grammar_req_ids` that are scheduled and sample a token this step (the loop runs over
        the constrained requests only, not the whole batch). A request that verifies a
        proposal gets a row per position, in order: the grammar's state after each proposed
        token, advanced tentatively and rolled back after. Past a proposed token the grammar
        forbids, rows allow everything: the proposal is rejected there, and those positions
        emit nothing."""
        scheduled, partial = out.num_scheduled_tokens, set(out.partial_req_ids)
        sampling = [
            requests[req_id]
            for req_id in grammar_req_ids
            if req_id in scheduled and req_id not in partial
        ]
        if not sampling:
            return
        import torch
        import xgrammar as xgr

        proposals = out.scheduled_spec_decode_tokens
        rows = [1 + len(proposals.get(r.request_id, ())) for r in sampling]
        bitmask = xgr.allocate_token_bitmask(sum(rows), self.vocab_size)
        at = 0
        for request, num_rows in zip(sampling, rows):
            grammar = request.grammar
            grammar.fill_next_token_bitmask(bitmask, at)
            advanced = 0
            for token in proposals.get(request.request_id, ()):
                if not grammar.accept_token(token):
                    break  # (the rows after this one stay all-allowed)
                advanced += 1
                if grammar.is_terminated():
                    break  # a stop token: the request ends there
                grammar.fill_next_token_bitmask(bitmask, at + advanced)
            if advanced:
                grammar.rollback(advanced)
            at += num_rows
        out.grammar_req_ids = [r.request_id for r, n in zip(sampling, rows) for _ in range(n)]
        out.grammar_bitmask = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
