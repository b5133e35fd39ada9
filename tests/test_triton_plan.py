"""The Triton backend's decode plan on a CPU (no kernel runs): how many KV splits a decode of B
rows takes, whether its kernel merges them itself, and the workspace check that refuses a batch
the partials or the merge counters (allocated once, for max_num_seqs rows) cannot hold.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata

pytest.importorskip("triton")

MAX_NUM_SEQS = 8


@pytest.fixture
def backend():
    from engine.attention.triton import TritonBackend

    # [L, 2, blocks, block, Hkv, D]; with 8 KV heads a batch of max_num_seqs + 1 rows still fits
    # the partials (sized for the largest b * splits of b <= 8), so only the counters refuse it.
    cache = torch.zeros(1, 2, 64, 16, 8, 64, dtype=torch.bfloat16)
    return TritonBackend(cache, scale=0.125, num_heads=16, max_num_seqs=MAX_NUM_SEQS, max_model_len=1024)


def _decode_meta(rows: int) -> AttentionMetadata:
    ints = torch.zeros(rows, dtype=torch.int32)
    return AttentionMetadata(
        torch.arange(rows + 1, dtype=torch.int32), ints + 1, ints.view(rows, 1), torch.zeros(rows, dtype=torch.int64),
        list(range(rows + 1)), [1] * rows, 1, 1,
    )  # fmt: skip


def test_the_merged_plan_is_the_pdl_launch_plan_up_to_max_num_seqs(backend) -> None:
    for rows in range(1, MAX_NUM_SEQS + 1):
        splits, part_out, part_lse, counts = backend.merged_decode_plan(rows)
        assert splits == backend.decode_splits(rows, pdl_launch=True)[0] >= 1
        assert counts.numel() == MAX_NUM_SEQS * backend.num_kv_heads and not counts.any()
        if splits > 1:  # every split's partial output and log-sum-exp fits
            assert rows * splits * backend.num_heads * backend.head_dim <= part_out.numel()
            assert rows * splits * backend.num_heads <= part_lse.numel()


def test_a_merging_decode_past_max_num_seqs_is_refused(backend) -> None:
    rows = MAX_NUM_SEQS + 1
    with pytest.raises(ValueError, match="max_num_seqs"):
        backend.merged_decode_plan(rows)
    splits, merge = backend.decode_splits(rows, pdl_launch=True)
    assert merge  # this launch would merge in the kernel, and its partials fit: the counters are the limit
    assert rows * splits * backend.num_heads * backend.head_dim <= backend.merged_decode_plan(MAX_NUM_SEQS)[1].numel()
    q = torch.zeros(rows, backend.num_heads, backend.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_num_seqs"):  # before any kernel is launched
        backend.decode(0, q, _decode_meta(rows), torch.empty_like(q), pdl_launch=True)
