"""`GraphIO`: what a decode graph reads from the host and writes back to it without a copy engine.
Pinned host memory is mapped into the device's address space (UVA), so the graph's first kernel
reads the step's inputs where the host packed them, and its last kernel (the sampler's
`lse_argmax`, engine/kernels/lse_argmax.py) writes each row's (token, logprob) where the host reads
them. Only CUDA code paths import this module (it imports Triton).

Why: outside its graph a decode step spent ~60 us of device time at batch 64 and ~35 us at batch
1 on copy-engine transfers queued between kernels (the upload, its int32 cast, the pending tokens'
copy, the graph's static inputs, the sampler's upload, the results' copy; 5-13 us each:
bench/history/2026-11-25.md), and the host as long again launching them.

Rules:
- Two staging slots and two result slots (a ring, as engine/runner/pinned.py's): step k uses
  slot k % 2, counted in graph replays. The host counts them here; the device counts them in
  `step` (int32): the gather kernel reads it to pick its slot and copies it to `current`, from
  which the sampler's kernel picks its result slot and sets `step` to current + 1 (no atomics:
  nothing reads `step` between those two kernels). Both counts start at 0 after capture and
  after a resume of the `cuda_graph` region (`reset`).
- A slot is written again only once the replay that used it last has finished (its event), and
  the engine reads step k's results before it launches step k + 2 (engine/core/engine_core.py).
- A staging slot, int32: rows [max_bs, ROW] (token, source row of a pending token or -1,
  position, KV slot, sequence length, the step's table width, temperature as float32 bits, one
  unused: a row is 32 contiguous bytes, so the gather reads it from pinned memory at once), then
  block tables [max_bs, max_blocks], each row padded with block 0 to the step's widest (no static
  table row keeps a stale entry within that width). Rows past the step's are padding: token 0 at
  position 0, slot -1, length 0, width 0 (their table rows untouched), temperature 1.
- A pending token (one the host does not know yet) is row `source` of `tokens`, the device's
  copy of the last step's sampled tokens: the graph's sampler writes it, an eager step's sampler
  output is copied into it (`keep`).
"""

from __future__ import annotations

from array import array

import torch

from engine.kernels import graph_gather
from engine.kernels.graph_gather import COLUMNS, ROW
from engine.runner.sampler import SampledOnDevice


