"""The attention-backend interface. A backend owns the paged KV cache view it reads and writes and,
on the GPU, its own workspaces and graph buffers; models only call `forward`.

Batch layout is ragged: the T new tokens of B sequences are concatenated, sequence i owning rows
`query_start_loc[i]:query_start_loc[i + 1]`.

KV cache layout: one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 of dim 1 is K, 1 is V). Token j of a sequence lives in slot
`block_table[j // block_size] * block_size + j % block_size`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

# A step's attention for one layer: (layer_id, q, k, v, out) -> None (AttentionBackend.layer_forward)
LayerForward = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class AttentionMetadata:
    """Per-step tensors describing a ragged batch, on the model's device unless named `_cpu`."""

    query_start_loc: torch.Tensor  # [B + 1] int32: prefix sums of new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32: tokens in the KV cache after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token; -1 writes nothing
    query_start_loc_cpu: list[int]  # host copies, so CPU-side loops never synchronize
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def single_query_rows(self) -> int:
        """Sequences with exactly one new token (a mixed step's decodes), counted once per step."""
        q = self.query_start_loc_cpu
        return sum(b - a == 1 for a, b in zip(q, q[1:], strict=False))

    @functools.cached_property
    def multi_query_seqs(self) -> tuple[int, int]:
        """(first, end): the sequences from the first to the last with more than one new token
        (a mixed step's prefill chunks, and any decodes between them); (0, 0) if none."""
        q = self.query_start_loc_cpu
        multi = [i for i, (a, b) in enumerate(zip(q, q[1:], strict=False)) if b - a > 1]
        return (multi[0], multi[-1] + 1) if multi else (0, 0)


class AttentionBackend(ABC):
    """Reads and writes one engine's paged KV cache. `kv_cache` is the tensor described above.

    Limits are fixed at startup so that a backend can allocate its workspaces once, at their
    largest: at most `max_num_seqs` sequences per step, each at most `max_model_len` tokens.

    CUDA graphs (decode only): a backend with `supports_cuda_graph` owns the static metadata
    buffers that captured graphs read. `init_graph_buffers` allocates them once for the largest
    graph batch; `graph_metadata(bs)` returns views of their first `bs` rows (used to capture and
    replay the graph of batch size bs). The runner fills them before each replay (engine/runner/
    graph_io.py), rows past the step's becoming padding (slot -1: writes nothing; seq_len 0: reads
    nothing, outputs zeros). Inside a graph, a backend may not read host-side values (`*_cpu`,
    `max_seq_len`): they are those of the capture.
    """

    supports_cuda_graph = False

    def __init__(
        self, kv_cache: torch.Tensor, scale: float, num_heads: int, max_num_seqs: int, max_model_len: int
    ) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        self.num_heads = num_heads
        self.block_size = kv_cache.shape[3]
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim], q's dtype, last dim contiguous
    ) -> torch.Tensor:  # [T, num_heads, head_dim]: `out` when given, else a new tensor
        """Write the new k/v into the cache at `meta.slot_mapping`, then attend causally: new token
        at position p of sequence i sees cached and new tokens 0..p of sequence i. Rows past the
        last sequence are zero. With `out`, the result is written there and nothing is allocated
        for it (piecewise CUDA graphs read it from a static buffer)."""

    def kv_target(self, layer_id: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache [num_blocks, block_size, Hkv, D], slot_mapping [T]): where the kernel
        that makes the step's k and v may store them itself, `attend` then taking the place of
        `forward` (one launch fewer a layer). None (here): `forward` stores them."""
        return None

    def attend(self, layer_id: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`forward` of q [T, num_heads, head_dim] with the step's new K/V rows already in the
        cache at `kv_target`'s slots -> [T, num_heads, head_dim]."""
        raise NotImplementedError(f"{type(self).__name__} stores its K/V rows in forward")

    def layer_forward(self, meta: AttentionMetadata, num_tokens: int) -> LayerForward:
        """A step's attention for one layer after another, planned once per step: call it with
        (layer_id, q, k, v, out), tensors of T_pad >= num_tokens rows whose first num_tokens are
        the step's (the rest padding, left as they are in `out`). Here: `forward` on those rows."""
        n = num_tokens

        def attend(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
            self.forward(layer_id, q[:n], k[:n], v[:n], meta, out=out[:n])

        return attend

    @staticmethod
    def check_out(q: torch.Tensor, out: torch.Tensor) -> None:
        """`out` must be shaped, typed and placed like q, with a contiguous last dim."""
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
            raise ValueError(
                f"attention out {tuple(out.shape)} {out.dtype} {out.device} (strides {out.stride()}) does not "
                f"match q {tuple(q.shape)} {q.dtype} {q.device} with a contiguous last dim"
            )

    def after_resume(self) -> None:
        """The `cuda_graph` region (where the runner builds backends) was mapped again, its contents
        undefined: reset whatever must hold a value between steps. Nothing by default."""
        return None

    def init_graph_buffers(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def graph_metadata(self, bs: int) -> AttentionMetadata:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


@dataclass
class ForwardContext:
    """Explicit per-step state a model forward needs besides token ids and positions."""

    backend: AttentionBackend
    meta: AttentionMetadata
    # A decode step whose rows hold >= LONG_KV_TOKENS of context together (engine/decode/rules.py):
    # few rows then take the split-KV kernels (batch_decode.py), not the one-kernel layers.
    long_kv: bool = False
    # A verify step as decode rows (speculative decoding, StepPlan.verify): consecutive rows of one
    # sequence, each attending through the row before it, so every row's K/V must be stored before
    # any row attends: the decode paths that store a row while another reads (engine/decode/) decline.
    verify: bool = False
