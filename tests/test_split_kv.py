"""The split-KV decode's in-kernel merge (engine/kernels/split_kv.py `merge_splits`, the path of
the batch decode and `DecodeAttention`) on a CPU under Triton's interpreter and on a GPU: rows
cut into 1 to 13 splits (a GPU: 63, a row of LONG tokens added), merged 4 (split_kv.MERGE_SPLITS) or 16 (rope_decode's
few rows) partials a load: counts below, at and past it, GQA groups of 1, 2 and 4, against a float64 softmax of the same cache; every merge
counter back at zero after the launch."""

from __future__ import annotations

import pytest
import torch
from interpreted import interpret

BLOCK_SIZE, HEAD_DIM, KV_HEADS = 16, 32, 2
LENS = [1, 17, 40, 95, 200]  # tokens a row; splits: as many as the row fills (split_chunk)
LONG = 1000  # a GPU's extra row: 63 tiles, so up to 63 of 64 splits hold tokens


def check_merge(device: str, group: int, splits: int, merge: int, lens: list[int] = LENS) -> None:
    from engine.kernels import attention_decode as td

    torch.manual_seed(splits * 10 + group)
    dev = torch.device(device)
    heads = group * KV_HEADS
    per = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(per)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=dev).int()
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(per):
        tables[i, :n] = perm[at : at + n]
        at += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), heads, HEAD_DIM, device=dev)
    out = torch.full_like(q, float("nan"))
    part_out = torch.empty(len(lens) * heads * splits * HEAD_DIM, device=dev)
    part_lse = torch.empty(len(lens) * heads * splits, device=dev)
    counts = torch.zeros(len(lens) * KV_HEADS, dtype=torch.int32, device=dev)
    scale = HEAD_DIM**-0.5
    td.decode_attention(q, k_cache, v_cache, tables, seq_lens, out, scale, splits, part_out, part_lse,
                        config=(16, 4, 1), counts=counts, merge=merge)  # fmt: skip
    assert not counts.any(), "a merge counter was left non-zero"
    for i, n in enumerate(lens):
        slots = (tables[i, : per[i]].long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=dev)).flatten()[:n]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)  # [n, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, -1)
        ref = torch.einsum("hn,nhd->hd", w, v)
        err = (out[i].double() - ref).abs().max().item()
        assert err < 1e-4, f"row {i} ({n} tokens, {splits} splits of {merge} a load, group {group}): off by {err}"


@pytest.mark.parametrize("splits,merge", [(3, 4), (4, 4), (13, 4), (13, 16)])
def test_merge_of_splits_under_the_interpreter(splits: int, merge: int) -> None:
    code = "".join(f"check_merge('cpu', {g}, {splits}, {merge})\n" for g in (1, 2, 4))
    interpret("test_split_kv", code, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [3, 4, 13, 64])
@pytest.mark.parametrize("merge", [4, 16])
def test_merge_of_splits_on_the_gpu(splits: int, merge: int) -> None:
    for group in (1, 2, 4):
        check_merge("cuda", group, splits, merge, LENS + [LONG])
