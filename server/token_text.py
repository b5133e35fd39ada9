"""`TokenText`: a token's text decoded alone (special tokens included), as logprob entries show
it: the OpenAI routes' `tokens` and `top_logprobs` keys, and `/generate`'s logprob tuples with
SGLang's `return_text_in_logprobs`."""

from __future__ import annotations

from typing import Any


class TokenText:
    """Token id -> its text alone, cached for one request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
