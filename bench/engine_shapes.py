"""Checkpoints of bench_engine.py: the Qwen3 shapes `--shape` names, reading a checkpoint's shape
back from its config.json, and building a random bf16 checkpoint of a shape (never over a
directory this code did not build). bench_serving.py and bench_memory.py build theirs here too.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from bench_runtime import say
from device_timing import free_memory

# Shapes `--shape` names (random weights); `--tiny` uses "tiny". max_position_embeddings is kept
# at 4096 (the real models have 40960): the workloads here are short.
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(  # Qwen3-0.6B
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=True,
    ),
    "8b": dict(  # Qwen3-8B
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    ),
}
# Names bench_memory.py and kernels/fused_ops.py import: the 0.6B shape, and the tiny one.
FULL_SHAPE, TINY_SHAPE = SHAPES["0.6b"], SHAPES["tiny"]
# The config.json keys a shape is made of (and compared on, when a built checkpoint is reused).
SHAPE_KEYS = tuple(SHAPES["0.6b"])
# A file written into every checkpoint this script builds: only such a directory is rebuilt.
BUILT_MARKER = "siesta_bench_checkpoint.json"

# ---- 1. checkpoint ------------------------------------------------------------------------------


def read_shape(path: str) -> dict[str, Any]:
    """The SHAPE_KEYS of a checkpoint's config.json, with head_dim and the KV heads filled in as
    the engine fills them (hidden / heads; as many KV heads as heads) and rope_theta found where
    transformers 5 puts it."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    shape = {k: hf.get(k) for k in SHAPE_KEYS}
    shape["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    shape["num_key_value_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    shape["rope_theta"] = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    shape["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-6)
    shape["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    return shape


def has_weights(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json"))


def resolve_checkpoint(spec: str, model_dir: str | None) -> tuple[dict[str, Any], str, bool]:
    """`--shape` and `--model-dir` -> (shape, checkpoint directory, whether to build it there).
    A named shape is built into `model_dir` (default /tmp/siesta-bench-qwen3-<name>); a directory
    with weights is measured as it is; a directory with only a config.json lends its shape."""
    if spec in SHAPES:
        return dict(SHAPES[spec]), model_dir or f"/tmp/siesta-bench-qwen3-{spec}", True
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise ValueError(f"--shape {spec!r}: neither one of {sorted(SHAPES)} nor a directory with a config.json")
    shape = read_shape(spec)
    if has_weights(spec):
        return shape, os.path.abspath(spec), False
    name = os.path.basename(os.path.abspath(spec))
    return shape, model_dir or f"/tmp/siesta-bench-{name}", True


def shape_label(shape: dict[str, Any]) -> str:
    """One line naming a shape, for logs and table titles."""
    return (f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} "
            f"heads, {shape['num_key_value_heads']} KV heads, head_dim {shape['head_dim']}, intermediate "
            f"{shape['intermediate_size']}, vocab {shape['vocab_size']}, "
            f"{'tied' if shape['tie_word_embeddings'] else 'untied'}")


def make_checkpoint(path: str, shape: dict[str, Any], device: torch.device, seed: int) -> dict[str, Any]:
    """Random bf16 Qwen3 of `shape` (tied embeddings when it says so), saved with save_pretrained
    and marked with BUILT_MARKER; kept if `path` already holds that shape. Refuses to overwrite a
    non-empty directory it did not build."""
    if has_weights(path) and os.path.isfile(os.path.join(path, "config.json")):
        have = read_shape(path)
        if all(have.get(k) == v for k, v in shape.items() if k != "rope_theta"):
            say(f"checkpoint: reusing {path}")
            return {"path": path, "created": False}
        if not os.path.isfile(os.path.join(path, BUILT_MARKER)):
            raise RuntimeError(f"{path} holds another shape and was not built here: not overwriting it "
                               "(give another --model-dir)")
        say(f"checkpoint: {path} holds another shape; recreating it")
    elif os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, BUILT_MARKER)):
        raise RuntimeError(f"{path} is not empty and was not built here: not writing into it")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t0 = time.perf_counter()
    tied = bool(shape.get("tie_word_embeddings", True))
    config = Qwen3Config(**(shape | {"tie_word_embeddings": tied}))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
            assert p.dtype == torch.bfloat16, name
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    free_memory(device)
    with open(os.path.join(path, BUILT_MARKER), "w") as f:
        json.dump({"shape": shape, "seed": seed}, f)
    dt = time.perf_counter() - t0
    say(f"checkpoint: created {path} ({n_params / 1e6:.1f} M params, bf16) in {dt:.1f} s")
    return {"path": path, "created": True, "num_params": n_params, "seconds": dt}


def checkpoint(spec: str, model_dir: str | None, device: torch.device, seed: int) -> dict[str, Any]:
    """The checkpoint section: resolve `--shape`, build if needed; the result names the directory
    loaded (`path`) and the shape read back from its config.json (`shape`)."""
    shape, path, build = resolve_checkpoint(spec, model_dir)
    out = make_checkpoint(path, shape, device, seed) if build else {"path": path, "created": False}
    out["shape"] = read_shape(path)
    say(f"checkpoint: {path}: {shape_label(out['shape'])}")
    return out