class GraphIO:
    """The staging and result rings of the decode graphs of up to `max_bs` rows, and the static
    tensors the gather kernel fills: `inputs` [2, max_bs] int64 (token ids, positions), the
    attention backend's `seq_lens`, `block_tables`, `slot_mapping` (its graph buffers, at their
    largest), `temps` [max_bs] float32. Sampler outputs: `tokens` [max_rows] int64, `lse`
    [max_bs] float32, `pairs` [max_bs, 2] float64 on the device, `results` [2, max_bs, 2] float64
    pinned."""

    def __init__(
        self, inputs: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor,
        max_rows: int, max_pieces: int = 0,  # the most (row, piece) pairs of any graph's logits
    ) -> None:  # fmt: skip
        self.max_bs, self.max_blocks = block_tables.shape
        self.device = inputs.device
        self.inputs, self.seq_lens, self.block_tables, self.slot_mapping = inputs, seq_lens, block_tables, slot_mapping
        dev = self.device
        self.temps = torch.ones(self.max_bs, dtype=torch.float32, device=dev)
        self.tokens = torch.zeros(max(max_rows, self.max_bs), dtype=torch.int64, device=dev)
        self.lse = torch.zeros(self.max_bs, dtype=torch.float32, device=dev)
        self.pairs = torch.zeros(self.max_bs, 2, dtype=torch.float64, device=dev)
        # The sampler's pieces the logits write (lse_argmax.merge_pieces): [bs, pieces] each, at most
        # max_pieces in all (the model's logits_pieces times the rows, over the graphs; 0: none).
        self.maxima = torch.zeros(max_pieces, dtype=torch.float32, device=dev)
        self.sums = torch.zeros_like(self.maxima)
        self.args = torch.zeros(max_pieces, dtype=torch.int64, device=dev)
        # step (replays before this one), current (this replay's), then lse_argmax's per-row counters
        self.counters = torch.zeros(2 + self.max_bs, dtype=torch.int32, device=dev)
        self.slot_elements = ROW * self.max_bs + -(-self.max_bs * self.max_blocks // 4) * 4  # 16-byte slots
        self.stage = torch.zeros(2, self.slot_elements, dtype=torch.int32, pin_memory=True)
        self.results = torch.zeros(2, self.max_bs, 2, dtype=torch.float64, pin_memory=True)
        # [2, COLUMNS, max_bs]: each column a strided view of the rows
        self._columns = self.stage[:, : ROW * self.max_bs].view(2, self.max_bs, ROW)[:, :, :COLUMNS].transpose(1, 2)
        self._temps = self._columns[:, 6].view(torch.float32)  # [2, max_bs]
        self._tables = self.stage[:, ROW * self.max_bs : ROW * self.max_bs + self.max_bs * self.max_blocks]
        self._tables = self._tables.view(2, self.max_bs, self.max_blocks)
        self._padding = torch.tensor([0, -1, 0, -1, 0, 0, 0], dtype=torch.int32)[:, None].repeat(1, self.max_bs)
        self._padding[6] = torch.ones(self.max_bs, dtype=torch.float32).view(torch.int32)
        for p in range(2):
            self._pad(p, 0)
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._used = [False, False]
        self.replays = 0  # the host's count; the device's is counters[0]
        self.nbytes = sum(
            t.numel() * t.element_size()
            for t in (self.temps, self.tokens, self.lse, self.pairs, self.counters, self.maxima, self.sums, self.args)
        )
        self.pinned_bytes = self.stage.numel() * 4 + self.results.numel() * 8

    def _pad(self, p: int, n: int) -> None:
        """Rows n.. of staging slot p become padding (module docstring)."""
        self._columns[p, :, n:] = self._padding[:, : self.max_bs - n]

    def reset(self) -> None:
        """Replays counted from zero again, on the host and on the device (after capture, whose
        warm-up forwards advance the device's count, and after a resume of the `cuda_graph`
        region, which comes back with undefined contents)."""
        self.counters.zero_()
        self.replays = 0

    # ---- captured ---------------------------------------------------------------------------------

    def gather(self, bs: int) -> None:
        """Rows 0..bs-1 of the staged step into the static inputs: the graph's first kernel."""
        graph_gather.gather(
            bs, self.stage, self.counters, self.tokens, self.inputs, self.slot_mapping, self.seq_lens, self.temps,
            self.block_tables, self.slot_elements,
        )  # fmt: skip

    def lse_pieces(self, bs: int, pieces: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the logits of `bs` rows write the sampler's `pieces` pieces a row with (the model's
        compute_logits `lse`): the rows' temperatures, then [bs, pieces] maxima, sums, argmaxes."""
        n = bs * pieces
        if n > self.maxima.numel():
            raise ValueError(f"GraphIO holds {self.maxima.numel()} sampler pieces, not {bs} x {pieces}")
        return self.temps[:bs], *(t[:n].view(bs, pieces) for t in (self.maxima, self.sums, self.args))

    def sample(self, logits: torch.Tensor, pieces: int = 0) -> None:
        """The greedy (token, logprob) of logits [bs, V] / temps, published to this replay's
        result slot; the graph's last kernel (it advances the device's replay count). pieces > 0:
        the logits wrote that many pieces a row (lse_pieces), so only their merge is left."""
        from engine.kernels.lse_argmax import graph_config, lse_argmax, merge_pieces

        bs = logits.shape[0]
        out = (self.lse[:bs], self.tokens[:bs], self.pairs[:bs])
        publish = (self.results, self.counters[1:2], self.counters[:1])
        if pieces:
            merge_pieces(self.lse_pieces(bs, pieces)[1:], out, publish)
        else:
            lse_argmax(logits, self.temps[:bs], self.counters[2:], config=graph_config(bs), out=out, publish=publish)

    # ---- the host's side --------------------------------------------------------------------------

    def stage_step(self, parts: list[list[int]], temps: list[float], n: int, bs: int) -> int:
        """Pack a decode step of n rows (a StepPlan's `parts`: ids, positions, sample rows, pending
        rows and their sources, slots, query starts, lengths, tables padded to the widest and
        flattened) and its temperatures into the next slot, rows n..bs-1 padding; returns the
        slot, which the replay after this call reads."""
        p = self.replays % 2
        if self._used[p]:
            self._events[p].synchronize()  # the replay of two steps ago: long done in a running loop
        ids, positions, _, fill_rows, fill_from, slots, _, lens, tables = parts
        sources = [-1] * n
        for row, src in zip(fill_rows, fill_from, strict=True):
            sources[row] = src
        width = len(tables) // n
        packed = array("i", ids)
        for column in (sources, positions, slots, lens, [width] * n):
            packed.extend(column)
        self._columns[p, :6, :n].copy_(torch.frombuffer(packed, dtype=torch.int32).view(6, n))
        self._temps[p, :n].copy_(torch.frombuffer(array("f", temps), dtype=torch.float32))
        if width:
            self._tables[p, :n, :width].copy_(torch.frombuffer(array("i", tables), dtype=torch.int32).view(n, width))
        if bs > n:
            self._pad(p, n)
        return p

    def replayed(self, p: int) -> None:
        """Count the replay just queued, which used slot p, and mark its end."""
        self._events[p].record(torch.cuda.current_stream(self.device))
        self._used[p] = True
        self.replays += 1

    def landed(self, p: int, n: int) -> SampledOnDevice:
        """The greedy samples of the replay that used slot p, rows 0..n-1: the tokens on the device
        (`tokens`), the (token, logprob) pairs in result slot p once its event has passed."""
        return SampledOnDevice.landed(self.tokens[:n], self.results[p, :n], self._events[p])

    def keep(self, token_ids: torch.Tensor) -> torch.Tensor:
        """An eager sampler's tokens [S] where the next graph's pending rows read them: `tokens`[:S]."""
        kept = self.tokens[: token_ids.shape[0]]
        if kept.data_ptr() != token_ids.data_ptr():
            kept.copy_(token_ids, non_blocking=True)
        return kept
