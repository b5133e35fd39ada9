"""Which CUDA graphs an engine captures, decided once at startup from its config, its device, its
attention backend and its model (`ModelRunner` step 4; the KV sizing reserves their memory first).

Rules:
- No graphs on a CPU or with `disable_cuda_graph`.
- Decode graphs need a backend that can be captured; piecewise graphs run the attention eagerly
  between their pieces, so any backend takes them, except in `--deterministic`.
- Decode graphs up to `cuda_graph_max_bs` (at most `max_num_seqs`); by default DEFAULT_MAX_BS,
  SMALL_GPU_MAX_BS on a GPU under SMALL_GPU_BYTES.
- `--deterministic` with a mixture of experts runs every step eagerly: its experts are the torch
  reference, which syncs with the host per expert (models/moe.py).
- Verify graphs (speculative decoding) for `speculative_disable_by_batch_size` drafting rows of
  `speculative_num_draft_tokens + 1` tokens, on CUDA outside `--deterministic` (there the plain
  graphs serve them).
- A draft model's graphs (`--speculative-algorithm draft`, with decode graphs) hold as many rows
  (engine/runner/draft_model.py: its catch-up rows and its one-row-a-request steps).
- Piecewise graphs for steps with prefill up to `piecewise_cuda_graph_max_tokens` tokens (0: none;
  None: the token budget), the ladder of piecewise_graph.py under the KV cache's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend
from engine.config import EngineConfig, ModelConfig
from engine.runner.piecewise_graph import piecewise_token_sizes

DEFAULT_MAX_BS = 256
SMALL_GPU_MAX_BS = 128
SMALL_GPU_BYTES = 40 << 30


@dataclass(frozen=True)
class GraphSizes:
    decode_max_bs: int  # the largest decode graph; 0: decode runs eagerly
    verify_rows: int  # the most rows of a verify graph; 0: none
    draft_rows: int  # the most rows of a draft model's graph; 0: none
    piecewise_max_tokens: int  # the largest piecewise graph before the KV cap; 0: none

    @classmethod
    def of(
        cls, config: EngineConfig, device: torch.device, backend: type[AttentionBackend], model_config: ModelConfig
    ) -> GraphSizes:
        reference_moe = config.deterministic and model_config.num_experts > 0
        if device.type != "cuda" or config.disable_cuda_graph or reference_moe:
            return cls(0, 0, 0, 0)
        decode = verify = draft = pieces = 0
        if backend.supports_cuda_graph and config.cuda_graph_max_bs is not None:
            decode = min(config.cuda_graph_max_bs, config.max_num_seqs)
        elif backend.supports_cuda_graph:
            small = torch.cuda.get_device_properties(device).total_memory < SMALL_GPU_BYTES
            decode = min(config.max_num_seqs, SMALL_GPU_MAX_BS if small else DEFAULT_MAX_BS)
        drafting_rows = config.speculative_disable_by_batch_size * (config.speculative_num_draft_tokens + 1)
        if config.speculative_algorithm is not None and not config.deterministic:
            verify = drafting_rows
        if config.speculative_algorithm == "draft" and decode:
            draft = min(drafting_rows, config.max_num_seqs)
        limit = config.piecewise_cuda_graph_max_tokens
        if limit != 0 and (backend.supports_cuda_graph or not config.deterministic):
            pieces = min(config.max_num_batched_tokens, limit or config.max_num_batched_tokens)
        return cls(decode, verify, draft, pieces)

    def piecewise(self, kv_capacity_tokens: int) -> list[int]:
        """The piecewise graphs' token counts, ascending, for a cache of `kv_capacity_tokens`."""
        return piecewise_token_sizes(self.piecewise_max_tokens, kv_capacity_tokens) if self.piecewise_max_tokens else []
