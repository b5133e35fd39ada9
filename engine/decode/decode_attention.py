"""`DecodeAttention`: the layers' own decode attention (models/layers.py `Attention`, through its
`decode_attention` hook) on the decode steps no persistent path takes (the 8B and 30B-A3B shapes,
more than 64 rows): the qkv projection, then one launch of the rope-decode kernel
(engine/kernels/rope_decode.py), where rotary, store_kv, decode and its reduce were four.

The projection, by rows:
- 1-16 rows of a wide enough qkv weight (splitk_linear.qkv_chunks): fp32 split-K parts
  [KS, PART_ROWS, QKV], which the kernel sums with the bias and rounds once, as the linear
  rounds its output. The parts' rows are PART_ROWS whatever the step's: one stride, one kernel
  variant for every row count.
- otherwise the layer's qkv linear (one "partial", its bias already added).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.kernels import pdl, skinny_linear, splitk_linear
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


PART_ROWS = skinny_linear.MAX_ROWS  # rows of the qkv parts: the most that splitk_linear.qkv_chunks takes


class DecodeAttention:
    """The layers' decode attention (module docstring): `Attention.forward` hands it the layer's
    input [T, hidden] of a decode step on its backend and gets [T, H, D] back, the new K/V rows
    stored. Built once at startup (attach.py); its constants are every layer's."""

    def __init__(self, model: nn.Module, backend: object) -> None:
        attn = model.model.layers[0].self_attn
        kv = backend.kv_cache
        self.backend = backend
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)  # this rank's
        self.qk_norm = attn.q_norm is not None
        self.cache = (kv.shape[3], kv.element_size(), pdl.enabled(kv.device))  # block size, bytes a value, PDL
        self._consts: dict[tuple[bool, int, bool], dict[str, object]] = {}
        self._plans: dict[int, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def consts(self, rows: int, ks: int, has_bias: bool) -> dict[str, object]:
        """The kernel's constants for a step of `rows` rows on KS qkv parts (KS > 1: at a stride of
        PART_ROWS rows; 1: the linear's output) with or without the bias to add: one set per
        merge (merge_for: at most FEW_ROWS rows, or more) and input form."""
        key = (rows > FEW_ROWS, ks, has_bias)
        if key not in self._consts:
            nh, nkv, d = self.shape
            stride = PART_ROWS * (nh + 2 * nkv) * d if ks > 1 else 0
            self._consts[key] = kernel_consts(nh, nkv, d, ks, stride, has_bias, self.qk_norm, *self.cache, merge=merge_for(rows))
        return self._consts[key]

    def plan(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backend's merged_decode_plan of `rows` rows (its splits, workspace and counters: fixed
        by the row count), asked once per row count rather than at every layer of every step."""
        if rows not in self._plans:
            self._plans[rows] = self.backend.merged_decode_plan(rows)
        return self._plans[rows]

    def applies(self, hidden: torch.Tensor, ctx: ForwardContext) -> bool:
        """A decode step on this backend, one row per sequence, hidden [T, hidden] on CUDA, whose
        T x Hkv programs fit one wave: in later waves each program's rope ahead of its first
        tile is no longer hidden (0.6B shape, 256 rows: 5.50 ms a step with it, 5.39-5.41
        without; bench/history/2026-11-25.md)."""
        rows = hidden.shape[0]
        return (
            ctx.backend is self.backend and ctx.meta.is_decode and not ctx.verify and hidden.is_cuda
            and 0 < rows == ctx.meta.seq_lens.shape[0] and rows * self.shape[1] <= self.backend.wave_programs
        )  # fmt: skip

    def __call__(
        self, attn: nn.Module, hidden: torch.Tensor, rope: RopeInputs, ctx: ForwardContext
    ) -> torch.Tensor:  # `Attention` attn, hidden [T, hidden] -> [T, H, D]
        nh, _, d = self.shape
        rows = hidden.shape[0]
        linear = attn.qkv_proj
        ks = splitk_linear.qkv_chunks(hidden, linear.weight)
        if ks is not None:  # [KS, PART_ROWS, QKV] fp32, the bias added in the kernel
            part, bias = splitk_linear.splitk_parts(hidden, linear.weight, rows=PART_ROWS), linear.bias
        else:  # [1, T, QKV], the bias in it
            part, bias, ks = linear(hidden).unsqueeze(0), None, 1
        out = torch.empty(rows, nh, d, dtype=hidden.dtype, device=hidden.device)
        meta = ctx.meta
        rope_decode(
            norm_inputs(attn), part, bias, self.backend.layer_caches[attn.layer_id], rope.positions, rope.cos_sin_cache,
            (meta.slot_mapping, meta.block_tables, meta.seq_lens), out, self.backend.scale, self.plan(rows),
            self.consts(rows, ks, bias is not None),
        )  # fmt: skip
        return out
