"""Qwen3-MoE: the Qwen3 decoder whose MLP is the sparse mixture of experts (moe.py) on the layers
the config makes sparse: layer i unless listed in `mlp_only_layers`, and only when
(i + 1) % decoder_sparse_step == 0 (transformers', vLLM's and SGLang's rule); the other layers
keep Qwen3's dense MLP of `intermediate_size`."""

from __future__ import annotations

from dataclasses import replace

from engine.config import ModelConfig
from engine.models.llama import DecoderOptions
from engine.models.qwen3 import Qwen3ForCausalLM


def sparse_layers(config: ModelConfig) -> tuple[int, ...]:
    """The layers whose MLP is the mixture of experts."""
    if config.num_experts < 1:
        return ()
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers)
    return tuple(i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return replace(super().decoder_options(config), moe_layers=sparse_layers(config))
