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
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output tokens, as context for the prefix offset.
PROMPT_CONTEXT_TOKENS = 5


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
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.spaces_between_special_tokens = spaces_between_special_tokens
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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

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
            self._prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
            self._extra = 0
        return delta

    def _emit(self, new_text: str, final: bool) -> str:
        """Stop-string handling on top of decoded text: return what may be shown now."""
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
