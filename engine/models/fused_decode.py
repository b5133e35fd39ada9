"""`FusedDecode`: the decoder layers of a decode step of few rows, one kernel launch per layer
(engine/models/layer_kernel.py) instead of ten, plus one for the final norm.

Built by the model runner inside the `cuda_graph` region when `unsupported()` finds nothing
against it; the model's forward hands it every step it `applies` to (decode, 1..max_rows rows,
its own attention backend), eager or captured. Everything else runs the layers as before.

Rules:
- The scratch (qkv, attention partials, o_proj's per-program merge rows, o/down_proj partial
  sums, the two stream buffers, the barrier counter) is allocated once, for max_rows, and sliced
  by nothing: the kernels index rows up to M, so every graph batch size shares it. The counter is
  zeroed at the start of every step (captured too), so a resume that hands back garbage cannot
  stall a barrier.
- One program per SM, launched cooperatively: the grid barriers need every program resident.
- K splits of o_proj and down_proj: as many (1, 2, 4, 8) as keep the items within one wave
  (o_proj's of whole heads), so each program has at most one o_proj item.
- Split-KV: one attention item per program (rows * KV heads * splits <= P); splits fill that
  wave, capped so that a step's (row, split) pairs fit one merge load (_PAIR_ELEMENTS).

SIESTA_FUSED_DECODE=0 turns it off (read at construction).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import ForwardContext
from engine.models.batch_decode import k_splits

FUSED_DECODE_ENV = "SIESTA_FUSED_DECODE"
KERNEL_MAX_ROWS = 16  # tl.dot's 16-row tiles: one tile of rows covers every step up to this
# Steps the runner hands it (bench/profile_fused_decode.py, H200, 0.6B, context 512, forward in a
# graph against the layer-by-layer one; fifteenth session): 1 row 0.70x, 2 rows 0.79x, 4 rows
# 0.86x, 8 rows 1.02x, 16 rows 1.23x: its attention phase (one program per SM, tiles not pipelined) loses to the split-KV
# kernel's four programs per SM once the rows bring enough KV to read.
MAX_ROWS = 4
# Models it serves: the same profile at the 8B shape (hidden 4096), 1 row, measured a 5.86 ms
# forward against 4.46 layer by layer: one program per SM streams a 24-96 MB layer slower than the
# skinny GEMVs' grids. Measured below: the 0.6B shape (1024). Shapes between are unmeasured.
MAX_HIDDEN = 1024
_BM = 16  # rows per GEMV tile (tl.dot's smallest M)
_BN = 32  # output columns per GEMV item
_BK = 128  # K per step of the GEMV loops (256 where every K is a multiple)
_PAIR_ELEMENTS = 2048  # (row, split) pairs x head_dim per step: 16 pairs at head_dim 128


def unsupported(model: nn.Module, backend: object, env: str = FUSED_DECODE_ENV) -> str | None:
    """Why `FusedDecode` (or batch_decode.py's `BatchDecode`, whose switch is `env`) cannot serve
    this model and backend (None: it can)."""
    from engine.attention.triton import TritonBackend

    if os.environ.get(env, "1") == "0":
        return f"{env}=0"
    if not isinstance(backend, TritonBackend):
        return "attention backend is not triton"
    lm = model.model
    layer = lm.layers[0] if len(lm.layers) else None
    if layer is None or not lm.fused or model.tp.enabled:
        return "no layers, fused ops off or tensor parallel"
    attn, mlp = layer.self_attn, layer.mlp
    w = attn.qkv_proj.weight
    if not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16):
        return "not a half-precision CUDA model"
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "o_proj or MLP bias"
    hidden, inter = w.shape[1], mlp.down_proj.weight.shape[1]
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} > {MAX_HIDDEN}: the layers' own GEMVs are faster there"
    if hidden % _BK or inter % _BK or (attn.num_heads * attn.head_dim) % _BK:
        return f"hidden {hidden}, intermediate {inter} or heads not multiples of {_BK}"
    if attn.head_dim not in (64, 128, 256) or attn.num_heads // attn.num_kv_heads > 16:
        return "head_dim or GQA group outside what the kernel tiles"
    return None


class FusedDecode:
    def __init__(
        self, model: nn.Module, backend: object, max_rows: int, programs_per_sm: int = 1, num_warps: int = 4,
        bn: int = _BN, bk: int | None = None,
    ) -> None:  # fmt: skip
        import triton

        lm = self.lm = model.model
        self.backend = backend
        attn, mlp = lm.layers[0].self_attn, lm.layers[0].mlp
        w = attn.qkv_proj.weight
        device, dtype = w.device, w.dtype
        self.hidden, self.inter = w.shape[1], mlp.down_proj.weight.shape[1]
        self.nh, self.nkv, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = lm.layers[0].input_layernorm.eps
        self.qk_norm = attn.q_norm is not None
        self.programs = P = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
        # One attention item per program: rows * KV heads * splits <= P.
        self.max_rows = min(max_rows, KERNEL_MAX_ROWS, P // self.nkv)
        # (row, split) pairs per step: combine_heads holds them all, [4 heads, pairs, D] fp32.
        self.max_pairs = max(1, _PAIR_ELEMENTS // self.d)
        if bk is None:
            bk = 2 * _BK if all(n % (2 * _BK) == 0 for n in (self.hidden, self.inter, self.nh * self.d)) else _BK
        self.compiled: object = None  # the layer kernel as last launched (bench: registers, spills)
        tiles = self.hidden // bn
        self.ks_o = k_splits(tiles, self.nh * self.d, P, math.lcm(bk, self.d))
        self.ks_d = k_splits(tiles, self.inter, P, bk)
        rows = self.max_rows
        pairs = max(m * self.splits(m) for m in range(1, rows + 1))
        f32 = dict(dtype=torch.float32, device=device)
        half = dict(dtype=dtype, device=device)
        self.h = torch.zeros(rows, self.hidden, **half)
        self.h_mid = torch.zeros(rows, self.hidden, **half)
        self.xn = torch.zeros(rows, self.hidden, **half)
        self.qkv = torch.zeros(rows, (self.nh + 2 * self.nkv) * self.d, **half)
        self.xo = torch.zeros(P, _BM, self.nh * self.d // self.ks_o, **half)
        self.act = torch.zeros(rows, self.inter, **half)
        self.o_part = torch.zeros(self.ks_o, rows, self.hidden, **f32)
        self.down = torch.zeros(self.ks_d, rows, self.hidden, **f32)
        self.part_o = torch.zeros(pairs * self.nh * self.d, **f32)
        self.part_lse = torch.zeros(pairs * self.nh, **f32)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)
        self.stride_part = rows * self.hidden  # of o_part and down, [KS, rows, hidden]
        # The layer kernel's arguments that are the same at every layer and step.
        self.consts = dict(
            HID=self.hidden, NH=self.nh, NKV=self.nkv, D=self.d, INTER=self.inter, QK_NORM=self.qk_norm,
            KS_O=self.ks_o, KS_D=self.ks_d, BM=_BM, BN=bn, BK=bk, BLOCK_SIZE=backend.kv_cache.shape[3],
            ABN=64 if self.d <= 128 else 32, BLOCK_S=triton.next_power_of_2(pairs),
            BLOCK_HID=triton.next_power_of_2(self.hidden), P=P, FIRST_ADD=2**31 - (P - 1),
            num_warps=num_warps, num_stages=3, launch_cooperative_grid=True, enable_fp_fusion=False,
        )  # fmt: skip
        self.sm_scale_log2 = backend.scale * 1.4426950408889634
        self.nbytes = sum(
            t.numel() * t.element_size()
            for t in (self.h, self.h_mid, self.xn, self.qkv, self.xo, self.act, self.o_part, self.down, self.part_o, self.part_lse, self.barrier)
        )

    def splits(self, rows: int) -> int:
        """Split-KV parts per (row, KV head): fill one wave of programs within the pair cap."""
        return max(1, min(self.programs // (rows * self.nkv), self.max_pairs // rows))

    def applies(self, input_ids: torch.Tensor, ctx: ForwardContext) -> bool:
        return ctx.backend is self.backend and ctx.meta.is_decode and 0 < input_ids.shape[0] <= self.max_rows

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, timing: torch.Tensor | None = None
    ) -> torch.Tensor:  # [M] int64, [M] int64 -> [M, hidden]; timing: [layers, P, 16] int64 (bench)
        from engine.models.layer_kernel import decoder_layer_kernel, finish_kernel

        lm, meta = self.lm, ctx.meta
        m = input_ids.shape[0]
        x = F.embedding(input_ids, lm.embed_tokens.weight)  # [M, hidden]
        self.barrier.zero_()
        kv = self.backend.kv_cache
        cos_sin = lm.rotary_emb.cos_sin_cache
        splits = self.splits(m)
        for i, layer in enumerate(lm.layers):
            attn, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            qkv_b = attn.qkv_proj.bias
            self.compiled = decoder_layer_kernel[(self.programs,)](
                x if i == 0 else self.h_mid, self.down, self.h, self.h_mid,
                layer.input_layernorm.weight, attn.qkv_proj.weight, qkv_b if qkv_b is not None else attn.qkv_proj.weight,
                attn.q_norm.weight if self.qk_norm else cos_sin, attn.k_norm.weight if self.qk_norm else cos_sin,
                attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                self.xn, self.qkv, positions, cos_sin, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.slot_mapping,
                self.part_o, self.part_lse, self.xo, self.o_part, self.act, self.down, self.barrier,
                timing[i] if timing is not None else self.barrier,
                m, splits, self.eps, self.sm_scale_log2, self.stride_part,
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
                HAS_QKV_BIAS=qkv_b is not None, KS_PREV=0 if i == 0 else self.ks_d, TIMING=timing is not None,
                **self.consts,
            )  # fmt: skip
        out = torch.empty(m, self.hidden, dtype=x.dtype, device=x.device)
        finish_kernel[(m,)](
            self.h_mid, self.down, lm.norm.weight, self.h, out, self.stride_part, m, self.eps,
            HID=self.hidden, KS_D=self.ks_d, BLOCK=self.consts["BLOCK_HID"], num_warps=4,
        )  # fmt: skip
        return out
