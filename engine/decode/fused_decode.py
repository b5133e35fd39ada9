"""`FusedDecode`: the decoder layers of a decode step of few rows, one kernel launch per layer
(engine/kernels/layer_kernel.py) instead of ten, plus one for the final norm.

Built by the model runner inside the `cuda_graph` region when `unsupported()` finds nothing
against it; the model's forward hands it every step it `applies` to (decode, 1..max_rows rows,
its own attention backend), eager or captured. Everything else runs the layers as before.

Rules:
- The scratch (qkv, attention partials, the merged attention output and the per-(row, KV head)
  split counters, o/down_proj partial sums, the two stream buffers, the barrier counter) is
  allocated once, for max_rows, and sliced
  by nothing: the kernels index rows up to M, so every graph batch size shares it. The barrier
  counter and the split counters need no reset between steps (each barrier leaves its low bits 0,
  each (row, KV head)'s merger zeroes its counter); they are zeroed when built and after a resume
  of the `cuda_graph` region (`after_resume`), so garbage handed back cannot stall a barrier or
  skip a merge. act (gate_up's output) and o_part (o_proj's partial sums) are Lamport
  buffers (engine/kernels/lamport.py: down_proj and the norm after o_proj wait on their data, not
  on a barrier); they are filled with the sentinel -0.0 at the same two points, so garbage cannot
  pass for data either.
- The embedding lookup is layer 0's norm phase (layer_kernel.py): no launch of its own.
- One program per SM, launched cooperatively: the grid barriers need every program resident.
  On Hopper also with PDL (engine/kernels/pdl.py, layer_kernel.py's USE_PDL).
- K splits of o_proj and down_proj: as many (1, 2, 4, 8) as keep the items within one wave
  (o_proj's of whole heads), so each program has at most one o_proj item.
- Split-KV: one attention item per program (rows * KV heads * splits <= P); splits fill that
  wave, at most _MERGE_ELEMENTS // head_dim per row: merge_last loads a (row, KV head)'s splits
  in one [group heads, BLOCK_S, D] fp32 load, BLOCK_S the most splits of any row (a one-row
  step's).

`--no-fused-decode` turns it off (engine/decode/attach.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.decode import rules
from engine.decode.rules import LayerShape, k_splits, prefetch_width

KERNEL_MAX_ROWS = 16  # tl.dot's 16-row tiles: one tile of rows covers every step up to this
# Steps the runner hands it (bench/history/2026-11-27.md, H200, 0.6B, context 512, forward in a
# graph against the layer-by-layer one; bench/history/2026-11-23.md): 1 row 0.70x, 2 rows 0.79x, 4 rows
# 0.86x, 8 rows 1.02x, 16 rows 1.23x: its attention phase (one program per SM, tiles not
# pipelined) loses to the split-KV kernel's four programs per SM once the rows bring enough KV.
MAX_ROWS = 4
_BM = 16  # rows per GEMV tile (tl.dot's smallest M)
_BN = 32  # output columns per GEMV item
_BK = 128  # K per step of the GEMV loops
_STAGES = 5  # of their software pipeline (bench/history/2026-11-27.md)
# L2 prefetches (layer_kernel.py; bench/history/2026-11-27.md): each
# o_proj item's whole tile while the attention's barrier waits; the first
# 256 columns of each gate_up row while o_proj's barrier waits and under the norm (the whole row: no
# better); the first 512 of each down_proj item's K split while gate_up's barrier waits, by the
# programs that had a gate_up item (issued before it, they slowed gate_up as much as they saved);
# the first 256 of the next layer's qkv rows after down_proj, under the launch boundary and norm.
_O_PRE = 1 << 30  # more than any row: the whole tile
_G_PRE = 256
_Q_PRE = 256
_D_PRE = 512
_MERGE_ELEMENTS = 2048  # splits x head_dim of a row: 16 splits at head_dim 128 (merge_last's registers)


def unsupported(model: nn.Module, backend: object) -> str | None:
    """Why `FusedDecode` cannot serve this model and backend (None: it can): rules.py's rules."""
    return rules.unsupported(model, backend)


