"""The fixed-split paged attention of `--deterministic` (engine/kernels/attention_fixed.py): every
token's output equals softmax attention over its sequence's cached keys up to its position (fp64
reference), and is bit for bit the same in any step it is computed in: a prefill chunk of any
cut, a decode, a mixed step, with any other sequences before or after it, on the tiled, one-token
and split paths. Rows past the step's sequences and rows of sequences of seq_len 0 (graph
padding) are zeros. The split path's arrival counters are zero after every step, and after a
resume hands back garbage and `after_resume` zeroes them the bits are the same.

Through an in-process engine with `--deterministic --attention-backend triton_fixed`: a sampled
request's tokens and logprobs alone equal those among companions (before and after it), and
re-scoring the completion teacher-forced reports its generation's logprobs bit for bit.

CPU: under Triton's interpreter (tests/interpreted.py), fp32 and fp16 (the engine: fp32),
contexts across several SPLIT pieces. GPU (`pytest -m gpu`): bf16 and fp32, the same checks.
"""

from __future__ import annotations

import random

import pytest
import torch
from interpreted import interpret

BLOCK_SIZE, NUM_BLOCKS, HKV, GROUP, D = 16, 96, 2, 2, 32
LENGTHS = [600, 37, 300, 9]  # tokens of each sequence: 600 spans five SPLIT pieces, 300 three


def _world(device: str, dtype: torch.dtype, group: int = GROUP):
    """A paged cache holding every sequence's K/V, block tables, and each position's query."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen).to(dtype).to(device)
    blocks = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(blocks)
    tables, at = [], 0
    for n in LENGTHS:
        need = -(-n // BLOCK_SIZE)
        tables.append(blocks[at : at + need])
        at += need
    queries = [torch.randn(n, HKV * group, D, generator=gen).to(dtype).to(device) for n in LENGTHS]
    return k_cache, v_cache, tables, queries


def _reference(k_cache, v_cache, table, q, pos, scale):  # -> [H, D] fp64
    rows = [table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(pos + 1)]
    group = q.shape[0] // HKV
    k = k_cache.reshape(-1, HKV, D)[rows].double().repeat_interleave(group, dim=1)  # [p+1, H, D]
    v = v_cache.reshape(-1, HKV, D)[rows].double().repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) * scale, dim=-1)
    return torch.einsum("ht,thd->hd", w, v)


def _step(world, pieces, device, pad_rows=0, empty_seq=False, workspace=None):
    """Run one step of `pieces` [(sequence, first position, last position)] through the kernel
    (with `workspace`: a step of up to FEW_TOKENS tokens takes the split path):
    {(sequence, position): output [H, D]}; checks the padding rows are zeros."""
    from engine.kernels.attention_fixed import fixed_split_attention

    k_cache, v_cache, tables, queries = world
    q = torch.cat([queries[s][a : b + 1] for s, a, b in pieces])
    width = max(len(t) for t in tables)
    bt = [tables[s] + [0] * (width - len(tables[s])) for s, _, _ in pieces]
    seq_lens = [b + 1 for _, _, b in pieces]
    qsl = [0]
    for _, a, b in pieces:
        qsl.append(qsl[-1] + b - a + 1)
    if empty_seq:  # a graph-padding sequence: seq_len 0, one row
        bt.append([0] * width)
        seq_lens.append(0)
        qsl.append(qsl[-1] + 1)
        q = torch.cat([q, torch.randn(1, *q.shape[1:]).to(q)])
    q = torch.cat([q, torch.randn(pad_rows, *q.shape[1:]).to(q)])
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    out = torch.full_like(q, float("nan"))
    fixed_split_attention(q, k_cache, v_cache, ints(bt), ints(seq_lens), ints(qsl), out, D**-0.5, max_num_seqs=8,
                          workspace=workspace)  # fmt: skip
    assert not out[qsl[len(pieces)] :].any(), "padding rows must be zeros"
    result, row = {}, 0
    for s, a, b in pieces:
        for p in range(a, b + 1):
            result[(s, p)] = out[row]
            row += 1
    return result


def check_fixed(device: str, dtype: torch.dtype, tol: float, group: int = GROUP) -> None:
    """Every layout runs twice, without and with the split path's workspace (a layout of more
    than FEW_TOKENS tokens takes the one-program path either way). `group` query heads a KV head:
    a prefill chunk's tiles hold 16 // group tokens."""
    from engine.kernels.attention_fixed import FEW_TOKENS, Workspace

    world = _world(device, dtype, group)
    workspace = Workspace.allocate(HKV * group, D, 1000, torch.device(device))
    layouts = [  # (pieces, padding rows, a seq_len-0 sequence)
        ([(0, 590, 599), (1, 36, 36), (2, 250, 299)], 3, False),  # chunks and a decode
        ([(2, 280, 299), (0, 599, 599), (3, 0, 8), (1, 30, 36)], 0, True),  # other cuts, other order
        ([(0, 599, 599)], 0, False), ([(1, 36, 36)], 0, False), ([(2, 299, 299)], 0, False),  # decodes alone
        ([(2, 255, 256)], 0, False), ([(3, 0, 8), (0, 511, 520)], 0, False),  # a piece's edge
        ([(1, 36, 36), (0, 599, 599), (2, 290, 292)], 2, True),  # a padded decode graph's rows
        ([(3, 8, 8), (0, 598, 598), (2, 299, 299)], 0, True),  # decodes, one token each (no search)
        ([(0, 598, 598), (3, 8, 8)], 1, False),  # the same decodes with a row past them (searched)
        ([(3, 2, 8), (0, 235, 530), (1, 0, 36)], 5, True),  # long chunks over pieces, tiles off any grid
    ]
    assert any(sum(b - a + 1 for _, a, b in p) + pad + e <= FEW_TOKENS for p, pad, e in layouts)
    assert any(sum(b - a + 1 for _, a, b in p) + pad + e > FEW_TOKENS for p, pad, e in layouts)
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for (pieces, pad_rows, empty_seq), ws in ((layout, ws) for layout in layouts for ws in (None, workspace)):
        got = _step(world, pieces, device, pad_rows=pad_rows, empty_seq=empty_seq, workspace=ws)
        for (s, p), o in got.items():
            want = _reference(world[0], world[1], world[2][s], world[3][s][p], p, D**-0.5)
            err = (o.double() - want).abs().max().item()
            assert err < tol, (s, p, err)
            if (s, p) in seen:
                assert torch.equal(seen[(s, p)], o), f"sequence {s} position {p} differs between steps"
            seen[(s, p)] = o
    assert len(seen) < sum(b - a + 1 for pieces, _, _ in layouts for _, a, b in pieces)  # tokens met twice
    assert not workspace.counts.any(), "the split path's last arrivals zero their counters"
    workspace.counts.fill_(3)  # what a resume may hand back
    workspace.after_resume()
    for (s, p), o in _step(world, [(0, 599, 599), (2, 290, 292)], device, workspace=workspace).items():
        assert torch.equal(seen[(s, p)], o), (s, p)


