"""Text prompts to token ids, with a fast refusal of texts that cannot fit the context.

Tokenizing is linear but slow (a 10 MB prompt takes seconds on the event loop), so a text is first
bounded from below by its length, and refused without tokenizing when even the bound is over the
context length.

The bound: a text of C characters tokenizes to at least ceil(C / (F * L)) tokens, where
- L is the longest token of the vocabulary in characters: the longer of its vocabulary string (in
  the model's own alphabet: one character per byte for byte-level BPE, with "▁" for a space in
  SentencePiece style) and its decoded text. In the pipelines allowed below, a token covers at
  most that many characters of the normalized, pre-tokenized text.
- F is how many characters of the input the normalizer may fold into one: 1, or 4 with NFC/NFKC
  composition (a composed character stands for at most 4 code points; the set of composites is
  frozen by Unicode's stability policy).
The bound holds only where no step drops or merges input characters, so it is used only for a
fast tokenizer (`tokenizers`) whose pipeline is built from the steps known here; any other
tokenizer (unknown steps, whitespace-dropping pre-tokenizers, WordPiece/WordLevel/Unigram words
as one unknown token, fused unknown tokens, BPE that silently drops characters it has no token
for, added tokens that strip around them, slow tokenizers) gets no bound, and its texts are
tokenized whole, as before.
F * L is computed once per tokenizer, on the first text longer than the context, and cached.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

from tokenizers import pre_tokenizers

from engine.errors import InvalidRequest

# Normalizers that never fold characters (each maps a character to one or more).
_KEEPING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
# Normalizers that compose: at most this many code points become one character.
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
MAX_COMPOSED = 4
# Pre-tokenizers that keep every character (given a behavior other than "Removed").
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})

# tokenizer -> F * L, or None where no bound is sound.
_CHARS_PER_TOKEN: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def encode_text(tokenizer: Any, text: str, context_length: int) -> list[int]:
    """`tokenizer.encode(text)`, or `InvalidRequest` at once when the text is surely over
    `context_length` tokens."""
    # The bound is at most one token per character: only a longer text can be over it.
    at_least = min_tokens(tokenizer, len(text)) if len(text) > context_length else 0
    if at_least > context_length:
        raise InvalidRequest(
            f"the prompt is at least {at_least} tokens, over the context length of {context_length} tokens"
        )
    return tokenizer.encode(text)


def min_tokens(tokenizer: Any, chars: int) -> int:
    """A sound lower bound on the tokens of any text of `chars` characters (0 where none is
    known). Cheap: the per-tokenizer constant is computed once."""
    per_token = chars_per_token(tokenizer)
    return 0 if per_token is None else math.ceil(chars / per_token)


def chars_per_token(tokenizer: Any) -> int | None:
    """F * L of the module docstring: at most this many characters of input per token; None
    where the tokenizer's pipeline allows no sound bound."""
    try:
        return _CHARS_PER_TOKEN[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: compute each time (tests, odd tokenizers)
        return _compute(tokenizer)
    value = _compute(tokenizer)
    _CHARS_PER_TOKEN[tokenizer] = value
    return value


def _compute(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: its steps are not inspectable
        return None
    pipeline = json.loads(backend.to_str())
    vocab = tokenizer.get_vocab()
    fold = _normalizer_fold(pipeline.get("normalizer"))
    if fold is None or not vocab or not _keeps_characters(pipeline.get("pre_tokenizer")):
        return None
    if not _model_keeps(pipeline, vocab):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in pipeline.get("added_tokens", [])):
        return None  # such a token swallows any run of spaces beside it
    ids = sorted(vocab.values())
    decoded = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    longest = max(max(len(s) for s in vocab), max(len(s) for s in decoded))
    return fold * max(longest, 1)


def _normalizer_fold(step: dict | None) -> int | None:
    """How many input characters the normalizer may fold into one; None: unbounded or unknown."""
    if step is None:
        return 1
    kind = step.get("type")
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_COMPOSED
    if kind == "Replace":
        pattern, content = step.get("pattern", {}), step.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        return 1 if isinstance(literal, str) and literal and len(content) >= len(literal) else None
    if kind == "Sequence":
        total = 1
        for child in step.get("normalizers", []):
            fold = _normalizer_fold(child)
            if fold is None:
                return None
            total *= fold
        return total
    return None


def _keeps_characters(step: dict | None) -> bool:
    """Whether the pre-tokenizer passes every character on (splitting is fine, dropping is not)."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(child) for child in step.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"


def _model_keeps(pipeline: dict, vocab: dict[str, int]) -> bool:
    """Whether every input character ends up in a token of its own span. BPE drops a character
    it has no token for (no unknown token, no byte fallback), and fuses runs of unknown ones when
    told to; it keeps them all when each byte has a token (byte-level BPE, byte fallback) or each
    unknown character becomes one unknown token."""
    model = pipeline["model"]
    if model.get("type") != "BPE":
        return False
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    if _has_byte_level(pipeline.get("pre_tokenizer")) and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
        return True
    unk = model.get("unk_token")
    return unk is not None and unk in vocab and not model.get("fuse_unk")


def _has_byte_level(step: dict | None) -> bool:
    """Whether the pre-tokenizer maps every byte to one character of the byte-level alphabet."""
    if step is None:
        return False
    if step.get("type") == "Sequence":
        return any(_has_byte_level(child) for child in step.get("pretokenizers", []))
    return step.get("type") == "ByteLevel"
