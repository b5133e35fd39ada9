"""Model classes by the `architectures[0]` of a checkpoint's config.json, imported lazily.

Every class follows the interface of `engine.models.llama.LlamaForCausalLM`:
`cls(config)` (built in the caller's default device and dtype), `model(input_ids, positions, ctx)
-> hidden [T, hidden]`, `model.compute_logits(hidden) -> [n, vocab]` (model dtype), `init_buffers()`.
"""

from __future__ import annotations

import importlib

from torch import nn

from engine.config import ConfigError

# architectures[0] -> "module:Class"
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "engine.models.mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "engine.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "engine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "engine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_ARCHITECTURES)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`; ConfigError (a ValueError) listing the supported ones if none."""
    if architecture not in _ARCHITECTURES:
        raise ConfigError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(_ARCHITECTURES)}"
        )
    module, cls = _ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["get_model_class", "supported_architectures"]
