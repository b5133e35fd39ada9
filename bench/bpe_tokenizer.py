"""A byte-level BPE tokenizer of a real model's size, built offline: Qwen2's pre-tokenizer split
(digits one by one) and `tokenizers`' trainer over generated text (made-up words in sentences,
JSON, code-like lines, numbers, CJK, Cyrillic, kana, Hangul, Arabic, accented Latin, emoji), to
`vocab` tokens, the special tokens first. The same (vocab, seed) gives the same text; the trained
tokenizer is cached under a directory and loaded as a transformers `PreTrainedTokenizerFast`.
151,643 tokens (Qwen3's BPE) train in about a minute on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # eos: <|im_end|>
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
ONSETS = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn sp st str sw th tr".split()
VOWELS = "a e i o u y ai au ea ee ie io oa ou ue".split()
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rs", "st", "ck", "ll", "ss", "ght", "tion", "ment", "ing", "ed", "er", "ly"]
SCRIPTS = [(0x4E00, 0x5B70), (0x0430, 0x0450), (0x3040, 0x30A0), (0xAC00, 0xB3D0), (0x0620, 0x064B), (0xE0, 0x100), (0x1F600, 0x1F650)]
VERSION = 1  # of the text and the trainer's settings: part of the cache's key


class Text:
    """Deterministic generated text: a pool of made-up lowercase words (about one per token of
    `vocab`) and strings of other scripts, drawn Zipf-like (a few often, every one now and then)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.words = list(dict.fromkeys(self._word() for _ in range(vocab)))
        self.other = ["".join(chr(rng.randrange(*rng.choice(SCRIPTS))) for _ in range(rng.choice((1, 2, 2, 3, 4))))
                      for _ in range(vocab // 4)]  # fmt: skip

    def _word(self) -> str:
        r = self.rng
        return "".join(r.choice(ONSETS) + r.choice(VOWELS) for _ in range(r.choice((1, 1, 2, 2, 3)))) + r.choice(CODAS)

    def pick(self, pool: list[str]) -> str:
        r = self.rng
        return pool[min(int(r.paretovariate(0.7)) - 1, len(pool) - 1) if r.random() < 0.7 else r.randrange(len(pool))]

    def phrase(self, lo: int, hi: int) -> str:
        """lo to hi - 1 words, space-separated."""
        return " ".join(self.pick(self.words) for _ in range(self.rng.randrange(lo, hi)))

    def ident(self) -> str:
        """An identifier of one to three words: snake_case, camelCase or PascalCase."""
        parts = [self.pick(self.words) for _ in range(self.rng.choice((1, 2, 3)))]
        style = self.rng.randrange(3)
        if style == 0:
            return "_".join(parts)
        return (parts[0] if style == 1 else parts[0].title()) + "".join(p.title() for p in parts[1:])

    def value(self, depth: int = 0) -> Any:
        """A JSON value: text, a number, a literal, or (above depth 2, never) an array or object."""
        r = self.rng
        x = r.random()
        if x < 0.3 or depth > 2:
            return self.phrase(1, 6) if r.random() < 0.8 else self.pick(self.other)
        if x < 0.5:
            return r.choice((r.randrange(-1000, 100000), round(r.uniform(-1e3, 1e3), 3), True, False, None))
        if x < 0.7:
            return [self.value(depth + 1) for _ in range(r.randrange(0, 4))]
        return {self.ident(): self.value(depth + 1) for _ in range(r.randrange(1, 4))}

    def corpus(self, lines: int) -> list[str]:
        out, r = [], self.rng
        forms = ("def {}({}, {}):", "{} = {}.{}({})", "if {} is not None and {} > {}:", "return {}[{}] + {}",
                 "for {} in range({}): {}", "{}.{} = {} * {}")  # fmt: skip
        for _ in range(lines):
            x = r.random()
            if x < 0.4:
                s = self.phrase(4, 20)
                out.append(s[0].upper() + s[1:] + r.choice(".,;:!?") + r.choice(("", " ", "\n")))
            elif x < 0.6:
                out.append(json.dumps(self.value(r.randrange(2)), ensure_ascii=False, indent=r.choice((None, None, 2, 4))))
            elif x < 0.8:
                code = r.choice(forms).format(*(self.ident() for _ in range(4)), r.randrange(100))
                out.append(" " * r.choice((0, 2, 4, 6, 8, 12)) + code)
            else:
                out.append(" ".join(self.pick(self.other) if r.random() < 0.7 else self.pick(self.words)
                                    for _ in range(r.randrange(2, 12))))  # fmt: skip
        return out


def bpe_tokenizer(vocab: int, cache_dir: str, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """(the `PreTrainedTokenizerFast`, its path, size, sha256, whether it was trained now and the
    seconds it took), trained on `2 * vocab` lines of `Text(vocab, seed)` unless cached."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(cache_dir, f"bpe-{vocab}-seed{seed}-v{VERSION}", "tokenizer.json")
    t0, built = time.perf_counter(), not os.path.exists(path)
    if built:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(Text(vocab, seed).corpus(2 * vocab), trainer)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tok.save(f"{path}.{os.getpid()}.tmp")
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    hf = PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    return hf, {"path": path, "vocab": len(hf), "sha256": sha, "trained": built, "seconds": time.perf_counter() - t0}
