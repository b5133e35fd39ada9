"""Qwen3-MoE: the Qwen3 decoder whose MLP is the sparse mixture of experts (moe.py) on the layers
the config makes sparse (`moe.sparse_layers`); the other layers keep Qwen3's dense MLP of
`intermediate_size`."""

from __future__ import annotations

from dataclasses import replace

from engine.config import ModelConfig
from engine.models.llama import DecoderOptions
from engine.models.moe import sparse_layers
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return replace(super().decoder_options(config), moe_layers=sparse_layers(config))
