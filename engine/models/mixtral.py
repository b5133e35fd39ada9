"""Mixtral: the Llama decoder whose every MLP is the sparse mixture of experts (moe.py): experts of
`intermediate_size`, top-k renormalised. Its checkpoints name the sparse MLP `block_sparse_moe`
and an expert's matrices w1 (gate), w3 (up) and w2 (down); transformers 5 loads them as
`mlp.gate` and the packed `mlp.experts.gate_up_proj` / `down_proj`, the names this model has
and a trainer sends. Both load (`checkpoint_aliases`)."""

from __future__ import annotations

import re

from engine.config import ModelConfig
from engine.models.llama import DecoderOptions, LlamaForCausalLM
from engine.models.moe import sparse_layers

_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_CHECKPOINT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(moe_layers=sparse_layers(config))

    def checkpoint_aliases(self, names: list[str]) -> dict[str, str]:
        """Mixtral's checkpoint name -> this model's, for every router and per-expert name."""
        aliases: dict[str, str] = {}
        for name in names:
            layer, sep, rest = name.partition(".mlp.")
            if not sep:
                continue
            expert = _EXPERT.fullmatch(rest)
            if expert:
                aliases[f"{layer}.block_sparse_moe.experts.{expert[1]}.{_CHECKPOINT_NAMES[expert[2]]}.weight"] = name
            elif rest == "gate.weight":
                aliases[f"{layer}.block_sparse_moe.gate.weight"] = name
        return aliases
