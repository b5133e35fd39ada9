"""`PiecewiseGraphRunner`: steps that carry prefill tokens (mixed prefill + decode, or any step of
T new tokens) replayed from CUDA graphs cut at every attention call; attention runs eagerly
between the pieces, since its grid depends on host values (`max_query_len`, the sequences).

A forward of L layers is L + 1 graphs: graph 0 = embedding + layer 0 up to its attention; graph
l = o_proj of layer l - 1, its MLP, layer l up to its attention; graph L = the last o_proj and MLP,
the final norm, copied into the static hidden buffer. Replay: graph 0, attention 0, graph 1, ...,
attention L - 1, graph L.

Rules:
- One ladder of token counts (`piecewise_token_sizes`); a step of T tokens runs the pieces of the
  smallest size >= T, rows T.. of that size being padding.
- Static buffers, allocated once at the largest size and sliced for every smaller one: token ids,
  positions [T_max] int64; the attention output [T_max, H, D] (every layer writes it; layer l's is
  read by graph l + 1 before layer l + 1's attention writes it again); hidden states
  [T_max, hidden]. Capturing the ladder allocates no buffer per size.
- Graphs are captured largest first and all share one memory pool. Pieces hand each other
  tensors through that pool: the q/k/v a piece leaves for attention are kept as non-owning views
  (so later pieces and smaller sizes may reuse their memory, as the eager forward would once
  attention has read them).
- Capture never runs attention: the splitter answers each call with the static output buffer, so
  neither the warm-up forward nor the captures read or write the KV cache.
- Padding rows: token 0 at position 0 through the graphs; attention sees only the T real rows
  (q/k/v/out sliced to T), so the step's own metadata is passed unchanged and padding writes no KV.
  The padding rows of the attention output are zero.
- `run` never synchronizes: inputs, replays and attention are queued on the current stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import AttentionBackend, AttentionMetadata, ForwardContext
from engine.runner.cuda_graph import graph_pool_bytes, load_padded

log = logging.getLogger("siesta.engine")

# Candidate token counts; the ladder keeps those under the cap and adds the cap itself.
TOKEN_LADDER = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def piecewise_token_sizes(max_num_batched_tokens: int, kv_capacity_tokens: int) -> list[int]:
    """The capture ladder, ascending. A step has at most max_num_batched_tokens new tokens, each
    taking a KV slot, so the cap is the smaller of the two; it is always on the ladder (a full
    token budget is the commonest prefill step), the candidates below it too."""
    cap = min(max_num_batched_tokens, kv_capacity_tokens)
    if cap <= 0:
        return []
    return [t for t in TOKEN_LADDER if t < cap] + [cap]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A view of t's memory that does not own it (as torch's cudagraph trees keep graph outputs):
    the pool may reuse the memory once t itself is freed, and the view then reads what the
    replayed graphs wrote there last."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


class _PieceChain:
    """Looks like one CUDAGraph to a `graph_context` (torch.cuda.graph calls capture_begin on
    entry and capture_end on exit), but is a chain of graphs in one pool: between `end_piece` and
    `begin_piece` nothing is captured, and the next graph continues on the same capture stream.
    The pool is a `torch.cuda.graph_pool_handle()` (a graph's own `pool()` is only there once its
    capture has ended)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.error_mode = "global"

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **_: Any) -> None:
        self.pool = pool if pool is not None else self.pool
        self.error_mode = capture_error_mode
        self.begin_piece()

    def begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.pool, capture_error_mode=self.error_mode)
        self.graphs.append(graph)

    def end_piece(self) -> None:
        self.graphs[-1].capture_end()

    def capture_end(self) -> None:
        self.end_piece()


@dataclass(frozen=True)
class _Attention:
    """One attention call of a captured forward: its layer and the q/k/v its graph leaves."""

    layer_id: int
    q: torch.Tensor  # [T_pad, H, D]
    k: torch.Tensor  # [T_pad, Hkv, D]
    v: torch.Tensor  # [T_pad, Hkv, D]


