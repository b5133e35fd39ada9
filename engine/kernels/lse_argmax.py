"""Per-row log-sum-exp and argmax of x / t, x [B, V] logits (bf16, fp16 or fp32) and t [B] the
rows' temperatures, in one read of x: the sampler's logprobs (x / t - lse) and greedy tokens on
CUDA, and the greedy step's (token, its logprob) per row as the float64 pair the sampler copies
to the host, so a greedy step samples in one launch. torch's log_softmax runs one program per
row, 34 us for a batch-1 row of a 152k vocabulary on an H200, 60 us at batch 64
(bench/history/2026-11-23.md), and materializing x / t in fp32 cost another 43 us at
batch 64 (bench/history/2026-11-23.md); here each row is cut into CHUNK-wide pieces, one program each,
and the piece that finishes last merges the row. One launch: at batch 1 the step is host-bound,
and every Triton launch costs the host tens of microseconds. Only CUDA code paths import this
module (it imports Triton).

Rules: x / t is fp32(x) divided by t with IEEE rounding, torch's `logits / t` bit for bit. -inf
entries (banned tokens) count for nothing; a row of all -inf gets lse -inf. The argmax is the
first index of the row's maximum, as torch.argmax's. The token's logprob is fp32 x[token] / t
minus the fp32 lse, the sampler's torch ops' arithmetic. `counts` (int32, one per row, zero) is
the caller's to keep: the kernel leaves it zero again. On Hopper it launches with PDL
(engine/kernels/pdl.py) and waits before it reads or writes anything.

`merge_pieces`: the same answer when a kernel before already cut the rows into pieces (the
logits' epilogue, engine/kernels/logits_linear.py: a decode graph's logits of up to 64 rows), so
only the merge is left, one program per row: after the logits end, one load of a row's pieces
instead of a second read of its logits (bench/history/2026-11-28.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.launcher import Launcher
from engine.kernels.logits_linear import piece

# Columns per program, warps (bench/kernels/lse_argmax.py, H200, 152k vocabulary, bench/history/2026-11-24.md:
# 2048 against 1024, temperature 1: 4.4 / 5.5 / 13.7 / 43.7 us at 1 / 8 / 64 / 256 rows against
# 4.4 / 6.0 / 18.2 / 53.7; other temperatures 6.2 / 7.7 / 18.6 / 57.5 against 5.0 / 6.7 / 21.3 / 65.0).
CHUNK = 2048
WARPS = 4
# A decode graph's sampler above GRAPH_WIDE_ROWS rows: 4096 columns per program (bench/kernels/lse_argmax.py,
# H200, bench/history/2026-11-27.md, temperature 1: 5.79 / 6.65 / 11.31 us at 16 / 24 / 64 rows against
# 6.20 / 7.15 / 13.05 for 2048; 5.17 against 5.11 at 8 rows, 4.16 against 3.89 at one). A graph
# compiles its variant at capture, so the eager sampler's one-variant rule does not bind it.
GRAPH_WIDE_ROWS = 8
GRAPH_WIDE = (4096, 4)
_NO_ARG: tl.constexpr = tl.constexpr(2**62)  # above any column index


@triton.jit
def _over_t(x, t):
    # x / t with IEEE rounding, torch's; x / 1 is x, so rows of temperature 1 (greedy rows too)
    # skip the division, the kernel's arithmetic bound.
    if t != 1.0:
        x = tl.math.div_rn(x, t)
    return x


def graph_config(rows: int) -> tuple[int, int]:
    """(columns per program, warps) of a decode graph's sampler of `rows` rows."""
    return GRAPH_WIDE if rows > GRAPH_WIDE_ROWS else (CHUNK, WARPS)


