"""`FixedSplitBackend`: the Triton backend with every query token attended by
engine/kernels/attention_fixed.py's kernel, for `--deterministic` on CUDA
(`--attention-backend triton_fixed`): the KV of a token's context is cut at fixed positions, so
its bits do not depend on the other tokens of its step, on prefill chunks or on decode. One
launch a layer whatever the step, against the row-wise SDPA's one call per query row and layer
(engine/attention/sdpa_rows.py).

Rule: the step's new K/V rows are stored first (the Triton backend's `forward`), then every row
of the step, decode, prefill or mixed, runs the one kernel. The mode runs eagerly, and no decode
path (engine/decode/attach.py) is attached in it: their kernels reduce in their own orders.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.triton import TritonBackend
from engine.kernels.attention_fixed import fixed_split_attention


class FixedSplitBackend(TritonBackend):
    supports_cuda_graph = False

    def _attend(
        self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        fixed_split_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                              self.scale, self.max_num_seqs)  # fmt: skip
