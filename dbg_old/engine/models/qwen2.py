"""Qwen2: the Llama decoder with a bias on q/k/v_proj (always, whatever the config says) and
none on o_proj."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False)
