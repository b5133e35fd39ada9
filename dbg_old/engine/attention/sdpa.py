"""`SdpaBackend`: paged attention with PyTorch's `scaled_dot_product_attention`, one sequence at a
time. It runs on any device and is the reference the Triton kernels are tested against, so it
favours being obviously right over being fast: it loops over sequences on the host (using the
`_cpu` metadata lists, so the loop itself never synchronizes) and is not CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class SdpaBackend(AttentionBackend):
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim]: written instead of a new one
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        k_cache, v_cache = self.kv_cache[layer_id, 0], self.kv_cache[layer_id, 1]
        self._write(k_cache, v_cache, k, v, meta.slot_mapping)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        # Rows past the last sequence (padding) are zero.
        if out is None:
            out = torch.zeros_like(q)
        else:
            self.check_out(q, out)
            out[qsl[-1] :].zero_()
        for i in range(meta.num_seqs):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            seq_k, seq_v = self._gather(k_cache, v_cache, meta.block_tables[i], seq_lens[i])
            out[start:end] = self._attend(q[start:end], seq_k.to(q.dtype), seq_v.to(q.dtype))
        return out

    def _write(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64, -1 = write nothing
    ) -> None:
        # Slot s is row s of the cache viewed as [num_blocks * block_size, Hkv, D] (`view`, not
        # `reshape`: writes must land in the cache). Dropping the -1 rows with a boolean mask
        # synchronizes on CUDA; acceptable for this backend only.
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)

    def _gather(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        block_table: torch.Tensor,  # [max_blocks] int32
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [seq_len, Hkv, D]
        """A sequence's first `seq_len` cached tokens, in order, through its block table."""
        num_blocks = -(-seq_len // self.block_size)
        blocks = block_table[:num_blocks].long()
        seq_k = k_cache[blocks].flatten(0, 1)[:seq_len]
        seq_v = v_cache[blocks].flatten(0, 1)[:seq_len]
        return seq_k, seq_v

    def _attend(
        self,
        q: torch.Tensor,  # [q_len, H, D]: the last q_len of the sequence's tokens
        k: torch.Tensor,  # [seq_len, Hkv, D]
        v: torch.Tensor,  # [seq_len, Hkv, D]
    ) -> torch.Tensor:  # [q_len, H, D]
        q_len, seq_len = q.shape[0], k.shape[0]
        # Query j sits at absolute position seq_len - q_len + j and sees keys 0..that position.
        # A single query (decode) is the last token and sees everything: no mask needed.
        mask = None
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len], True = attend
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, q_len, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, seq_len, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,  # H is a multiple of Hkv; query head h reads KV head h // (H / Hkv)
        )
        return out.squeeze(0).transpose(0, 1)  # [q_len, H, D]