def check_qkv_parts(device: str, dtype: torch.dtype) -> None:
    """A decode step whose q and new K/V rows are still a qkv projection's fp32 partials
    (`QkvParts`: `--deterministic`'s batch decode past the workspace's rows): the one-token kernel's
    sums, q/k norm, rope and K/V store give the rotary kernel's bits (qkv and the cache after), and
    its outputs are the attention's on those, bit for bit. A slot of -1 stores nothing."""
    from engine.kernels.attention_fixed import fixed_split_attention
    from engine.kernels.qkv_parts import QkvParts
    from engine.kernels.rope import rotary

    k_cache, v_cache, tables, _ = _world(device, dtype)
    gen = torch.Generator().manual_seed(3)
    t, h, ks = len(LENGTHS), HKV * GROUP, 2
    width = (h + 2 * HKV) * D
    parts = torch.randn(ks, t + 2, width, generator=gen).to(device)  # rows past the step's: another stride
    positions = torch.tensor([n - 1 for n in LENGTHS], device=device)
    slots = [tables[i][(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for i, n in enumerate(LENGTHS)]
    slots = torch.tensor(slots[:-1] + [-1], device=device)  # the last row's new K/V goes nowhere
    cos_sin = torch.randn(max(LENGTHS), D, generator=gen).to(device)
    qw, kw = ((torch.randn(D, generator=gen) * 0.5 + 1).to(dtype).to(device) for _ in range(2))
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    bt = ints([tb + [0] * (max(map(len, tables)) - len(tb)) for tb in tables])
    seq_lens, qsl = ints(LENGTHS), ints(list(range(t + 1)))

    qkv_ref, caches = (parts[0, :t] + parts[1, :t]).to(dtype), (k_cache.clone(), v_cache.clone())
    q, k, v = (x.view(t, -1, D) for x in qkv_ref.split([h * D, HKV * D, HKV * D], dim=-1))
    rotary(q, k, positions, cos_sin, qw, kw, 1e-6, kv_store=(v, *caches, slots))
    want = fixed_split_attention(q, *caches, bt, seq_lens, qsl, torch.empty_like(q), D**-0.5, max_num_seqs=8)

    qkv, got_caches = torch.zeros(t + 2, width, dtype=dtype, device=device), (k_cache.clone(), v_cache.clone())
    q_view = qkv[:t, : h * D].view(t, h, D)
    got = fixed_split_attention(q_view, *got_caches, bt, seq_lens, qsl, torch.empty_like(q), D**-0.5, max_num_seqs=8,
                                rope=QkvParts(parts, qkv, positions, cos_sin, qw, kw, 1e-6, slots))  # fmt: skip
    assert torch.equal(qkv[:t], qkv_ref) and not qkv[t:].any()
    assert torch.equal(got_caches[0], caches[0]) and torch.equal(got_caches[1], caches[1])
    assert not torch.equal(caches[0], k_cache)  # new rows were stored
    assert torch.equal(got, want)


def check_engine(device: str, dtype: str) -> None:
    import tempfile

    from conftest import _save, _tiny_qwen3, run_core
    from test_models import random_tokens

    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.request import SamplingParams

    core = EngineCore(EngineConfig(model=_save(_tiny_qwen3(), tempfile.mkdtemp()), device=device, dtype=dtype,
                                   deterministic=True, attention_backend="triton_fixed", max_model_len=512,
                                   block_size=8, max_num_seqs=16, max_num_batched_tokens=16))  # fmt: skip
    assert core.runner.backend_name == "triton_fixed" and not core.runner.decode_paths

    prompt = random_tokens(29, seed=4)
    target = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=5, logprobs=True, ignore_eos=True)
    ids, lps, _ = run_core(core, [("alone", prompt, target)])["alone"]
    score = SamplingParams(max_new_tokens=0, temperature=1.0, logprobs=True, logprob_start_len=len(prompt))
    assert run_core(core, [("scored", prompt + ids, score)])["scored"][2] == lps
    others = [(f"o{i}", (prompt[:16] if i % 2 else []) + random_tokens(5 + 7 * i, seed=10 + i),
               SamplingParams(max_new_tokens=8, temperature=0.7, seed=i, ignore_eos=True)) for i in range(3)]  # fmt: skip
    assert run_core(core, [*others[:1], ("among", prompt, target), *others[1:]])["among"][:2] == (ids, lps)


def check_more_sequences_than_max(device: str) -> None:
    """A step of 40 one-token sequences with max_num_seqs 8, one row past them, finds each token's
    sequence as with a max_num_seqs that covers them (the search deepens with the step's
    sequences), and as the step without that row (one token each: no search)."""
    from engine.kernels.attention_fixed import fixed_split_attention

    gen = torch.Generator().manual_seed(3)
    seqs, ctx = 40, 40
    k, v = (torch.randn(seqs * 3, BLOCK_SIZE, HKV, D, generator=gen).to(device) for _ in range(2))
    tables = torch.arange(seqs * 3, dtype=torch.int32, device=device).view(seqs, 3)
    seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    q = torch.randn(seqs + 1, HKV * GROUP, D, generator=gen).to(device)
    few, many = torch.empty_like(q), torch.empty_like(q)
    fixed_split_attention(q, k, v, tables, seq_lens, qsl, few, D**-0.5, max_num_seqs=8)
    fixed_split_attention(q, k, v, tables, seq_lens, qsl, many, D**-0.5, max_num_seqs=64)
    assert torch.equal(few, many) and not few[seqs].any()
    each = torch.empty_like(q[:seqs])
    fixed_split_attention(q[:seqs], k, v, tables, seq_lens, qsl, each, D**-0.5, max_num_seqs=8)
    assert torch.equal(each, few[:seqs])
    want = _reference(k, v, tables[7].tolist(), q[7], ctx - 1, D**-0.5)
    assert (few[7].double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fixed_split_attention_interpreted(dtype: str) -> None:
    tol = 1e-5 if dtype == "float32" else 2e-3
    interpret("test_attention_fixed", f"check_fixed('cpu', torch.{dtype}, {tol})", timeout=600)


@pytest.mark.parametrize("group", [1, 4])
def test_tiles_of_other_widths_interpreted(group: int) -> None:
    """16 tokens a tile (one query head a KV head) and 4 (Qwen3-8B's four), fp16."""
    interpret("test_attention_fixed", f"check_fixed('cpu', torch.float16, 2e-3, group={group})", timeout=600)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_qkv_partials_summed_and_rotated_in_the_kernel_interpreted(dtype: str) -> None:
    interpret("test_attention_fixed", f"check_qkv_parts('cpu', torch.{dtype})", timeout=600)


def test_a_step_of_more_sequences_than_max_num_seqs_interpreted() -> None:
    interpret("test_attention_fixed", "check_more_sequences_than_max('cpu')")


def test_a_deterministic_engine_with_it_interpreted() -> None:
    interpret("test_attention_fixed", "check_engine('cpu', 'float32')", timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_split_attention_on_the_gpu(dtype: torch.dtype) -> None:
    check_fixed("cuda", dtype, 1e-5 if dtype == torch.float32 else 2e-2)
    check_fixed("cuda", dtype, 1e-5 if dtype == torch.float32 else 2e-2, group=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qkv_partials_summed_and_rotated_in_the_kernel_on_the_gpu() -> None:
    check_qkv_parts("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_deterministic_engine_with_it_on_the_gpu() -> None:
    check_engine("cuda", "bfloat16")
