"""Qwen3: the Llama decoder with per-head RMSNorm of q and k (`q_norm`, `k_norm`, weight
[head_dim]) before rope; `attention_bias` covers q, k, v and o as in Llama."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True
        )