@Launcher
@triton.jit
def _lse_argmax_kernel(
    x_ptr, t_ptr, max_ptr, sum_ptr, arg_ptr, count_ptr, lse_ptr, token_ptr, pair_ptr, V, stride_x,
    host_ptr, current_ptr, step_ptr,  # PUBLISH only
    CHUNKS: tl.constexpr, CHUNK_: tl.constexpr, BLOCK: tl.constexpr, HOST_STRIDE: tl.constexpr, PUBLISH: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, c): with x = logits[row, c*CHUNK : +CHUNK] / t[row], its max, sum of
    # exp(x - max) and first argmax; the row's last program to finish merges them (_merge_row).
    if USE_PDL:  # engine/kernels/pdl.py: scheduled while lm_head streams; everything below reads its output
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * CHUNK_ + tl.arange(0, CHUNK_)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    t = tl.load(t_ptr + row)
    x = _over_t(tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32), t)
    mx, total, arg = piece(x, 0)
    out = row * CHUNKS + c
    tl.store(max_ptr + out, mx)
    tl.store(sum_ptr + out, total)
    tl.store(arg_ptr + out, c * CHUNK_ + arg)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
        _merge_row(row, max_ptr, sum_ptr, arg_ptr, lse_ptr, token_ptr, pair_ptr, host_ptr, current_ptr, step_ptr, CHUNKS, BLOCK,
                   HOST_STRIDE, PUBLISH)  # fmt: skip
        tl.atomic_xchg(count_ptr + row, 0)


@triton.jit
def _merge_row(
    row, max_ptr, sum_ptr, arg_ptr, lse_ptr, token_ptr, pair_ptr, host_ptr, current_ptr, step_ptr,
    CHUNKS: tl.constexpr, BLOCK: tl.constexpr, HOST_STRIDE: tl.constexpr, PUBLISH: tl.constexpr,
):  # fmt: skip
    # Row `row`'s CHUNKS pieces (max m_c, sum s_c of exp(x - m_c), first argmax; [rows, CHUNKS]
    # each, written by other programs, so read from L2): lse = M + log(sum_c s_c * exp(m_c - M)),
    # token = the least argmax of the pieces holding the row's maximum M, pair [row] = (token,
    # x[token] - lse), where x[token] / t is M itself (the same division of the same element): no
    # second read of x. PUBLISH: the pair also into host slot (current & 1), and row 0 sets step
    # to current + 1.
    k = tl.arange(0, BLOCK)
    ok = k < CHUNKS
    m = tl.load(max_ptr + row * CHUNKS + k, mask=ok, other=float("-inf"), cache_modifier=".cg")
    s = tl.load(sum_ptr + row * CHUNKS + k, mask=ok, other=0.0, cache_modifier=".cg")
    top = tl.max(m, 0)
    top_shift = tl.where(top == float("-inf"), 0.0, top)
    lse = top_shift + tl.log(tl.sum(s * tl.exp(m - top_shift), 0))
    tl.store(lse_ptr + row, lse)
    # The first column holding M: the least argmax of the pieces holding it (pieces need not be
    # in column order: logits_linear's running pieces interleave); the first piece's if none does (NaN).
    first = tl.argmax(m, 0, tie_break_left=True)
    ties = tl.load(arg_ptr + row * CHUNKS + k, mask=ok & (m == top), other=_NO_ARG, cache_modifier=".cg")
    token = tl.min(ties, 0)
    token = tl.where(token == _NO_ARG, tl.load(arg_ptr + row * CHUNKS + first, cache_modifier=".cg"), token)
    tl.store(token_ptr + row, token)
    chosen = top
    tl.store(pair_ptr + row * 2, token.to(tl.float64))
    tl.store(pair_ptr + row * 2 + 1, (chosen - lse).to(tl.float64))
    if PUBLISH:
        replay = tl.load(current_ptr, cache_modifier=".cg")
        host = host_ptr + (replay & 1) * HOST_STRIDE + row * 2
        tl.store(host, token.to(tl.float64))
        tl.store(host + 1, (chosen - lse).to(tl.float64))
        if row == 0:  # nothing reads step again in this replay: the next one's gather will
            tl.store(step_ptr, replay + 1)


