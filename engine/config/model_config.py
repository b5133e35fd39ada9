"""`ModelConfig`: what a checkpoint's config.json says, normalised (`ModelConfig.from_hf`); frozen.
`ConfigError`: a checkpoint or an engine option that Siesta cannot serve.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# Rope scaling types the model code implements; anything else is refused at load time.
SUPPORTED_ROPE_SCALING = ("llama3", "linear", "default")


class ConfigError(ValueError):
    """A checkpoint or an engine option that Siesta cannot serve."""


@dataclass(frozen=True)
class RopeScaling:
    """Normalised `rope_scaling`; `type` is one of SUPPORTED_ROPE_SCALING."""

    type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from a Hugging Face `config.json`, normalised across families."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str  # "float32" | "bfloat16" | "float16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    mlp_bias: bool = False
    # Mixture of experts, by Qwen3-MoE's config.json names; num_experts 0: a dense model. Layer i's
    # MLP is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense MLP every token runs, gated (0: none)

    @classmethod
    def from_hf(cls, path: str) -> ModelConfig:
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"no config.json in {path!r}: is this a Hugging Face model directory?")
        with open(cfg_file) as f:
            hf: dict[str, Any] = json.load(f)
        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError(f"{cfg_file} names no `architectures`")
        arch = archs[0]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported; supported: silu")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        mixtral = arch == "MixtralForCausalLM"
        return cls(
            path=os.path.abspath(path),
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta") or _rope_param(hf, "rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=_max_positions(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama-family configs say so with `attention_bias`.
            attention_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or bool(hf.get("attention_bias", False)),
            torch_dtype=dtype_name(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            eos_token_ids=_eos_ids(path, hf, int(hf["vocab_size"])),
            bos_token_id=hf.get("bos_token_id"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            # transformers >= 5 saves Qwen3-MoE's num_experts as num_local_experts.
            num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            # Mixtral's experts are intermediate_size wide and always renormalise their top k.
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or (hf["intermediate_size"] if mixtral else 0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", mixtral)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        )


def _max_positions(hf: dict[str, Any]) -> int:
    """Longest context served. With a sliding window (Mistral's `sliding_window`, Qwen's when
    `use_sliding_window` is on) it is capped at the window: below it, sliding-window attention is
    full attention, which is what the attention backends compute."""
    max_pos = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window")
    sliding = hf.get("use_sliding_window", window is not None)
    if sliding and window is not None:
        return min(max_pos, int(window))
    return max_pos


def _rope_param(hf: dict[str, Any], key: str, default: Any) -> Any:
    """transformers >= 5 moves rope settings into `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    return params.get(key, default)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_SCALING)}"
        )
    if kind == "default":
        return None
    return RopeScaling(
        type=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def dtype_name(d: str) -> str:
    d = str(d).replace("torch.", "")
    aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
    d = aliases.get(d, d)
    if d not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype {d!r} is not supported; supported: float32, bfloat16, float16")
    return d


def _as_ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def _eos_ids(path: str, hf: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json, in that order, without repeats; an id
    outside the model's vocabulary is dropped (it is never sampled, and masking it would index
    past the logits)."""
    ids = _as_ids(hf.get("eos_token_id"))
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            ids += _as_ids(json.load(f).get("eos_token_id"))
    return tuple(t for t in dict.fromkeys(ids) if 0 <= t < vocab_size)
