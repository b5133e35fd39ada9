"""`ModelBuilder`: the target model and the draft model built on the meta device (startup step 1 of
`ModelRunner`, before `WeightStore` gives them memory in the `weights` region).

Rules:
- A model is built in the engine's dtype, in eval mode, with `fused_ops` as the config says.
- `--deterministic` installs its batch-invariant matmuls on every model built (models/invariant.py,
  counting their chunks' arrivals in `arrivals`); its attention is the backend's (resolve_backend_name).
- The draft model (`--speculative-algorithm draft`) must share the target's vocabulary. It is
  attached as the target's `draft`, so its weights ride in the target's allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.models import get_model_class, invariant
from engine.runner.draft_model import DraftModel

if TYPE_CHECKING:
    from engine.kernels.invariant_matmul import Arrivals


@dataclass(frozen=True)
class ModelBuilder:
    config: EngineConfig
    dtype: torch.dtype
    device: torch.device
    arrivals: Arrivals | None  # `--deterministic`'s split-matmul counters, else None

    def model(self, mc: ModelConfig, **options: object) -> torch.nn.Module:
        """`mc`'s model class built with `options` on the meta device."""
        cls = get_model_class(mc.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                model = cls(mc, fused=None if self.config.fused_ops else False, **options)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.deterministic:
            invariant.install(model, self.device, self.arrivals)
        return model.eval()

    def draft(self, target: torch.nn.Module, target_config: ModelConfig, block_size: int) -> DraftModel | None:
        """The draft model attached to `target`; None without one."""
        c = self.config
        if c.speculative_algorithm != "draft":
            return None
        mc = ModelConfig.from_hf(c.speculative_draft_model_path)
        if mc.vocab_size != target_config.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({mc.vocab_size}) is not the target's ({target_config.vocab_size})")
        model = self.model(mc, logits_pieces=False)
        target.draft = model
        return DraftModel(model, mc, block_size, c.max_num_batched_tokens)
