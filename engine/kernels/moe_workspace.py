"""The buffers of engine/kernels/fused_moe.py, allocated once for the largest token count and shared
by every call of fewer tokens: every CUDA-graph capture size and every MoE layer of a model (the
layers run one after the other on one stream). Only CUDA code paths import this module.

    align        AlignBuffers (moe_align.py): sorted pair ids, tile experts, counts
    inter        [max_tokens * k, I]   silu(gate) * up of each (token, expert) pair, by pair id
    expert_out   [max_tokens * k, H]   each pair's down projection, before the routing weight
    router_logits [ROUTER_ROWS, E]     moe_router.py's logits, between its programs
    router_partials [ROUTER_SPLITS, ROUTER_ROWS, E] fp32   its K splits' partial logits
    router_count [1] int32             moe_router.py's arrivals
    sum_counts   [PAIR_TILE_PAIRS * ceil(H / 16)] int32   fused_moe's arrivals per (token, column tile)

Rules:
- A call of T <= max_tokens tokens uses the fronts of the buffers: no allocation, so a graph
  ladder's memory does not grow per captured size (issue 74's DeepGEMM workspaces that did).
- `shared_workspace` is the process's workspace for one set of shapes, the default of
  `fused_moe(workspace=None)`. It grows (a new, larger allocation) only outside a CUDA-graph
  capture; inside one, a call larger than it raises: reserve the largest size first (warm-up
  before capture does). Growth rounds up to a power of two. A workspace it outgrew is freed,
  unless a graph was captured on it (`captured`, set by fused_moe): that graph still writes its
  memory, so it stays referenced.
- The counters are zero between calls (the last program to arrive zeroes its own), so a
  workspace is zeroed when made and after a resume of the region holding it (`after_resume`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.moe_align import AlignBuffers

# Decode steps of at most this many (token, expert) pairs skip the sort (fused_moe.py); a router
# of at most ROUTER_ROWS rows runs in one launch (moe_router.py).
PAIR_TILE_PAIRS = 32
ROUTER_ROWS = 16
ROUTER_SPLITS = 8
_MIN_BLOCK_N = 16  # the narrowest column tile of fused_moe's down GEMM


@dataclass
class MoeWorkspace:
    max_tokens: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    align: AlignBuffers
    inter: torch.Tensor  # [max_tokens * top_k, intermediate], dtype
    expert_out: torch.Tensor  # [max_tokens * top_k, hidden], dtype
    router_logits: torch.Tensor  # [ROUTER_ROWS, num_experts], dtype
    router_partials: torch.Tensor  # [ROUTER_SPLITS, ROUTER_ROWS, num_experts] fp32
    router_count: torch.Tensor  # [1] int32
    sum_counts: torch.Tensor  # [PAIR_TILE_PAIRS * ceil(hidden / 16)] int32
    captured: bool = False  # a CUDA graph was captured writing these buffers

    @classmethod
    def allocate(
        cls, max_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> MoeWorkspace:  # fmt: skip
        pairs = max_tokens * top_k
        return cls(
            max_tokens, num_experts, top_k, hidden, intermediate, dtype,
            AlignBuffers.allocate(pairs, num_experts, device),
            torch.empty((pairs, intermediate), dtype=dtype, device=device),
            torch.empty((pairs, hidden), dtype=dtype, device=device),
            torch.empty((ROUTER_ROWS, num_experts), dtype=dtype, device=device),
            torch.empty((ROUTER_SPLITS, ROUTER_ROWS, num_experts), dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(PAIR_TILE_PAIRS * -(-hidden // _MIN_BLOCK_N), dtype=torch.int32, device=device),
        )  # fmt: skip

    def after_resume(self) -> None:
        """The region holding the workspace came back with undefined contents: counters to zero."""
        self.router_count.zero_()
        self.sum_counts.zero_()

    @property
    def device(self) -> torch.device:
        return self.inter.device

    @property
    def nbytes(self) -> int:
        a = self.align
        tensors = (a.sorted_ids, a.expert_ids, a.num_padded, a.chunk_base, self.inter, self.expert_out,
                   self.router_logits, self.router_partials, self.router_count, self.sum_counts)
        return sum(t.numel() * t.element_size() for t in tensors)

    def check(self, tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        """Raises unless a call of these shapes fits this workspace."""
        want = (num_experts, top_k, hidden, intermediate, dtype)
        have = (self.num_experts, self.top_k, self.hidden, self.intermediate, self.dtype)
        if want != have or tokens > self.max_tokens:
            raise ValueError(f"MoeWorkspace for {self.max_tokens} tokens of (E, k, H, I, dtype) {have}; "
                             f"called with {tokens} tokens of {want}")  # fmt: skip


_SHARED: dict[tuple, MoeWorkspace] = {}
_OUTGROWN: list[MoeWorkspace] = []  # outgrown after a capture: its graphs still write them


def shared_workspace(
    tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
    dtype: torch.dtype, device: torch.device,
) -> MoeWorkspace:  # fmt: skip
    """The process's workspace for these shapes, holding at least `tokens` tokens."""
    key = (device, num_experts, top_k, hidden, intermediate, dtype)
    ws = _SHARED.get(key)
    if ws is not None and ws.max_tokens >= tokens:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if ws is None else ws.max_tokens
        raise RuntimeError(f"fused_moe: {tokens} tokens inside a CUDA-graph capture, the shared workspace holds "
                           f"{have}: run the largest size (or shared_workspace) before capturing")  # fmt: skip
    if ws is not None and ws.captured:
        _OUTGROWN.append(ws)
    tokens = 1 << max(0, (tokens - 1).bit_length())
    _SHARED[key] = ws = MoeWorkspace.allocate(tokens, num_experts, top_k, hidden, intermediate, dtype, device)
    return ws
