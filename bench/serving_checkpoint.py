"""The checkpoint a server under test loads: engine_shapes' random checkpoint of a shape, with a
tokenizer that decodes every id of the model (the server needs one; the prompts are ids).
bench_serving.py, bench_replicas.py and bench_flip.py build theirs here, in a child process.

A checkpoint without weights (config.json alone: engine_shapes' MoE shapes) is served with
`--load-format dummy` (random weights of its shape made in place) and `--weights-backup none` (no
pinned host copy of weights that a weight update replaces), unless the flags name either
(`dummy_flags`)."""

from __future__ import annotations

import json
import os
from typing import Any

from engine_shapes import BUILT_MARKER, checkpoint, shape_label

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_checkpoint(shape: str, model_dir: str | None, seed: int, tiny: bool) -> dict[str, Any]:
    """engine_shapes' checkpoint (run it in a child process: it may use the GPU), and the demo
    tokenizer, widened to the model's vocabulary (`widen_tokenizer`), where the checkpoint is the
    bench's own or has none."""
    import torch
    import transformers

    from engine.demo_model import save_tokenizer

    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    out = checkpoint(shape, model_dir, device, seed)
    out["label"], out["tokenizer"] = shape_label(out["shape"]), None
    mine = os.path.isfile(os.path.join(out["path"], BUILT_MARKER))
    if mine or not all(os.path.isfile(os.path.join(out["path"], f)) for f in TOKENIZER_FILES):
        out["tokenizer"] = None if mine else "/tmp/siesta-bench-demo-tokenizer"
        save_tokenizer(out["path"] if mine else out["tokenizer"])
        widen_tokenizer(out["path"] if mine else out["tokenizer"], out["shape"]["vocab_size"])
    return out


def widen_tokenizer(path: str, vocab_size: int) -> None:
    """Give the demo tokenizer saved at `path` (512 tokens) one token for every id below
    `vocab_size`: ids from 512 on decode to synthetic words (" aaba", " aabb", ...), with no merge
    that encodes to them. A random model samples its whole vocabulary, and an id that a tokenizer
    cannot decode adds nothing to the text, so the incremental detokenizer's window would grow with
    each one (a stream decoding ever longer windows: a cost no real checkpoint's text has)."""
    file = os.path.join(path, "tokenizer.json")
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    vocab: dict[str, int] = data["model"]["vocab"]
    next_id, i = max(vocab.values()) + 1, 0
    while next_id < vocab_size:
        word, k = "", i + 26 * 26  # three letters or more
        while k:
            k, r = divmod(k, 26)
            word = chr(ord("a") + r) + word
        i += 1
        if "\u0120" + word not in vocab:  # byte-level BPE writes a leading space as U+0120
            vocab["\u0120" + word] = next_id
            next_id += 1
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def dummy_flags(load_format: str, flags: list[str]) -> list[str]:
    """The serve flags a checkpoint loaded as `load_format` needs beyond `flags`."""
    if load_format != "dummy":
        return []
    named = lambda flag: any(a == flag or a.startswith(flag + "=") for a in flags)  # noqa: E731
    return ([] if named("--load-format") else ["--load-format", "dummy"]) + (
        [] if named("--weights-backup") else ["--weights-backup", "none"])
