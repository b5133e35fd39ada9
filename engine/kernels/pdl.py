"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels,
and the L2 prefetch that makes it pay. Only CUDA code paths import this module (it imports Triton).

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still running, once every program of that one has called `gdc_launch_dependents` (or exited).
Rules for every kernel launched so:
- It calls `gdc_wait()` before it reads anything an earlier kernel writes, or writes anything an
  earlier kernel reads (the wait returns once the previous grid has finished and its memory is
  visible; waits chain, so every earlier kernel has finished too).
- Before the wait it only reads what no kernel of the step writes: weights. The skinny GEMVs pull
  the first columns of their weight rows into L2 there, while the previous kernel (often the
  cross-rank reduce, which waits on NVLink with one program per row) still runs.
- It calls `gdc_launch_dependents()` early: the next kernel's programs then get scheduled while
  this one streams, and wait themselves.
Any kernel may call `gdc_launch_dependents()` early, launched with PDL or not: what it releases
waits for it anyway. Who does what in a decode layer:
- PDL launch, wait, trigger: the RMSNorm (kernels/fused_ops.py), a short kernel that leaves HBM
  mostly idle; its programs are scheduled while the GEMV before it ends (Qwen3-8B shape, batch 1:
  4.77 -> 4.70 ms a step; bench/history/2026-11-25.md);
- wait, trigger: the cross-rank reduce (kernels/tp_reduce.py), the same at TP > 1;
- PDL launch, prefetch, wait, trigger: the GEMVs after them (qkv, gate_up: kernels/skinny_linear.py
  `prefetch=True`), and the logits of a few rows after the final norm (models/llama.py
  `compute_logits`). The other GEMVs launch plainly, measured (bench/history/2026-11-23.md):
  down_proj follows gate_up's GEMV, whose bandwidth a prefetch would only take; o_proj after the
  attention kernels made both TP=1 and TP=2 steps slower. Launched with PDL but no prefetch,
  the two made the 8B batch-1 step slower too (4.77 -> 5.11 ms; bench/history/2026-11-25.md).
- `--deterministic`: the invariant GEMMs after a norm (qkv, gate_up, the lm_head:
  kernels/invariant_matmul.py `prefetch=True`), as the skinny GEMVs above.
- A mixture-of-experts layer of few tokens: its router after the post-attention norm
  (kernels/moe_router.py `prefetch=True`: the whole router weight, 0.5 MB at 128 x 2048), as the
  skinny GEMVs above. The expert GEMMs after it (kernels/fused_moe.py, one tile a pair) launch
  with PDL and wait first, prefetching nothing: which weights they read is the router's answer.
  The down GEMM triggers right after its wait: the next layer's norm and qkv GEMV get placed,
  and the GEMV prefetches, while it streams.
- PDL launch, wait: the sampler's read of the logits (kernels/lse_argmax.py), scheduled while the
  lm_head streams.
- The layers' decode attention (decode/decode_attention.py `DecodeAttention`: rope, K/V store and
  split-KV attention in one kernel) launches with PDL after the qkv GEMV (or its split-K parts): it reads the step's
  metadata and the rope table, prefetches its first K/V tile into L2, waits and triggers.
- In the one-kernel-per-layer decode (kernels/layer_kernel.py): every layer's launch waits after
  its attention prologue (the next layer's KV loads) and triggers after its o_proj. Inside it and
  the batch decode's persistent kernel, `prefetch_l2` also pulls a GEMV phase's first weights
  into L2 behind the barrier before it (kernels/grid_phases.py `prefetch_items`).
- In the batch decode (decode/batch_decode.py): the persistent kernel triggers before its qkv
  phase; the split-KV attention kernel after it (kernels/rope_decode.py) launches with PDL,
  reads the step's metadata (uploaded before any kernel ran) and the rope table, prefetches its
  first K/V tile into L2, waits and triggers (no kernel before it writes the cache: it stores
  the new K/V rows itself);
  the next persistent kernel launches with PDL too and waits first, so its programs take the
  SMs the attention programs leave (forward at 64 rows 1.845 -> 1.817 ms; bench/history/2026-11-24.md).
  The step's first persistent kernel launches plainly: the attention after it reads the
  metadata that the kernel before it (a graph's gather) writes (launched with PDL, waiting first:
  0.6B at 64 rows the same, 8B at 64 rows 14-69 us slower in four pairs; bench/history/2026-11-28.md).
  The one-row decode's layer 0, whose own prologue reads that metadata, launches with PDL and
  waits before its prologue (0-3 us faster a step). The gather triggers no early launch: with
  it, layer 0's programs were placed beside the gather's and the one-row step ran 70 us slower.
  Where that attention splits the KV it merges the splits itself: a reduce launched between the
  two would hold the persistent kernel until the reduce ended (5..24 rows; bench/history/2026-11-24.md).
  `--deterministic`'s batch decode the same way: its fixed-split attention kernels
  (kernels/attention_fixed.py `use_pdl`, steps of 5-64 rows) launch with PDL, wait (the
  one-token-a-program kernel after reading the step's metadata) and trigger (0.6B, H200: the mode's step at 8 / 16 / 64 rows 1.235 / 1.423 /
  2.009 -> 1.198 / 1.389 / 1.989 ms; bench/history/2026-12-01.md, entry k).
Captured into CUDA graphs, these become programmatic edges; replays keep the overlap.

`--no-pdl` (engine/kernels SWITCHES.pdl) turns it off: every launch is an ordinary stream-ordered one.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import SWITCHES

# Bytes of a weight pulled into L2 before the wait, in all: what HBM streams in the ~4 us of a norm or
# a cross-rank reduce of few rows; a third of a Hopper GPU's L2.
PREFETCH_BYTES = 16 << 20
LINE_BYTES = 128  # one prefetch a line


def prefetch_lines(weight_bytes: int, k: int, line: int) -> int:
    """Lines to prefetch from the start of each weight row's span of k elements (`line` elements
    a line; the span a program reads: the row, or its chunk of K): a power of two (0 for none), at
    most the span's, PREFETCH_BYTES over a whole weight of `weight_bytes`."""
    lines = min(k // line, PREFETCH_BYTES * (k // line) // max(1, weight_bytes))
    return 0 if lines < 1 else 1 << (lines.bit_length() - 1)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: compute capability 9.0 or more, not disabled."""
    return SWITCHES.pdl and device.type == "cuda" and _capable(device.index or 0)


@triton.jit
def prefetch_l2(ptrs):
    # One `prefetch.global.L2` per element of ptrs (give one address per 128-byte line).
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
