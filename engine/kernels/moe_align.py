"""Token-to-expert sort and align for the grouped GEMMs of engine/kernels/fused_moe.py (vLLM's and
SGLang's `moe_align_block_size`, our own Triton kernels). Only CUDA code paths import this module.

A (token, slot) pair p = t * k + j of topk_ids [T, k] goes to expert topk_ids[t, j]. The pairs
are grouped by expert and each expert's group is padded to whole BLOCK_M tiles:

    sorted_ids [capacity] int32   pair ids, expert 0's first; a padding slot holds P = T * k
    expert_ids [blocks] int32     the expert of each BLOCK_M tile of sorted_ids
    num_padded [1] int32          slots in use: sum over experts of ceil(count / BLOCK_M) * BLOCK_M

Rules:
- Deterministic: within an expert the pairs are in increasing pair id (token order). Only the
  first num_padded slots and num_padded / BLOCK_M tiles are written; what lies past them is
  left from earlier calls and must not be read (the GEMMs' programs past num_padded return).
- No allocation and no host read of a device value: `AlignBuffers` are allocated once for the
  most pairs and the largest BLOCK_M, and every call of fewer pairs writes into their front. The
  grids depend on P and E only: CUDA-graph capturable, one buffer set for every captured size.
- `max_blocks(P, E, BLOCK_M)` bounds the tiles: experts with pairs are at most min(E, P), each
  with less than one tile of padding. A decode step's GEMM grid scales with P, never with E.
- Up to ONE_PROGRAM_CHUNKS chunks of pairs (decode steps), one program does it all in one
  launch; above, three launches: per-chunk counts (one program a chunk), one program for the
  prefix sums over chunks and experts, then the scatter (one program a chunk).
- topk_ids values must lie in [0, E); ids are read as int32 or int64. With expert parallelism
  (`first`), they are the model's ids: this rank's experts first .. first + E - 2 sort into
  buckets 0 .. E - 2 and every other expert into the last bucket, E - 1 (constexprs FIRST and
  HELD; HELD 0 compiles the kernels as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.launcher import Launcher

BLOCK_MS = (16, 32, 64, 128)  # the tile heights the grouped GEMMs use (fused_moe.py's configs)
ONE_PROGRAM_CHUNKS = 8


def chunk_pairs(num_experts: int) -> int:
    """Pairs per chunk: a [chunk, E] one-hot of about 8k int32 values in one program (16k spill
    registers on sm_90)."""
    return max(32, min(1024, 8192 // triton.next_power_of_2(num_experts)))


def max_padded(pairs: int, num_experts: int, block_m: int) -> int:
    """Most slots the sorted ids of `pairs` pairs can take (a multiple of block_m)."""
    slots = pairs + min(num_experts, pairs) * (block_m - 1)
    return triton.cdiv(slots, block_m) * block_m


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    return max_padded(pairs, num_experts, block_m) // block_m


@dataclass
class AlignBuffers:
    """The sort's outputs and scratch for up to `max_pairs` pairs over `num_experts` experts."""

    max_pairs: int
    num_experts: int
    sorted_ids: torch.Tensor  # [max over BLOCK_MS of max_padded] int32
    expert_ids: torch.Tensor  # [max over BLOCK_MS of max_blocks] int32
    num_padded: torch.Tensor  # [1] int32
    chunk_base: torch.Tensor  # [chunks, E_pad] int32: per chunk, counts, then where its pairs start

    @classmethod
    def allocate(cls, max_pairs: int, num_experts: int, device: torch.device | str) -> AlignBuffers:
        slots = max(max_padded(max_pairs, num_experts, b) for b in BLOCK_MS)
        blocks = max(max_blocks(max_pairs, num_experts, b) for b in BLOCK_MS)
        chunks = max(1, triton.cdiv(max_pairs, chunk_pairs(num_experts)))
        i32 = dict(dtype=torch.int32, device=device)
        return cls(max_pairs, num_experts, torch.zeros(slots, **i32), torch.zeros(blocks, **i32),
                   torch.zeros(1, **i32), torch.zeros(chunks, triton.next_power_of_2(num_experts), **i32))  # fmt: skip


# ---- helpers: a chunk's one-hot, and what the per-expert counts decide ------------------------------


