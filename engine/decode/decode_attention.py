"""`DecodeAttention`: the layers' own decode attention (models/layers.py `Attention`, through its
`decode_attention` hook) on the decode steps no persistent path takes (the 8B shape, more than
64 rows): one launch of the rope-decode kernel (engine/kernels/rope_decode.py) on the qkv linear's
output (one "partial", its bias already added), where rotary, store_kv, decode and its reduce
were four."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.kernels import pdl
from engine.kernels.rope_decode import FEW_ROWS, kernel_consts, merge_for, rope_decode
from engine.models.rotary import RopeInputs


def norm_inputs(attn: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """An `Attention`'s q and k norm weights [D] and eps for the rope-decode kernel (None, None,
    0.0: no q/k norm, as Llama and Qwen2)."""
    qn, kn = attn.q_norm, attn.k_norm
    return (qn.weight if qn is not None else None, kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0)


def unsupported(model: nn.Module, backend: object) -> str | None:
    """Why `DecodeAttention` cannot serve this model's layers with this backend (None: it can):
    CUDA, Triton attention, the fused ops on (it replaces their rotary)."""
    from engine.attention.triton import TritonBackend

    if not isinstance(backend, TritonBackend) or backend.kv_cache.device.type != "cuda":
        return "attention backend is not triton on CUDA"
    if not model.model.fused or not len(model.model.layers):
        return "fused ops off or no layers"
    return None


class DecodeAttention:
    """The layers' decode attention (module docstring): `Attention.forward` hands it the qkv
    linear's output [T, QKV] of a decode step on its backend and gets [T, H, D] back, the new
    K/V rows stored. Built once at startup (attach.py); its constants are every layer's."""

    def __init__(self, model: nn.Module, backend: object) -> None:
        attn = model.model.layers[0].self_attn
        kv = backend.kv_cache
        self.backend = backend
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)  # this rank's
        # One part (KS = 1, its stride unused), the bias already in it; a set for steps of at most
        # FEW_ROWS rows and one for more (their merges: merge_for).
        self.consts = [kernel_consts(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, 1, 0, False, attn.q_norm is not None, kv.shape[3],
            kv.element_size(), pdl.enabled(kv.device), merge=merge_for(rows),
        ) for rows in (FEW_ROWS, FEW_ROWS + 1)]  # fmt: skip
        self._plans: dict[int, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def plan(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backend's merged_decode_plan of `rows` rows (its splits, workspace and counters: fixed
        by the row count), asked once per row count rather than at every layer of every step."""
        if rows not in self._plans:
            self._plans[rows] = self.backend.merged_decode_plan(rows)
        return self._plans[rows]

    def applies(self, qkv: torch.Tensor, ctx: ForwardContext) -> bool:
        """A decode step on this backend, one row per sequence, qkv [T, QKV] contiguous on CUDA,
        whose T x Hkv programs fit one wave: in later waves each program's rope ahead of its
        first tile is no longer hidden (0.6B shape, 256 rows: 5.50 ms a step with it, 5.39-5.41
        without; bench/history/2026-11-25.md)."""
        rows = qkv.shape[0]
        return (
            ctx.backend is self.backend and ctx.meta.is_decode and not ctx.verify and qkv.is_cuda and qkv.is_contiguous()
            and 0 < rows == ctx.meta.seq_lens.shape[0] and rows * self.shape[1] <= self.backend.wave_programs
        )  # fmt: skip

    def __call__(
        self, attn: nn.Module, qkv: torch.Tensor, rope: RopeInputs, ctx: ForwardContext
    ) -> torch.Tensor:  # `Attention` attn, qkv [T, QKV] -> [T, H, D]
        nh, _, d = self.shape
        out = torch.empty(qkv.shape[0], nh, d, dtype=qkv.dtype, device=qkv.device)
        meta = ctx.meta
        rope_decode(
            norm_inputs(attn), qkv.unsqueeze(0), None, self.backend.layer_caches[attn.layer_id], rope.positions, rope.cos_sin_cache,
            (meta.slot_mapping, meta.block_tables, meta.seq_lens), out, self.backend.scale, self.plan(qkv.shape[0]),
            self.consts[qkv.shape[0] > FEW_ROWS],
        )  # fmt: skip
        return out
