"""`RowwiseSdpaBackend`: `SdpaBackend` with each query row attending alone, for `--deterministic`
(engine/models/invariant.py holds the rule for the matmuls).

    out[j] = softmax(q[j] K[:p+1].T * scale) V[:p+1]      p = the row's position in its sequence

Rule: a row's attention is one call whose shapes are fixed by its position p (query [1, H, 1, D],
keys and values [1, Hkv, p + 1, D], no mask), so its bits do not depend on how many rows share
its step: a prefill chunk of any length, a decode step, a prefix-cache hit (the cached KV was
computed the same way) or a teacher-forced re-scoring all give the same result. SDPA's kernels
for many query rows and a causal mask reduce in another order; one row at a time costs
O(rows) calls (on CUDA, one kernel launch a row and layer: the mode's default there is the
fixed-split Triton kernel, engine/attention/triton_fixed.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.sdpa import SdpaBackend


class RowwiseSdpaBackend(SdpaBackend):
    def _attend(
        self,
        q: torch.Tensor,  # [q_len, H, D]: the last q_len of the sequence's tokens
        k: torch.Tensor,  # [seq_len, Hkv, D]
        v: torch.Tensor,  # [seq_len, Hkv, D]
    ) -> torch.Tensor:  # [q_len, H, D]
        q_len, seq_len = q.shape[0], k.shape[0]
        keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq_len, D]
        values = v.transpose(0, 1).unsqueeze(0)
        rows = []
        for j in range(q_len):
            seen = seq_len - q_len + j + 1  # keys 0 .. the row's own position
            rows.append(F.scaled_dot_product_attention(
                q[j : j + 1].transpose(0, 1).unsqueeze(0),  # [1, H, 1, D]
                keys[:, :, :seen].contiguous(), values[:, :, :seen].contiguous(),
                scale=self.scale, enable_gqa=True,
            ))  # fmt: skip
        return torch.cat(rows, dim=2).squeeze(0).transpose(0, 1)  # [q_len, H, D]
