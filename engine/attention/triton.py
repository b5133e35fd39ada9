"""`TritonBackend`: paged attention with the Triton kernels of `engine/kernels/attention.py` (layout, K/V store,
graph metadata), `engine/kernels/attention_prefill.py` and `engine/kernels/attention_decode.py` (split-KV, its pieces in `engine/kernels/split_kv.py`), for CUDA.

- Every step first writes the new K/V rows into the cache (`store_kv`, slot -1 writes nothing),
  or the model's fused rope kernel writes them itself (`kv_target`; then `attend`, no `forward`).
- Prefill (any step with a sequence of more than one new token): one ragged-batch kernel, causal
  with each sequence's cached prefix; eager only (its grid uses the host's `max_query_len`). In
  a mixed step the sequences of one new token (decodes) run the decode kernels instead, at their
  token rows (`meta.single_query_rows` says whether there are any).
- Decode (`meta.is_decode`: one new token per sequence): split-KV kernel + reduce. The number of
  splits is a fixed function of the batch size (`decode_splits`), the partial-results workspace is
  allocated once here at its largest, and the kernels read no host-side value, so decode is
  CUDA-graph capturable (with the static buffers of `init_graph_buffers`). Eager decode runs the
  same kernels.
- A decode launched with PDL (`decode(pdl_launch=True)`, which the bench probes run) has its
  splits merged inside the kernel instead, by the last split of each (row, KV head) to end: a
  reduce launch between it and a next kernel launched with PDL would hold that kernel until the
  reduce ends. The batch decode's own attention kernel (kernels/rope_decode.py) merges the
  same way, with the plan and workspace of `merged_decode_plan`. The per-(row, KV head) counters
  are zero between launches; they live in the `cuda_graph` region, so a resume
  of that region zeroes them again (`after_resume`).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.layer_replay import LayerReplay
from engine.kernels import attention as tk
from engine.kernels import attention_decode as td
from engine.kernels import attention_prefill as tp

_MAX_SPLITS = 64  # most KV splits of one sequence in decode (the reduce loads them all at once)
# Decode programs resident per SM (the default config's registers allow 4): splits fill one wave
# of batch * kv_heads * splits <= this * num_SMs programs. Measured on an H200 (bench/
# bench/kernels/attention.py): a second, partial wave or an unneeded reduce cost 10-15%.
_PROGRAMS_PER_SM = 4
# Merged in the kernel (PDL callers): programs per SM. Filling all four slots made the batch
# decode's step slower than the reduce (32 rows, two splits: 1.604 against 1.493 ms at context 530,
# 3.204 against 2.711 at 2000); three per SM was faster at every row count that still splits
# (5..24 rows; bench/history/2026-11-24.md).
_MERGE_PROGRAMS_PER_SM = 3


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self, kv_cache: torch.Tensor, scale: float, num_heads: int, max_num_seqs: int, max_model_len: int
    ) -> None:
        super().__init__(kv_cache, scale, num_heads, max_num_seqs, max_model_len)
        self.num_kv_heads, self.head_dim = kv_cache.shape[4], kv_cache.shape[5]
        if not (_is_pow2(self.head_dim) and 16 <= self.head_dim <= 256):
            raise ValueError(f"triton attention needs a power-of-two head_dim in 16..256, got {self.head_dim}")
        if not _is_pow2(self.block_size):
            raise ValueError(f"triton attention needs a power-of-two block size, got {self.block_size}")
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        device = kv_cache.device
        # Each layer's K and V cache, [num_blocks, block_size, Hkv, D]: one view each, made once.
        self.layer_caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.wave_programs = _PROGRAMS_PER_SM * num_sms  # decode programs of one wave
        self._merge_programs = _MERGE_PROGRAMS_PER_SM * num_sms
        self._decode_block_n = td.decode_config(self.head_dim, kv_cache.element_size())[0]
        self._max_splits = max(1, min(_MAX_SPLITS, -(-max_model_len // self._decode_block_n)))
        # Decode workspace, allocated once: a batch of b rows with s = num_splits(b) > 1 uses the
        # first b * s * H * D (partial outputs) and b * s * H (their log-sum-exp) elements, viewed
        # as [b, H, s, D] and [b, H, s]. Only small batches split, so this is a few MiB at most.
        rows = max((b * self.num_splits(b) for b in range(1, max_num_seqs + 1) if self.num_splits(b) > 1), default=1)
        self._part_out = torch.empty(rows * num_heads * self.head_dim, dtype=torch.float32, device=device)
        self._part_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        # In-kernel merges: splits of (row, KV head) done, [max_num_seqs * Hkv], zero between launches.
        self._counts = torch.zeros(max_num_seqs * self.num_kv_heads, dtype=torch.int32, device=device)
        self._graph_max_bs = 0

    def num_splits(self, batch: int) -> int:
        """KV splits per sequence in decode: a function of the batch size alone (static per graph).
        As many as fit one wave of programs; 1 (no reduce) once the batch fills half the GPU."""
        return max(1, min(self._max_splits, self.wave_programs // (batch * self.num_kv_heads)))

    def decode_splits(self, batch: int, pdl_launch: bool = False) -> tuple[int, bool]:
        """(KV splits, whether the kernel merges them) of a decode of `batch` rows: a PDL launch
        merges in the kernel at up to _MERGE_PROGRAMS_PER_SM where that still splits; otherwise
        `num_splits` and the reduce."""
        if pdl_launch:
            merged = min(self._max_splits, self._merge_programs // (batch * self.num_kv_heads))
            if merged > 1:
                return merged, True
        return self.num_splits(batch), False

    def merged_decode_plan(self, batch: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(KV splits, partial outputs, their log-sum-exp, merge counters) for a decode kernel of
        `batch` rows that merges its own splits (the batch decode's, kernels/rope_decode.py):
        `decode_splits`' PDL plan."""
        splits, _ = self.decode_splits(batch, pdl_launch=True)
        self._check_workspace(batch, splits, merge=True)
        return splits, self._part_out, self._part_lse, self._counts

    def _check_workspace(self, batch: int, splits: int, merge: bool) -> None:
        """The partials of `batch` rows in `splits` splits fit the workspace allocated for
        max_num_seqs, and a kernel that merges its own splits has its rows' counters (max_num_seqs rows)."""
        if (splits > 1 and batch * splits * self.num_heads * self.head_dim > self._part_out.numel()) or (
            merge and batch > self.max_num_seqs
        ):
            raise ValueError(f"decode batch of {batch} exceeds max_num_seqs {self.max_num_seqs}")

    def after_resume(self) -> None:
        """The `cuda_graph` region came back with undefined contents: the merge counters start at
        zero, and the graphs' metadata is as `init_graph_buffers` made it (query_start_loc is a
        constant; a padding row's table row is never rewritten)."""
        self._counts.zero_()
        if self._graph_max_bs:
            self._g_block_tables.zero_()
            self._g_seq_lens.zero_()
            self._g_slot_mapping.fill_(-1)
            torch.arange(self._graph_max_bs + 1, dtype=torch.int32, out=self._g_query_start_loc)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim]: written instead of a new one
    ) -> torch.Tensor:  # [T, num_heads, head_dim]; rows past the last sequence are zero
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        else:
            self.check_out(q, out)
        k_cache, v_cache = self.layer_caches[layer_id]
        tk.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        self._attend(layer_id, q, k_cache, v_cache, meta, out)
        return out

    def kv_target(self, layer_id: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's caches and the step's slots: the fused rope kernel stores the rows
        (rope.rotary's `kv_store`), as `store_kv` would."""
        return (*self.layer_caches[layer_id], meta.slot_mapping)

    def attend(self, layer_id: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._attend(layer_id, q, *self.layer_caches[layer_id], meta, out)
        return out

    def _attend(
        self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        """q's attention over the layer's cache, the step's new K/V already in it, into out."""
        num_seqs = meta.seq_lens.shape[0]  # a shape, not a host value: fine inside a graph
        if meta.is_decode:
            # Row i is sequence i's only query; rows past num_seqs are padding.
            self.decode(layer_id, q[:num_seqs], meta, out[:num_seqs])
            if q.shape[0] > num_seqs:
                out[num_seqs:].zero_()
        else:
            end = meta.query_start_loc_cpu[-1]
            if end < q.shape[0]:
                out[end:].zero_()
            # A mixed step's one-token sequences (decodes) go to the split-KV kernel, which reads
            # each KV head once for its GROUP query heads; the prefill kernel, one program per
            # query head and BLOCK_M query rows, read it GROUP times to fill one row of 128
            # (bench/history/2026-11-23.md).
            mixed = meta.single_query_rows > 0
            tp.prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
                self.scale, meta.max_query_len, skip_single=mixed, seqs=meta.multi_query_seqs if mixed else None,
            )  # fmt: skip
            if mixed:
                self.decode(layer_id, q, meta, out, mixed=True)

    def layer_forward(self, meta: AttentionMetadata, num_tokens: int) -> LayerReplay:
        """The base rule, with every layer after the first relaunching the first's kernels
        (layer_replay.py): a piecewise step's 28 layers x 2-3 launches cost the host that much less."""
        return LayerReplay(self.forward, self.layer_caches.__getitem__, meta, num_tokens)

    def decode(
        self, layer_id: int, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor, pdl_launch: bool = False,
        mixed: bool = False,
    ) -> None:  # fmt: skip
        """Decode attention of q [B, H, D] (row i: sequence i's one query) over layer_id's cache
        as it stands, each row's new K/V already stored, into out [B, H, D]: the split-KV kernel
        and, with more than one split, its reduce. Graph-capturable (splits follow B alone).
        `pdl_launch`: launched with PDL (engine/kernels/pdl.py), for a caller whose kernel before writes
        q and the new K/V rows and triggers its dependents; its splits merge in the kernel
        (`decode_splits`). `mixed`: q and out are a mixed step's [T, H, D] token rows, and only its
        sequences of one new token are attended (forward)."""
        num_seqs = meta.seq_lens.shape[0]
        splits, merge = self.decode_splits(num_seqs, pdl_launch)
        self._check_workspace(num_seqs, splits, merge)
        k_cache, v_cache = self.layer_caches[layer_id]
        td.decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out,
            self.scale, splits, self._part_out, self._part_lse, pdl_launch=pdl_launch,
            query_start_loc=meta.query_start_loc if mixed else None, counts=self._counts if merge else None,
        )  # fmt: skip

    # ---- CUDA graphs (decode) --------------------------------------------------------------------

    def init_graph_buffers(self, max_bs: int) -> None:
        """Static metadata for decode graphs of up to max_bs rows, allocated once."""
        if max_bs > self.max_num_seqs:
            raise ValueError(f"graph batch {max_bs} exceeds max_num_seqs {self.max_num_seqs}")
        device = self.kv_cache.device
        self._graph_max_bs = max_bs
        self._g_block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self._g_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self._g_slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self._g_query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)

    def graph_metadata(self, bs: int) -> AttentionMetadata:
        """Views of the first bs rows of the static buffers. The host-side fields are placeholders
        that only make the metadata well formed (decode reads none of them)."""
        if not 0 < bs <= self._graph_max_bs:
            raise ValueError(f"graph batch {bs} is outside 1..{self._graph_max_bs} (init_graph_buffers)")
        return AttentionMetadata(
            query_start_loc=self._g_query_start_loc[: bs + 1],
            seq_lens=self._g_seq_lens[:bs],
            block_tables=self._g_block_tables[:bs],
            slot_mapping=self._g_slot_mapping[:bs],
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[0] * bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