class _Splitter(AttentionBackend):
    """Stands in for the attention backend while the runner drives the model. Every call answers
    with the static output buffer's first T rows and records its layer; besides, it
    - capturing (`chain` set): ends the current graph, keeps views of the q/k/v that graph left,
      begins the next graph;
    - eager reference (`meta` set): runs the real backend on the first `num_tokens` rows into that
      buffer, as `run` does between replays;
    - otherwise (warm-up): nothing, so the KV cache is neither read nor written."""

    def __init__(self, backend: AttentionBackend, attn_out: torch.Tensor) -> None:
        super().__init__(backend.kv_cache, backend.scale, backend.num_heads, backend.max_num_seqs, backend.max_model_len)
        self.backend = backend
        self.attn_out = attn_out  # [T_max, H, D]
        self.reset()

    def reset(self, chain: _PieceChain | None = None, meta: AttentionMetadata | None = None, num_tokens: int = 0) -> None:
        self.layer_ids: list[int] = []
        self.captured: list[_Attention] = []
        self.chain, self.meta, self.num_tokens = chain, meta, num_tokens

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]: a view of the static buffer
        out = self.attn_out[: q.shape[0]]
        self.layer_ids.append(layer_id)
        if self.chain is not None:
            self.chain.end_piece()
            self.captured.append(_Attention(layer_id, _alias(q), _alias(k), _alias(v)))
            self.chain.begin_piece()
        elif self.meta is not None:
            n = self.num_tokens
            self.backend.forward(layer_id, q[:n], k[:n], v[:n], self.meta, out=out[:n])
        return out