def kv_splits(programs: int, shape: LayerShape, rows: int) -> int:
    """Split-KV parts per (row, KV head): fill one wave of programs, at most _MERGE_ELEMENTS //
    head_dim (merge_last loads a row's splits as [group heads, BLOCK_S, D] fp32). Never more for
    more rows, so a one-row step's is the most."""
    return max(1, min(programs // (rows * shape.nkv), _MERGE_ELEMENTS // shape.d))


def most_pairs(programs: int, shape: LayerShape, rows: int) -> int:
    """The most (row, split) pairs of any step of 1..rows rows: what the partials are sized for."""
    return max(m * kv_splits(programs, shape, m) for m in range(1, rows + 1))


def layer_consts(
    shape: LayerShape, programs: int, rows: int, block_size: int, use_pdl: bool, num_warps: int = 4,
    bn: int = _BN, bk: int = _BK, o_pre: int = _O_PRE, g_pre: int = _G_PRE, q_pre: int = _Q_PRE, stages: int = _STAGES, d_pre: int = _D_PRE,
    lamport: int = 1 | 2,
) -> dict[str, object]:  # fmt: skip
    """The layer kernel's constexprs and launch options, the same at every layer and step of
    `rows` rows at most on `programs` programs, KV blocks of `block_size` (no device needed:
    bench/kernels/occupancy.py compiles them)."""
    import triton

    tiles = shape.hidden // bn
    ks_o = k_splits(tiles, shape.nh * shape.d, programs, math.lcm(bk, shape.d))
    ks_d = k_splits(tiles, shape.inter, programs, bk)
    return dict(
        HID=shape.hidden, NH=shape.nh, NKV=shape.nkv, D=shape.d, INTER=shape.inter, QK_NORM=shape.qk_norm,
        KS_O=ks_o, KS_D=ks_d,
        BM=_BM, BN=bn, BK=bk, BLOCK_SIZE=block_size, ABN=64 if shape.d <= 128 else 32, BLOCK_S=triton.next_power_of_2(kv_splits(programs, shape, 1)),
        BLOCK_HID=triton.next_power_of_2(shape.hidden), P=programs, FIRST_ADD=2**31 - (programs - 1),
        USE_PDL=use_pdl, O_PRE=prefetch_width(shape.nh * shape.d // ks_o, o_pre), G_PRE=prefetch_width(shape.hidden, g_pre),
        Q_PRE=prefetch_width(shape.hidden, q_pre), D_PRE=prefetch_width(shape.inter // ks_d, d_pre),
        LAMPORT=bool(lamport & 1), LAMPORT_O=bool(lamport & 2), MAX_M=rows, GP=triton.next_power_of_2(shape.nh // shape.nkv),
        num_warps=num_warps, num_stages=stages, launch_cooperative_grid=True, enable_fp_fusion=False, launch_pdl=use_pdl,
    )  # fmt: skip


class FusedDecode:
    def __init__(
        self, model: nn.Module, backend: object, max_rows: int, programs_per_sm: int = 1, num_warps: int = 4,
        bn: int = _BN, bk: int = _BK, use_pdl: int = 1, norm_everywhere: int = 1, o_pre: int = _O_PRE, g_pre: int = _G_PRE,
        q_pre: int = _Q_PRE, stages: int = _STAGES, d_pre: int = _D_PRE, lamport: int = 1 | 2,
    ) -> None:  # fmt: skip
        from engine.kernels import pdl

        self.lm = model.model
        self.backend = backend
        self.shape = LayerShape.of(model)
        device, dtype = self.shape.device, self.shape.dtype
        self.programs = P = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
        # One attention item per program: rows * KV heads * splits <= P.
        self.max_rows = rows = min(max_rows, KERNEL_MAX_ROWS, P // self.shape.nkv)
        # engine/kernels/pdl.py: each layer's launch runs its prologue while the layer before finishes.
        self.pdl = pdl.enabled(device) and bool(use_pdl)
        # The layer kernel's arguments that are the same at every layer and step.
        self.consts = layer_consts(self.shape, P, rows, backend.kv_cache.shape[3], self.pdl, num_warps, bn, bk, o_pre, g_pre, q_pre, stages, d_pre,
                                   lamport)  # fmt: skip
        self.ks_o, self.ks_d = self.consts["KS_O"], self.consts["KS_D"]
        pairs = most_pairs(P, self.shape, rows)
        f32 = dict(dtype=torch.float32, device=device)
        half = dict(dtype=dtype, device=device)
        self.h = torch.zeros(rows, self.shape.hidden, **half)
        self.h_mid = torch.zeros(rows, self.shape.hidden, **half)
        # The normed stream: every program's own rows (steps of up to norm_everywhere rows), or
        # one shared set.
        self.norm_everywhere = norm_everywhere
        self.xn = torch.zeros(P if norm_everywhere else 1, rows, self.shape.hidden, **half)
        self.qkv = torch.zeros(rows, (self.shape.nh + 2 * self.shape.nkv) * self.shape.d, **half)
        self.ao = torch.zeros(rows, self.shape.nh * self.shape.d, **half)  # the attention output, splits merged
        self.counts = torch.zeros(rows, self.shape.nkv, dtype=torch.int32, device=device)  # splits done per (row, KV head)
        self.act = torch.zeros(rows, self.shape.inter, **half)
        self.o_part = torch.zeros(self.ks_o, rows, self.shape.hidden, **f32)
        self.down = torch.zeros(self.ks_d, rows, self.shape.hidden, **f32)
        self.part_o = torch.zeros(pairs * self.shape.nh * self.shape.d, **f32)
        self.part_lse = torch.zeros(pairs * self.shape.nh, **f32)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)
        self.stride_part = rows * self.shape.hidden  # of o_part and down, [KS, rows, hidden]
        self.sm_scale_log2 = backend.scale * 1.4426950408889634
        self.nbytes = sum(
            t.numel() * t.element_size()
            for t in (self.h, self.h_mid, self.xn, self.qkv, self.ao, self.act, self.o_part, self.down, self.part_o, self.part_lse, self.barrier, self.counts)
        )
        self.compiled: object = None  # the layer kernel as last launched (bench: registers, spills)
        self._unwrite()

    def after_resume(self) -> None:
        """The `cuda_graph` region came back with undefined contents: the barrier counter starts
        at zero, the Lamport buffers all sentinel."""
        self.barrier.zero_()
        self.counts.zero_()
        self._unwrite()

    def _unwrite(self) -> None:
        from engine.kernels.lamport import fill_unwritten

        fill_unwritten(self.act)  # the Lamport buffers (layer_kernel.py): every element the sentinel
        fill_unwritten(self.o_part)

    def splits(self, rows: int) -> int:
        """Split-KV parts per (row, KV head) of a step of `rows` rows (kv_splits)."""
        return kv_splits(self.programs, self.shape, rows)

    def applies(self, input_ids: torch.Tensor, ctx: ForwardContext) -> bool:
        return (ctx.backend is self.backend and ctx.meta.is_decode and not ctx.long_kv and not ctx.verify
                and 0 < input_ids.shape[0] <= self.max_rows)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, timing: torch.Tensor | None = None
    ) -> torch.Tensor:  # [M] int64, [M] int64 -> [M, hidden]; timing: [layers, P, STAMPS] int64 (bench)
        from engine.kernels.layer_kernel import decoder_layer_kernel, finish_kernel

        lm, meta = self.lm, ctx.meta
        m = input_ids.shape[0]
        cos_sin = lm.rotary_emb.cos_sin_cache
        splits = self.splits(m)
        everywhere = m <= self.norm_everywhere
        stride_xn = self.xn.stride(0) if everywhere else 0
        for i, layer in enumerate(lm.layers):
            attn, mlp = layer.self_attn, layer.mlp
            has_next = i + 1 < len(lm.layers)  # else the kernel is handed this layer's qkv and prefetches nothing
            k_cache, v_cache = self.backend.layer_caches[i]
            qkv_b = attn.qkv_proj.bias
            self.compiled = decoder_layer_kernel[(self.programs,)](
                lm.embed_tokens.weight if i == 0 else self.h_mid, input_ids, self.down, self.h, self.h_mid,
                layer.input_layernorm.weight, attn.qkv_proj.weight, qkv_b if qkv_b is not None else attn.qkv_proj.weight,
                attn.q_norm.weight if self.shape.qk_norm else cos_sin, attn.k_norm.weight if self.shape.qk_norm else cos_sin,
                attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                (lm.layers[i + 1] if has_next else layer).self_attn.qkv_proj.weight,
                self.xn, self.qkv, positions, cos_sin, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.slot_mapping,
                self.part_o, self.part_lse, self.ao, self.o_part, self.act, self.down, self.barrier,
                timing[i] if timing is not None else self.barrier, self.counts,
                m, splits, self.shape.eps, self.sm_scale_log2, self.stride_part, stride_xn, int(has_next),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
                HAS_QKV_BIAS=qkv_b is not None, KS_PREV=0 if i == 0 else self.ks_d, NORM_EVERYWHERE=everywhere, TIMING=timing is not None,
                **self.consts,
            )  # fmt: skip
        out = torch.empty(m, self.shape.hidden, dtype=self.h.dtype, device=self.h.device)
        finish_kernel[(m,)](
            self.h_mid, self.down, lm.norm.weight, self.h, out, self.stride_part, m, self.shape.eps,
            HID=self.shape.hidden, KS_D=self.ks_d, BLOCK=self.consts["BLOCK_HID"], num_warps=4,
        )  # fmt: skip
        return out
