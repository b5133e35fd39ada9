"""`CudaGraphRunner`: decode steps replayed from CUDA graphs.

Rules:
- One ladder of batch sizes (1, 2, 4, 8, then steps of 8 up to the largest); a decode batch of n
  rows runs the graph of the smallest size >= n, its extra rows padding.
- One set of static buffers, allocated once for the largest size and sliced for every smaller
  one: token ids and positions here, attention metadata and workspaces in the backend, logits
  here, the sampler's inputs and outputs in `GraphIO`. Capturing the ladder allocates no buffer
  per batch size.
- A graph is the whole step on the device: its first kernel reads the step's inputs from pinned
  host memory into the static buffers, its last one samples greedily and writes each row's
  (token, logprob) into pinned host memory (engine/runner/graph_io.py); no copy engine runs
  between steps. A step that samples otherwise runs the sampler on the static logits after it.
- Up to 64 rows the logits also write the greedy sampler's pieces (max, sum of exp, argmax of
  each logits program's columns: engine/kernels/logits_linear.py; the model's `logits_pieces`),
  so that sampler only merges them.
- The sizes whose decode path changes at long context (the fused kernel's few rows) get a second
  graph, with ForwardContext.long_kv; a step replays it when its plan is `long_kv`.
- With speculative decoding, the sizes up to `verify_rows` get a third, with
  ForwardContext.verify (no decode path that stores one row while another reads): a verify step
  planned as decode rows (StepPlan.verify) replays it. Without decode paths (`verify_rows` 0)
  such a step replays the plain graphs.
- Graphs are captured largest first and share one memory pool, so the smaller graphs reuse the
  largest one's intermediate memory.
- Padded rows read token 0 at position 0, write no KV (slot -1) and are dropped from the output.
- Warm-up runs before capture leave every input and metadata tensor as they found it: the staged
  rows are all padding, so nothing is written to the KV cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from engine.attention import AttentionBackend, ForwardContext
from engine.runner.step_plan import StepPlan

log = logging.getLogger("siesta.engine")

# Batch sizes below this step double; from it on they grow by it.
LADDER_STEP = 8


def graph_pool_bytes(pool: Any) -> int:
    """Bytes of the caching allocator's segments that belong to the graph pool `pool`."""
    key = tuple(pool or ())
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", ())) == key)