def _placeholder_meta(device: torch.device) -> AttentionMetadata:
    """Well-formed metadata for forwards whose attention the splitter answers (it reads none)."""
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    return AttentionMetadata(zero, zero[:0], zero[:0].view(0, 1), zero[:0].long(), [0], [], 0, 0)


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,  # an engine.models causal LM
        backend: AttentionBackend,  # the real backend: runs attention between the pieces
        token_sizes: list[int],  # the ladder (piecewise_token_sizes), any order
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pool: Any = None,  # a graph pool to capture into (shared with the decode graphs); default: new
    ) -> None:
        if not token_sizes or min(token_sizes) <= 0:
            raise ValueError(f"token sizes must be positive and not empty, got {token_sizes}")
        self.model = model
        self.backend = backend
        self.token_sizes = sorted(set(token_sizes))
        self.max_tokens = self.token_sizes[-1]
        self.device = device
        t_max = self.max_tokens
        self.inputs = torch.zeros(2, t_max, dtype=torch.int64, device=device)  # token ids, positions
        self.input_ids, self.positions = self.inputs[0], self.inputs[1]  # [T_max] each
        self.attn_out = torch.zeros(t_max, num_heads, head_dim, dtype=dtype, device=device)  # [T_max, H, D]
        self.hidden = torch.zeros(t_max, hidden_size, dtype=dtype, device=device)  # [T_max, hidden]
        self.static_bytes = sum(
            t.numel() * t.element_size() for t in (self.inputs, self.attn_out, self.hidden)
        )
        self.splitter = _Splitter(backend, self.attn_out)
        self._meta = _placeholder_meta(device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # size -> its L + 1 pieces
        self.attention: dict[int, list[_Attention]] = {}  # size -> its L attention calls
        self.pool: Any = pool  # the graphs' shared pool (a graph_pool_handle); made by capture if None
        self.pool_bytes = 0  # device memory of the shared pool, once captured
        self.pool_bytes_by_size: dict[int, int] = {}  # the pool after capturing each size
        self.num_attention_calls = 0  # per forward: the model's layer count, as seen in warm-up

    def _forward(self, size: int) -> None:
        """The model on the first `size` rows of the static inputs, attention answered by the
        splitter as it is set; the output copied into the static hidden buffer."""
        hidden = self.model(self.input_ids[:size], self.positions[:size], ForwardContext(self.splitter, self._meta))
        self.hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def warmup(self, size: int) -> int:
        """An eager forward of `size` rows through the splitter (no KV read or written): compiles
        kernels and makes workspaces outside any capture. Returns its number of attention calls."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.splitter.reset()
        self._forward(size)
        return len(self.splitter.layer_ids)

    @torch.inference_mode()
    def capture(self, graph_context: Callable[..., AbstractContextManager] = torch.cuda.graph) -> None:
        """Capture the ladder, largest first, into one shared pool; log memory as it goes.
        `graph_context(graph, pool=...)` is torch.cuda.graph or the memory region's version of it
        (engine/memory/regions.py `graph_capture`): entered once per size, around all its pieces, it gives
        the side stream, the synchronisation and the region's allocation tag."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.token_sizes):
            calls = self.warmup(size)
            if self.num_attention_calls and calls != self.num_attention_calls:
                raise RuntimeError(f"warm-up of {size} tokens made {calls} attention calls, not {self.num_attention_calls}")
            self.num_attention_calls = calls
            torch.cuda.synchronize(self.device)
            chain = _PieceChain(self.pool)
            self.splitter.reset(chain=chain)
            with graph_context(chain, pool=self.pool):
                self._forward(size)
            attention = self.splitter.captured
            self.splitter.reset()
            if len(attention) != calls or len(chain.graphs) != calls + 1:
                raise RuntimeError(f"capture of {size} tokens made {len(attention)} attention calls, not {calls}")
            self.graphs[size], self.attention[size] = chain.graphs, attention
            torch.cuda.synchronize(self.device)
            self.pool_bytes_by_size[size] = graph_pool_bytes(self.pool)
            log.info(
                "captured piecewise graphs T=%d (%d pieces); graph pool now %.1f MiB",
                size, len(chain.graphs), self.pool_bytes_by_size[size] / (1 << 20),
            )
        self.pool_bytes = graph_pool_bytes(self.pool)
        log.info(
            "captured piecewise graphs for %d token sizes (%d..%d, %d pieces each) in %.1f s: pool %.1f MiB,"
            " static buffers %.1f MiB",
            len(self.graphs), self.token_sizes[0], self.max_tokens, self.num_attention_calls + 1,
            time.perf_counter() - t0, self.pool_bytes / (1 << 20), self.static_bytes / (1 << 20),
        )

    def can_run(self, num_tokens: int) -> bool:
        return bool(self.graphs) and 0 < num_tokens <= self.max_tokens

    def padded_size(self, n: int) -> int:
        return next(t for t in self.token_sizes if t >= n)

    def _load_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[int, int]:
        """Copy a step into the static inputs, padding rows token 0 at position 0 and their
        attention output zero; returns (real rows, padded size)."""
        n = input_ids.shape[0]
        if not 0 < n <= self.max_tokens:
            raise ValueError(f"{n} tokens is outside 1..{self.max_tokens}")
        if meta.query_start_loc_cpu[-1] != n or positions.shape[0] != n:
            raise ValueError(f"metadata covers {meta.query_start_loc_cpu[-1]} tokens and positions {positions.shape[0]}, not {n}")
        size = self.padded_size(n)
        load_padded(self.inputs, input_ids, positions, n, size)
        self.attn_out[n:size].zero_()
        return n, size

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,  # the step's eager metadata, covering exactly its T tokens
    ) -> torch.Tensor:  # [T, hidden] (a view of the static buffer: use before the next run)
        n, size = self._load_inputs(input_ids, positions, meta)
        graphs, attention = self.graphs[size], self.attention[size]
        attend = self.backend.layer_forward(meta, n)  # planned once for the step's layers
        for graph, a in zip(graphs[:-1], attention, strict=True):
            graph.replay()
            attend(a.layer_id, a.q, a.k, a.v, self.attn_out)
        graphs[-1].replay()
        return self.hidden[:n]

    @torch.inference_mode()
    def run_eager(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] (a view of the static buffer)
        """What `run` replays, without graphs: the same padded size, buffers and attention calls.
        The reference `run` equals bit for bit; it works on any device."""
        n, size = self._load_inputs(input_ids, positions, meta)
        self.splitter.reset(meta=meta, num_tokens=n)
        self._forward(size)
        self.splitter.reset()
        return self.hidden[:n]
