"""Checkpoints of bench_engine.py: the Qwen3 shapes `--shape` names, reading a checkpoint's shape
back from its config.json, and building a random bf16 checkpoint of a shape (never over a
directory this code did not build). bench_serving.py and bench_memory.py build theirs here too.

A dense shape is saved with its weights (safetensors). A mixture-of-experts shape is saved as its
config.json alone (Qwen3-30B-A3B's 61 GB of bf16 is more than the device machine's disk) and the
engine makes its random weights in place (`load_format="dummy"`): `checkpoint` says which.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from bench_runtime import say
from device_timing import free_memory

# Shapes `--shape` names (random weights); `--tiny` uses "tiny" (or "tiny-moe"). Each carries the
# real model's max_position_embeddings (40960), so long contexts are measured as served. 30b-a3b is
# Qwen3-30B-A3B's config.json (its intermediate_size is unused: every layer is sparse).
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(  # Qwen3-0.6B
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=True,
    ),
    "8b": dict(  # Qwen3-8B
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    ),
    "30b-a3b": dict(  # Qwen3-30B-A3B (Qwen3MoeForCausalLM)
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}
# The tiny shape with 8 experts, top-2, each of intermediate 32: the MoE paths on a CPU.
SHAPES["tiny-moe"] = SHAPES["tiny"] | dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
# Names bench_memory.py and kernels/fused_ops.py import: the 0.6B shape, and the tiny one.
FULL_SHAPE, TINY_SHAPE = SHAPES["0.6b"], SHAPES["tiny"]
# The config.json keys a shape is made of (and compared on, when a built checkpoint is reused):
# a dense shape's, then those of a mixture of experts (Qwen3-MoE's names).
SHAPE_KEYS = tuple(SHAPES["0.6b"])
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers")
# A file written into every checkpoint this script builds: only such a directory is rebuilt.
BUILT_MARKER = "siesta_bench_checkpoint.json"

# ---- 1. checkpoint ------------------------------------------------------------------------------


def read_shape(path: str) -> dict[str, Any]:
    """The SHAPE_KEYS of a checkpoint's config.json, with head_dim and the KV heads filled in as
    the engine fills them (hidden / heads; as many KV heads as heads) and rope_theta found where
    transformers 5 puts it; with experts (num_experts, or transformers 5's num_local_experts),
    the MOE_KEYS too, defaulted as the engine defaults them."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    shape = {k: hf.get(k) for k in SHAPE_KEYS}
    shape["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    shape["num_key_value_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    shape["rope_theta"] = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    shape["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-6)
    shape["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts:
        shape |= dict(num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
                      moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
                      mlp_only_layers=[int(i) for i in hf.get("mlp_only_layers") or ()])
    return shape


def is_moe(shape: dict[str, Any]) -> bool:
    return bool(shape.get("num_experts"))


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
    mlp = (f"{shape['num_experts']} experts, top-{shape['num_experts_per_tok']}, moe_intermediate "
           f"{shape['moe_intermediate_size']}" if is_moe(shape) else f"intermediate {shape['intermediate_size']}")
    return (f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} "
            f"heads, {shape['num_key_value_heads']} KV heads, head_dim {shape['head_dim']}, {mlp}, vocab "
            f"{shape['vocab_size']}, {'tied' if shape['tie_word_embeddings'] else 'untied'}")


def make_checkpoint(path: str, shape: dict[str, Any], device: torch.device, seed: int) -> dict[str, Any]:
    """Random bf16 Qwen3 of `shape` (tied embeddings when it says so), saved with save_pretrained
    and marked with BUILT_MARKER; an MoE shape: its config.json alone (`write_config`). Kept if
    `path` already holds that shape, saved the same way. Refuses to overwrite a non-empty
    directory it did not build."""
    weights = not is_moe(shape)
    config = os.path.isfile(os.path.join(path, "config.json"))
    if config and (has_weights(path) or not weights):
        have = read_shape(path)
        if has_weights(path) == weights and all(have.get(k) == v for k, v in shape.items() if k != "rope_theta"):
            say(f"checkpoint: reusing {path}")
            return {"path": path, "created": False}
        if not os.path.isfile(os.path.join(path, BUILT_MARKER)):
            raise RuntimeError(f"{path} holds another shape and was not built here: not overwriting it "
                               "(give another --model-dir)")
        say(f"checkpoint: {path} holds another shape; recreating it")
    elif os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, BUILT_MARKER)):
        raise RuntimeError(f"{path} is not empty and was not built here: not writing into it")
    if not weights:
        return write_config(path, shape, seed)
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


def write_config(path: str, shape: dict[str, Any], seed: int) -> dict[str, Any]:
    """An MoE shape's checkpoint: Qwen3-30B-A3B's config.json with `shape`'s values, and
    BUILT_MARKER; weights left there by an earlier build of this directory are removed (the engine
    would load them)."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")):
            os.remove(os.path.join(path, name))
    config = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
                  attention_bias=False, attention_dropout=0.0, initializer_range=0.02, torch_dtype="bfloat16",
                  use_cache=True, use_sliding_window=False, sliding_window=None, rope_scaling=None,
                  max_window_layers=shape["num_hidden_layers"], output_router_logits=False,
                  router_aux_loss_coef=0.001) | shape  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, BUILT_MARKER), "w") as f:
        json.dump({"shape": shape, "seed": seed, "weights": "none: load_format dummy"}, f)
    say(f"checkpoint: wrote {path}/config.json (no weights: the engine loads it with load_format dummy)")
    return {"path": path, "created": True}


def checkpoint(spec: str, model_dir: str | None, device: torch.device, seed: int) -> dict[str, Any]:
    """The checkpoint section: resolve `--shape`, build if needed; the result names the directory
    loaded (`path`), the shape read back from its config.json (`shape`) and how the engine loads
    it (`load_format`: auto with weights there, dummy with a config.json alone)."""
    shape, path, build = resolve_checkpoint(spec, model_dir)
    out = make_checkpoint(path, shape, device, seed) if build else {"path": path, "created": False}
    out["shape"] = read_shape(path)
    out["load_format"] = "auto" if has_weights(path) else "dummy"
    say(f"checkpoint: {path}: {shape_label(out['shape'])}, load_format {out['load_format']}")
    return out