def load_padded(static: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, n: int, size: int) -> None:
    """Copy a step's token ids and positions ([n] int64 each) into rows 0 and 1 of `static`
    [2, >= size], and zero columns n..size (graph padding: token 0 at position 0). Both come from
    one upload (engine/runner/step_inputs.py), positions a fixed distance after the ids, so one
    strided copy moves both."""
    gap, rest = divmod(positions.data_ptr() - input_ids.data_ptr(), input_ids.element_size())
    shared = positions.untyped_storage().data_ptr() == input_ids.untyped_storage().data_ptr()
    if shared and rest == 0 and gap >= n and input_ids.stride(0) == positions.stride(0) == 1:
        static[:, :n].copy_(input_ids.as_strided((2, n), (gap, 1)), non_blocking=True)
    else:
        static[0, :n].copy_(input_ids, non_blocking=True)
        static[1, :n].copy_(positions, non_blocking=True)
    if size > n:
        static[:, n:size].zero_()


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The capture ladder up to `max_bs` (which is always included)."""
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs]
    sizes += range(LADDER_STEP, max_bs, LADDER_STEP)
    return [*sizes, max_bs]


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        max_bs: int,
        vocab_size: int,
        device: torch.device,
        batch_sizes: list[int] | None = None,  # default: the ladder; the benchmark captures [max_bs] alone
        pool: Any = None,  # a graph pool to capture into (shared with other graphs); default: a new one
        long_kv_rows: int = 0,  # sizes up to this get a second graph for long context (decode.attach.long_kv_rows)
        verify_rows: int = 0,  # sizes up to the first that holds this many rows get a verify graph
    ) -> None:
        from engine.runner.graph_io import GraphIO

        self.model = model
        self.backend = backend
        self.batch_sizes = batch_sizes or graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.device = device
        self.inputs = torch.zeros(2, max_bs, dtype=torch.int64, device=device)  # token ids, positions
        self.input_ids, self.positions = self.inputs[0], self.inputs[1]  # [max_bs] each
        dtype = next(model.parameters()).dtype  # compute_logits gives the model's
        self.logits = torch.zeros(max_bs, vocab_size, dtype=dtype, device=device)  # [max_bs, V]
        backend.init_graph_buffers(max_bs)
        meta = backend.graph_metadata(max_bs)
        if backend.kv_cache.shape[2] * backend.block_size >= 1 << 31:
            raise ValueError("CUDA graphs stage KV slots as int32: this KV cache has 2**31 slots or more")
        # Per batch size, the pieces a row of the sampler's log-sum-exp the logits write (0: the
        # sampler reads the logits; engine/kernels/lse_argmax.py).
        self.pieces = {bs: model.logits_pieces(bs) for bs in self.batch_sizes}
        self.io = GraphIO(
            self.inputs, meta.seq_lens, meta.block_tables, meta.slot_mapping, backend.max_num_seqs,
            max(bs * pieces for bs, pieces in self.pieces.items()),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The same sizes' forwards for steps holding >= LONG_KV_TOKENS context tokens (ForwardContext.long_kv)
        self.long_sizes = [bs for bs in self.batch_sizes if bs <= long_kv_rows]
        self.long_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The same sizes' forwards for verify steps planned as decode rows (ForwardContext.verify)
        self.verify_sizes = [bs for bs in self.batch_sizes if verify_rows and bs <= self.padded_size(min(verify_rows, max_bs))]
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = pool
        self.static_bytes = sum(t.numel() * t.element_size() for t in (self.inputs, self.logits)) + self.io.nbytes
        self.pool_bytes = 0  # device memory of the graphs' shared pool, once captured

    def static_tensors(self, bs: int) -> dict[str, torch.Tensor]:
        """Every input and metadata tensor a graph of batch size `bs` reads (for checks)."""
        meta = self.backend.graph_metadata(bs)
        return {
            "input_ids": self.input_ids[:bs],
            "positions": self.positions[:bs],
            "query_start_loc": meta.query_start_loc,
            "seq_lens": meta.seq_lens,
            "block_tables": meta.block_tables,
            "slot_mapping": meta.slot_mapping,
            "temperatures": self.io.temps[:bs],
        }

    def _forward(self, bs: int, long_kv: bool = False, verify: bool = False) -> None:
        """The captured work: the staged inputs, model and logits for `bs` rows into the static
        logits buffer, and their greedy samples."""
        self.io.gather(bs)
        ctx = ForwardContext(self.backend, self.backend.graph_metadata(bs), long_kv=long_kv, verify=verify)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        pieces = self.pieces[bs]
        self.model.compute_logits(hidden, out=self.logits[:bs], lse=self.io.lse_pieces(bs, pieces) if pieces else None)
        self.io.sample(self.logits[:bs], pieces)

    @torch.inference_mode()
    def capture(self, graph_context: Callable[..., AbstractContextManager] = torch.cuda.graph) -> None:
        """Capture the whole ladder, largest first, into one shared pool; log memory as it goes.
        `graph_context(graph, pool=...)` is `torch.cuda.graph` or a region's pausable version."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        plan = [(bs, "") for bs in reversed(self.batch_sizes)] + [(bs, "long") for bs in reversed(self.long_sizes)]
        plan += [(bs, "verify") for bs in reversed(self.verify_sizes)]
        kinds = {"": self.graphs, "long": self.long_graphs, "verify": self.verify_graphs}
        for bs, kind in plan:
            self._forward(bs, kind == "long", kind == "verify")  # warm-up: compiles kernels, allocates workspaces outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_context(graph, pool=self.pool):
                self._forward(bs, kind == "long", kind == "verify")
            if self.pool is None:
                self.pool = graph.pool()
            kinds[kind][bs] = graph
            torch.cuda.synchronize(self.device)
            log.info("captured decode graph bs=%d%s; graph pool now %.1f MiB", bs, f" ({kind})" if kind else "",
                     graph_pool_bytes(self.pool) / (1 << 20))
        self.io.reset()
        self.pool_bytes = graph_pool_bytes(self.pool)
        log.info(
            "captured %d decode graphs (bs %d..%d, %d of them again for long context, %d for verify steps) in %.1f s: "
            "pool %.1f MiB, static buffers %.1f MiB", len(self.graphs), self.batch_sizes[0], self.max_bs,
            len(self.long_graphs), len(self.verify_graphs),
            time.perf_counter() - t0,
            self.pool_bytes / (1 << 20), self.static_bytes / (1 << 20),
        )

    def after_resume(self) -> None:
        """The `cuda_graph` region came back with undefined contents: replays count from zero, and
        the static inputs and the last step's tokens hold what they held after capture."""
        self.io.reset()
        self.inputs.zero_()
        self.io.tokens.zero_()
        self.io.temps.fill_(1.0)

    def padded_size(self, n: int) -> int:
        return next(bs for bs in self.batch_sizes if bs >= n)

    def can_run(self, plan: StepPlan) -> bool:
        """A decode step (one token a sequence) in which every row samples, of <= max_bs rows; a
        verify step's rows only where a verify graph of their size exists (or none is needed)."""
        if not (plan.max_query_len == 1 and len(plan.sample_rows) == plan.num_seqs <= self.max_bs):
            return False
        return not plan.verify or not self.verify_sizes or self.padded_size(plan.num_seqs) in self.verify_graphs

    def run(self, plan: StepPlan) -> int:
        """Replay the step `plan` (`can_run`); its logits are `logits[:n]` until the next run, its
        greedy samples in `io` (`GraphIO.landed` of the slot returned)."""
        assert plan.sampling is not None
        return self.replay(plan.parts, plan.sampling.scalars[: plan.num_seqs], plan.num_seqs, plan.verify, plan.long_kv)

    def replay(self, parts: list[list[int]], temps: list[float], n: int, verify: bool = False,
               long_kv: bool = False) -> int:  # fmt: skip
        """Replay the graph of n <= max_bs decode rows staged from `parts` (a StepPlan's) with
        temperatures `temps`: the verify graph where `verify` and one exists, the long-context
        one where `long_kv` and one exists; returns the result slot (`run`)."""
        bs = self.padded_size(n)
        slot = self.io.stage_step(parts, temps, n, bs)
        if verify and self.verify_graphs:
            graphs = self.verify_graphs
        else:
            graphs = self.long_graphs if bs in self.long_graphs and long_kv else self.graphs
        graphs[bs].replay()
        self.io.replayed(slot)
        return slot