@triton.jit
def held_bucket(ids, FIRST: tl.constexpr, HELD: tl.constexpr):
    """The model's expert ids -> this rank's bucket: FIRST .. FIRST + HELD - 1 to 0 .. HELD - 1,
    another rank's expert to HELD (expert parallelism)."""
    local = ids - FIRST
    return tl.where((local >= 0) & (local < HELD), local, HELD)


@triton.jit
def _chunk(ids_ptr, c, P, CH: tl.constexpr, E_PAD: tl.constexpr, FIRST: tl.constexpr, HELD: tl.constexpr):
    """Pair ids [CH] of chunk c, their mask, experts and one-hot over the experts [CH, E_PAD]."""
    p = c * CH + tl.arange(0, CH)
    ok = p < P
    ids = tl.load(ids_ptr + p, mask=ok, other=E_PAD).to(tl.int32)  # masked: matches no expert
    if HELD > 0:  # the model's ids
        ids = tl.where(ok, held_bucket(ids, FIRST, HELD), E_PAD)
    onehot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    return p, ok, ids, onehot


@triton.jit
def _rank_in_chunk(onehot):
    """[CH] for each pair: how many pairs before it in the chunk go to its expert."""
    return tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)


@triton.jit
def _layout(counts, sorted_ptr, expert_ids_ptr, num_padded_ptr, P, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """From the pairs per expert [E_PAD]: writes num_padded, each tile's expert and the padding
    slots' sentinel P; returns where each expert's slots start [E_PAD]."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # tile b belongs to the expert e with starts[e] <= b * BLOCK_M < ends[e]: the count of ends <= it
    for b0 in range(0, total // BLOCK_M, 128):
        b = b0 + tl.arange(0, 128)
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, owner, mask=b < total // BLOCK_M)
    # padding: the slots [starts + counts, starts + padded) of each expert
    j = tl.arange(0, BLOCK_M)[None, :]
    pad = (starts + counts)[:, None] + j
    tl.store(sorted_ptr + pad, tl.full((E_PAD, BLOCK_M), 0, tl.int32) + P, mask=j < (padded - counts)[:, None])
    return starts


# ---- kernels ---------------------------------------------------------------------------------------


@Launcher
@triton.jit(do_not_specialize=["P", "num_chunks"])
def _align_one_kernel(
    ids_ptr,  # [P] expert of each pair
    sorted_ptr, expert_ids_ptr, num_padded_ptr,
    P, num_chunks,
    BLOCK_M: tl.constexpr, CH: tl.constexpr, E_PAD: tl.constexpr, FIRST: tl.constexpr, HELD: tl.constexpr,
):  # fmt: skip
    # One program: count, lay out, then scatter each chunk after the pairs of the chunks before it.
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(0, num_chunks):
        _, _, _, onehot = _chunk(ids_ptr, c, P, CH, E_PAD, FIRST, HELD)
        counts += tl.sum(onehot, axis=0)
    base = _layout(counts, sorted_ptr, expert_ids_ptr, num_padded_ptr, P, BLOCK_M, E_PAD)
    for c in range(0, num_chunks):
        p, ok, _, onehot = _chunk(ids_ptr, c, P, CH, E_PAD, FIRST, HELD)
        pos = tl.sum(onehot * base[None, :], axis=1) + _rank_in_chunk(onehot)
        tl.store(sorted_ptr + pos, p, mask=ok)
        base += tl.sum(onehot, axis=0)


@Launcher
@triton.jit(do_not_specialize=["P"])
def _align_count_kernel(ids_ptr, chunk_base_ptr, P, CH: tl.constexpr, E_PAD: tl.constexpr, FIRST: tl.constexpr,
                        HELD: tl.constexpr):  # fmt: skip
    c = tl.program_id(0)
    _, _, _, onehot = _chunk(ids_ptr, c, P, CH, E_PAD, FIRST, HELD)
    tl.store(chunk_base_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@Launcher
@triton.jit(do_not_specialize=["P", "num_chunks"])
def _align_scan_kernel(
    chunk_base_ptr,  # [num_chunks, E_PAD]: counts in; the slot of each chunk's first pair per expert out
    sorted_ptr, expert_ids_ptr, num_padded_ptr,
    P, num_chunks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, E_PAD)[None, :]
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BC):
        rows = c0 + tl.arange(0, BC)[:, None]
        counts += tl.sum(tl.load(chunk_base_ptr + rows * E_PAD + e, mask=rows < num_chunks, other=0), axis=0)
    carry = _layout(counts, sorted_ptr, expert_ids_ptr, num_padded_ptr, P, BLOCK_M, E_PAD)
    for c0 in range(0, num_chunks, BC):
        rows = c0 + tl.arange(0, BC)[:, None]
        tile = tl.load(chunk_base_ptr + rows * E_PAD + e, mask=rows < num_chunks, other=0)
        tl.store(chunk_base_ptr + rows * E_PAD + e, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=rows < num_chunks)
        carry += tl.sum(tile, axis=0)


@Launcher
@triton.jit(do_not_specialize=["P"])
def _align_scatter_kernel(ids_ptr, chunk_base_ptr, sorted_ptr, P, CH: tl.constexpr, E_PAD: tl.constexpr,
                          FIRST: tl.constexpr, HELD: tl.constexpr):  # fmt: skip
    c = tl.program_id(0)
    p, ok, ids, onehot = _chunk(ids_ptr, c, P, CH, E_PAD, FIRST, HELD)
    base = tl.load(chunk_base_ptr + c * E_PAD + ids, mask=ok, other=0)
    tl.store(sorted_ptr + base + _rank_in_chunk(onehot), p, mask=ok)


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int32/int64, values in [0, num_experts)
    num_experts: int,
    block_m: int,  # one of BLOCK_MS
    buffers: AlignBuffers | None = None,  # preallocated for at least T * k pairs; None: fresh ones
    first: int | None = None,  # expert parallelism: the ids are the model's, this rank's from `first`
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32, expert_ids [max_blocks] int32, num_padded [1] int32): views
    of `buffers`' fronts, valid up to num_padded (see the module docstring)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be an int32/int64 [T, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if block_m not in BLOCK_MS:
        raise ValueError(f"moe_align: block_m {block_m} is not one of {BLOCK_MS}")
    pairs = topk_ids.numel()
    if buffers is None:
        buffers = AlignBuffers.allocate(pairs, num_experts, topk_ids.device)
    elif buffers.num_experts != num_experts or buffers.max_pairs < pairs:
        raise ValueError(f"moe_align: buffers for {buffers.max_pairs} pairs of {buffers.num_experts} experts, "
                         f"called with {pairs} of {num_experts}")  # fmt: skip
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    sorted_ids = buffers.sorted_ids[: max_padded(pairs, num_experts, block_m)]
    expert_ids = buffers.expert_ids[: max_blocks(pairs, num_experts, block_m)]
    if pairs == 0:
        buffers.num_padded.zero_()
        return sorted_ids, expert_ids, buffers.num_padded
    ch, e_pad = chunk_pairs(num_experts), triton.next_power_of_2(num_experts)
    held = dict(FIRST=first or 0, HELD=0 if first is None else num_experts - 1)
    chunks = triton.cdiv(pairs, ch)
    warps = 8 if ch * e_pad >= 4096 else 4
    if chunks <= ONE_PROGRAM_CHUNKS:
        _align_one_kernel[(1,)](
            ids, sorted_ids, expert_ids, buffers.num_padded, pairs, chunks,
            BLOCK_M=block_m, CH=ch, E_PAD=e_pad, **held, num_warps=warps,
        )  # fmt: skip
        return sorted_ids, expert_ids, buffers.num_padded
    _align_count_kernel[(chunks,)](ids, buffers.chunk_base, pairs, CH=ch, E_PAD=e_pad, **held, num_warps=warps)
    _align_scan_kernel[(1,)](
        buffers.chunk_base, sorted_ids, expert_ids, buffers.num_padded, pairs, chunks,
        BLOCK_M=block_m, E_PAD=e_pad, BC=max(1, 8192 // e_pad), num_warps=8,
    )  # fmt: skip
    _align_scatter_kernel[(chunks,)](ids, buffers.chunk_base, sorted_ids, pairs, CH=ch, E_PAD=e_pad, **held,
                                     num_warps=warps)  # fmt: skip
    return sorted_ids, expert_ids, buffers.num_padded
