"""The gather of a decode graph's staged step (engine/runner/graph_io.py has the staging ring's
layout and rules): one program per row copies the row's staged token, position, slot, length,
temperature and block-table row from the pinned ring into the graph's static inputs.

A staged row, int32 [ROW]: token, source row of a pending token or -1, position, KV slot,
sequence length, the step's table width, temperature as float32 bits, one unused; then the block
tables [MAX_BS, MAXB] of the slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COLUMNS = 7  # token, source, position, slot, sequence length, table width, temperature bits
ROW = 8  # int32 per staged row: the columns, then one unused
_ROW: tl.constexpr = tl.constexpr(ROW)
_TABLE_CHUNK = 64  # table entries a gather program reads at once (1024 tokens at block 16)


@triton.jit
def _gather_kernel(
    stage_ptr,  # [2, SLOT] int32, pinned: the staging ring
    step_ptr,  # [2] int32: graph replays so far (the slot is its parity), then current
    tokens_ptr,  # [>= max_num_seqs] int64: the last step's sampled tokens
    inputs_ptr,  # [2, MAX_BS] int64: the graph's token ids, positions
    slots_ptr, lens_ptr, temps_ptr,  # [MAX_BS] int64 / int32 / float32
    tables_ptr,  # [MAX_BS, MAXB] int32
    MAX_BS: tl.constexpr, MAXB: tl.constexpr, SLOT: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # Program r: row r of the staged step into the graph's static inputs; program 0 also copies
    # step to current, which the sampler reads (it sets step for the next replay). Row r of both
    # slots, the replay count and the row's usual pending token (row r of the last step's) are
    # read at once: no host read waits for a device read. No early trigger (engine/kernels/pdl.py): the
    # model's first kernel, launched with PDL, starts as this one ends.
    r = tl.program_id(0)
    replay = tl.load(step_ptr, cache_modifier=".cg")
    two = tl.arange(0, 2)
    cols = tl.arange(0, _ROW)
    both = tl.load(stage_ptr + two[None, :] * SLOT + r * _ROW + cols[:, None])  # [ROW, 2]
    tcols = tl.arange(0, CHUNK)
    row_in = stage_ptr + _ROW * MAX_BS + r * MAXB
    firsts = tl.load(row_in + two[:, None] * SLOT + tcols[None, :], mask=tcols[None, :] < MAXB)  # [2, CHUNK]
    usual = tl.load(tokens_ptr + r)
    if r == 0:
        tl.store(step_ptr + 1, replay)
    parity = replay & 1
    row = tl.sum(tl.where(two[None, :] == parity, both, 0), axis=1)  # [ROW]: this replay's slot
    token = tl.sum(tl.where(cols == 0, row, 0)).to(tl.int64)
    source = tl.sum(tl.where(cols == 1, row, 0))
    position = tl.sum(tl.where(cols == 2, row, 0))
    slot = tl.sum(tl.where(cols == 3, row, 0))
    length = tl.sum(tl.where(cols == 4, row, 0))
    width = tl.sum(tl.where(cols == 5, row, 0))
    temp = tl.sum(tl.where(cols == 6, row, 0)).to(tl.float32, bitcast=True)
    first = tl.sum(tl.where(two[:, None] == parity, firsts, 0), axis=0)  # [CHUNK]
    if source == r:
        token = usual
    elif source >= 0:
        token = tl.load(tokens_ptr + source)
    row_out = tables_ptr + r * MAXB
    tl.store(inputs_ptr + r, token)
    tl.store(inputs_ptr + MAX_BS + r, position.to(tl.int64))
    tl.store(slots_ptr + r, slot.to(tl.int64))
    tl.store(lens_ptr + r, length)
    tl.store(temps_ptr + r, temp)
    tl.store(row_out + tcols, first, mask=tcols < width)
    base = row_in + parity * SLOT
    for c0 in range(CHUNK, width, CHUNK):
        ok = c0 + tcols < width
        tl.store(row_out + c0 + tcols, tl.load(base + c0 + tcols, mask=ok), mask=ok)


def gather(
    bs: int, stage: torch.Tensor, counters: torch.Tensor, tokens: torch.Tensor, inputs: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, temps: torch.Tensor, block_tables: torch.Tensor, slot_elements: int,
) -> None:  # fmt: skip
    """Rows 0..bs-1 of the staged step (stage [2, slot_elements] int32) into the static inputs:
    inputs [2, MAX_BS] int64 (tokens, positions), slot_mapping / seq_lens / temps [MAX_BS],
    block_tables [MAX_BS, MAXB]; counters [2] int32 (replays, current); tokens the last step's."""
    max_bs, max_blocks = block_tables.shape
    _gather_kernel[(bs,)](
        stage, counters, tokens, inputs, slot_mapping, seq_lens, temps, block_tables,
        MAX_BS=max_bs, MAXB=max_blocks, SLOT=slot_elements,
        CHUNK=min(_TABLE_CHUNK, triton.next_power_of_2(max_blocks)), num_warps=1,
    )  # fmt: skip
