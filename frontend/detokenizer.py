"""Incremental detokenization: new text for each new token, without re-decoding everything.

Keeps two offsets into the token list: text up to `read_offset` has been emitted; decoding
restarts at `prefix_offset`, a few tokens back, so that multi-token characters and
tokenizers that merge spaces decode exactly as a full decode would. Text ending in the
replacement character waits for the tokens that complete it; at the request's end,
`finish()` emits what still waits, as a full decode shows it.
"""

from __future__ import annotations

from typing import Any

# Tokens decoded again before the emitted text, so that a character split over tokens or a
# space the tokenizer merges with the next token comes out right.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def update(self, new_token_ids: list[int]) -> str:
        """Appends tokens; returns the text they add (possibly empty for now)."""
        added = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix) :]
                added += delta
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        self.output_text += added
        return added

    def finish(self) -> str:
        """The text held back for a character whose remaining tokens never came (the request
        ended inside it): the replacement character, as a full decode of the tokens gives."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        added = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += added
        return added