@Launcher
@triton.jit
def _merge_kernel(
    max_ptr, sum_ptr, arg_ptr, lse_ptr, token_ptr, pair_ptr, host_ptr, current_ptr, step_ptr,
    CHUNKS: tl.constexpr, BLOCK: tl.constexpr, HOST_STRIDE: tl.constexpr, PUBLISH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program row: _merge_row over pieces another kernel wrote (the logits' epilogue,
    # engine/kernels/logits_linear.py), once that kernel has ended.
    if USE_PDL:  # engine/kernels/pdl.py: scheduled while the logits stream; everything below reads their pieces
        tl.extra.cuda.gdc_wait()
    _merge_row(tl.program_id(0), max_ptr, sum_ptr, arg_ptr, lse_ptr, token_ptr, pair_ptr, host_ptr, current_ptr, step_ptr, CHUNKS,
               BLOCK, HOST_STRIDE, PUBLISH)  # fmt: skip


def lse_argmax(
    x: torch.Tensor, temperatures: torch.Tensor, counts: torch.Tensor | None = None,
    config: tuple[int, int] | None = None, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    publish: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [B, V] CUDA logits (half or float32, last dim contiguous), temperatures [B] float32 ->
    (lse [B] float32, argmax [B] int64, pairs [B, 2] float64: the argmax and its logprob) of
    x / t. counts: int32 zeros, at least B (module docstring); None allocates them. config:
    (columns per program, warps) in place of (CHUNK, WARPS) (bench/kernels/lse_argmax.py). out:
    those three written in place (a graph's static buffers). publish: (host [2, >= B, 2] float64,
    pinned; current [1] int32, this replay's number; step [1] int32): the pairs also go to
    host[current & 1], and step becomes current + 1 (engine/runner/graph_io.py)."""
    if x.dim() != 2 or not x.dtype.is_floating_point or not x.is_cuda or x.stride(1) != 1:
        raise ValueError(f"lse_argmax: CUDA [B, V] logits with contiguous rows, got {tuple(x.shape)} {x.dtype}")
    rows, vocab = x.shape
    if temperatures.shape != (rows,) or temperatures.dtype != torch.float32:
        raise ValueError(f"lse_argmax: temperatures must be float32 [{rows}], got {tuple(temperatures.shape)} {temperatures.dtype}")
    chunk, num_warps = config or (CHUNK, WARPS)
    chunks = triton.cdiv(vocab, chunk)
    if counts is None:
        counts = torch.zeros(rows, dtype=torch.int32, device=x.device)
    # Two allocations, not halves of one: the second half's address would be 16-byte aligned or
    # not with rows * chunks, a new Triton specialization (a compile while serving) for some rows.
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    args = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    if out is None:
        out = (
            torch.empty(rows, dtype=torch.float32, device=x.device),
            torch.empty(rows, dtype=torch.int64, device=x.device),
            torch.empty(rows, 2, dtype=torch.float64, device=x.device),
        )
    lse, tokens, pairs = out
    host, current, step = publish if publish is not None else (pairs, counts, counts)
    if publish is not None and (host.dim() != 3 or host.shape[0] != 2 or host.shape[1] < rows or host.dtype != torch.float64):
        raise ValueError(f"lse_argmax: publish needs a [2, >= {rows}, 2] float64 host buffer, got {tuple(host.shape)}")
    use_pdl = pdl.enabled(x.device)
    if rows:
        _lse_argmax_kernel[(rows, chunks)](
            x, temperatures, maxima, sums, args, counts, lse, tokens, pairs, vocab, x.stride(0), host, current, step,
            CHUNKS=chunks, CHUNK_=chunk, BLOCK=triton.next_power_of_2(chunks),
            HOST_STRIDE=host.stride(0) if publish is not None else 0, PUBLISH=publish is not None,
            USE_PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
        )  # fmt: skip
    return lse, tokens, pairs


def merge_pieces(
    pieces: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    publish: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:  # fmt: skip
    """`lse_argmax`'s answer, published, from pieces of x / t another kernel wrote: (maxima [B, C]
    float32, sums of exp(x - max) [B, C] float32, first argmaxes [B, C] int64) of C column sets per
    row, in any order (logits_linear's epilogue). out and publish as lse_argmax's; one
    program per row, launched with PDL on Hopper (it waits for the pieces' kernel to end)."""
    maxima, sums, args = pieces
    rows, chunks = maxima.shape
    lse, tokens, pairs = out
    host, current, step = publish
    if not (maxima.is_contiguous() and sums.is_contiguous() and args.is_contiguous() and sums.shape == args.shape == maxima.shape):
        raise ValueError(f"merge_pieces: contiguous [B, C] pieces of one shape, got {[tuple(t.shape) for t in pieces]}")
    use_pdl = pdl.enabled(maxima.device)
    if rows:
        _merge_kernel[(rows,)](
            maxima, sums, args, lse, tokens, pairs, host, current, step,
            CHUNKS=chunks, BLOCK=triton.next_power_of_2(chunks), HOST_STRIDE=host.stride(0), PUBLISH=True,
            USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
        )  # fmt: skip
