"""Incremental detokenization with stop strings, for the client side of the engine.

Text from token ids, a few at a time, without ever emitting half a character or any part of a stop
string:

- Each step decodes a short window of tokens and emits what the window's decode adds beyond the
  text of its first tokens ("prefix offset"): tokenizers that drop a leading space, or merge
  bytes across tokens, decode a token differently alone than after its neighbours.
- A byte-level token may end inside a multi-byte UTF-8 character; its decode then ends with
  U+FFFD. Text up to that trailing run of U+FFFD is final and is emitted; the run waits for the
  bytes that complete it (or for `flush`).
- Stop strings: the first occurrence of any ends the text right before it. Until then, a tail that
  could still grow into a stop string is held back. With `no_stop_trim` (SGLang's field) the text
  is not cut: it ends with everything decoded up to the token that completed the stop string.
- `spaces_between_special_tokens` goes to the tokenizer's decode: Python ("slow") tokenizers
  honour it, fast ones accept and ignore it.
- A fast (Rust) tokenizer whose decode is transformers' own and does no clean-up is called
  directly: the same text, without transformers' per-call argument conversion (most of a
  decode's cost on the streaming path, which decodes every token).
- The next window's prefix is most often one token: its decoded length is cached per tokenizer
  (a token decodes alone the same way every time), so a step costs one decode, not two.
- Without stop strings, decoded text is emitted as it comes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output tokens, as context for the prefix offset.
PROMPT_CONTEXT_TOKENS = 5
# tokenizer -> (skip_special_tokens, spaces_between_special_tokens) -> token id -> its length alone.
_ALONE_LENGTHS: weakref.WeakKeyDictionary[Any, dict[tuple[bool, bool], dict[int, int]]] = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas. `text` is everything emitted so far;
    after a stop string matched, `stop_matched` names it and `step` returns "" forever."""

    def __init__(
        self,
        tokenizer: Any,  # a transformers tokenizer: only `decode` is used
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        no_stop_trim: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = direct_decoder(tokenizer, skip_special_tokens) or partial(
            tokenizer.decode, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)
        self._alone_lengths = _alone_lengths(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.no_stop_trim = no_stop_trim
        self.stop = tuple(s for s in stop if s)
        self.text = ""
        self.stop_matched: str | None = None
        # Token window state. Invariant: ids[prefix_offset:read_offset] decodes to a text of
        # `_prefix_len` chars that is done with (emitted, or prompt context) and ends on a
        # character boundary, and `_extra` more chars of decode(ids[prefix_offset:]) are emitted.
        context = list(prompt_token_ids[max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0) :])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            context, context_text = [], ""  # a prompt cut inside a character is no clean start
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_len = len(context_text)
        self._extra = 0
        # Decoded text not emitted yet because it may be the start of a stop string.
        self._held = ""

    @property
    def finished_by_stop(self) -> bool:
        return self.stop_matched is not None

    def step(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text delta that is now safe to emit."""
        if self.finished_by_stop:
            return ""
        self._ids.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At the request's end: return everything still held back (an incomplete character
        decodes as U+FFFD, a possible stop-string start that never completed is plain text)."""
        if self.finished_by_stop:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        """Text of the window not returned before; moves the window on at a character boundary."""
        window = self._decode(self._ids[self._prefix_offset :])
        start = self._prefix_len + self._extra
        if not final and window.endswith(REPLACEMENT_CHAR):
            # Keep the trailing U+FFFD run (an unfinished character) for later; the rest is final.
            stable = window.rstrip(REPLACEMENT_CHAR)
            if len(stable) <= start:
                return ""
            self._extra = len(stable) - self._prefix_len
            return stable[start:]
        delta = window[start:]
        if len(window) > self._prefix_len:
            # The whole window is emitted: its tail becomes the next prefix.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_len = self._decoded_length(self._ids[self._prefix_offset : self._read_offset])
            self._extra = 0
        return delta

    def _decoded_length(self, ids: list[int]) -> int:
        if len(ids) != 1:
            return len(self._decode(ids))
        lengths, token = self._alone_lengths, ids[0]
        n = lengths.get(token)
        if n is None:
            n = lengths[token] = len(self._decode(ids))
        return n

    def _emit(self, new_text: str, final: bool) -> str:
        """Stop-string handling on top of decoded text: return what may be shown now."""
        if not self.stop:
            self.text += new_text
            return new_text
        pending = self._held + new_text
        # A match cannot start in emitted text: every tail that could start one was held.
        found = [(pending.find(s), s) for s in self.stop if s in pending]
        if found:
            index, matched = min(found, key=lambda f: f[0])
            self.stop_matched = matched
            self._held = ""
            return self._append(pending if self.no_stop_trim else pending[:index])
        hold = 0 if final else self._stop_prefix_len(pending)
        self._held = pending[len(pending) - hold :]
        return self._append(pending[: len(pending) - hold])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stop), default=0)
        for n in range(min(len(text), longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _append(self, delta: str) -> str:
        self.text += delta
        return delta


def direct_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own decode when `tokenizer.decode` would give the same text: a
    transformers fast tokenizer whose `decode` and `_decode` are not overridden (they only convert
    the ids, call it, then clean up spaces) and whose clean-up is off. Else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) or backend is None:
        return None
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast
        except ImportError:  # transformers 4
            from transformers import PreTrainedTokenizerFast as Fast
    except ImportError:
        return None
    kind = type(tokenizer)
    if not isinstance(backend, Tokenizer) or kind.decode is not PreTrainedTokenizerBase.decode or kind._decode is not Fast._decode:
        return None
    return partial(backend.decode, skip_special_tokens=skip_special_tokens)


def _alone_lengths(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> dict[int, int]:
    """The shared cache of single-token decoded lengths for these decode settings (a private one
    when the tokenizer cannot be weakly referenced)."""
    try:
        per_setting = _ALONE_LENGTHS.setdefault(tokenizer, {})
    except TypeError:
        return {}
    return per_setting.setdefault((skip_special_tokens, spaces_between_special_tokens), {})
