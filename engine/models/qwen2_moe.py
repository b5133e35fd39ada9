"""Qwen2-MoE: the Qwen2 decoder (q/k/v bias) whose MLP is the sparse mixture of experts (moe.py) on
the layers the config makes sparse (`moe.sparse_layers`), each with its gated shared expert
(`shared_expert_intermediate_size`); routing weights are renormalised only when `norm_topk_prob`
says so (false in Qwen1.5-MoE and Qwen2-57B-A14B)."""

from __future__ import annotations

from dataclasses import replace

from engine.config import ModelConfig
from engine.models.llama import DecoderOptions
from engine.models.moe import sparse_layers
from engine.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return replace(super().decoder_options(config), moe_layers=sparse_layers(config))
