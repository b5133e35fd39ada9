"""`FixedSplitBackend`: the Triton backend with every query token attended by
engine/kernels/attention_fixed.py's kernel, `--deterministic`'s backend on CUDA: the KV of a token's context is cut at fixed positions, so
its bits do not depend on the other tokens of its step, on prefill chunks or on decode. One
launch a layer whatever the step, against the row-wise SDPA's one call per query row and layer
(engine/attention/sdpa_rows.py).

Rules:
- The step's new K/V rows are stored first (the Triton backend's `forward`, or the fused rope
  kernel through `kv_target`), then every row of
  the step, decode, prefill or mixed, runs the one kernel; a step of few tokens (a decode) takes
  its split path, with the same bits, through `workspace` (the `cuda_graph` region, as the
  backend: [16, max_model_len / SPLIT, H, D] fp32, 42 MiB for Qwen3-0.6B at 40,960).
- CUDA graphs, decode and piecewise, replay the same kernel on the Triton backend's static
  metadata: its grid is the padded row count, and a padding row (seq_len 0, or past the last
  sequence) writes zeros, so a graph's rows carry the bits of eager rows.
- Of the decode paths (engine/decode/attach.py) the mode attaches only batch_decode.py's
  `invariant` variant, which keeps its orders and ends in this backend's `attend`; the others'
  kernels reduce in their own orders.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.triton import TritonBackend
from engine.kernels.attention_fixed import Workspace, fixed_split_attention
from engine.kernels.qkv_parts import QkvParts


class FixedSplitBackend(TritonBackend):
    supports_cuda_graph = True

    def __init__(
        self, kv_cache: torch.Tensor, scale: float, num_heads: int, max_num_seqs: int, max_model_len: int
    ) -> None:
        super().__init__(kv_cache, scale, num_heads, max_num_seqs, max_model_len)
        # The few-token steps' partials (decode): allocated once, in the region the backend is built in.
        self.workspace = Workspace.allocate(num_heads, self.head_dim, max_model_len, kv_cache.device)

    def after_resume(self) -> None:
        """The Triton backend's, and the split path's arrival counters back to zero."""
        super().after_resume()
        self.workspace.after_resume()

    def attend(
        self, layer_id: int, q: torch.Tensor, meta: AttentionMetadata, pdl: bool = False, rope: QkvParts | None = None
    ) -> torch.Tensor:  # fmt: skip
        """The Triton backend's `attend`; `pdl`: a decode step's kernel launched programmatically
        after the one that wrote q and the new K/V rows (batch_decode.py's persistent kernel);
        `rope`: q and those rows still qkv partials, which the kernel sums and rotates first."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._attend(layer_id, q, *self.layer_caches[layer_id], meta, out, pdl, rope)
        return out

    def _attend(
        self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        out: torch.Tensor, pdl: bool = False, rope: QkvParts | None = None,
    ) -> None:  # fmt: skip
        fixed_split_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                              self.scale, self.max_num_seqs, self.workspace, pdl and meta.is_decode, rope)  # fmt: skip
