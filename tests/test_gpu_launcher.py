"""engine/kernels/launcher.py's `Launcher` on the GPU: a repeat launch skips Triton's JIT path and does
what that path does; arguments Triton specializes differently (a misaligned pointer) get their
own compiled variant; a variant compiled for PDL launches, and replays from a CUDA graph, with
the output of a plain launch. GPU only: every test skips without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HKV, D, BLOCK = 4, 64, 16


def _cache(blocks: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.zeros(blocks, BLOCK, HKV, D, dtype=torch.bfloat16, device="cuda")
    return k, torch.zeros_like(k)


def _rows(t: int, offset: int = 0) -> torch.Tensor:
    # [t, HKV, D] bf16 rows starting `offset` elements into a fresh buffer (offset 1: not 16-byte aligned)
    buf = torch.randn(offset + t * HKV * D, device="cuda").to(torch.bfloat16)
    return buf[offset:].view(t, HKV, D)


def test_repeat_launches_skip_the_jit_path_and_do_what_it_does() -> None:
    from engine.kernels import attention as tk

    kernel = tk._store_kv_kernel
    k_cache, v_cache = _cache()
    slots = torch.tensor([3, -1, 17, 40], dtype=torch.int64, device="cuda")
    for step in range(4):
        hits, misses = kernel.hits, kernel.misses
        k, v = _rows(4), _rows(4)
        tk.store_kv(k, v, k_cache, v_cache, slots)
        torch.cuda.synchronize()
        flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(flat_k[slot], k[row]) and torch.equal(flat_v[slot], v[row])
        assert not flat_k[1].any(), "slot -1 wrote a row"
        if step > 0:  # the first may be a miss in this process; every later one is a hit
            assert (kernel.hits, kernel.misses) == (hits + 1, misses)


def test_arguments_triton_specializes_differently_get_their_own_variant() -> None:
    from engine.kernels import attention as tk

    kernel = tk._store_kv_kernel
    k_cache, v_cache = _cache()
    slots = torch.arange(5, dtype=torch.int64, device="cuda") * 7
    tk.store_kv(_rows(5), _rows(5), k_cache, v_cache, slots)  # the aligned variant, known from now on
    misses = kernel.misses
    k, v = _rows(5, offset=1), _rows(5, offset=1)  # data pointers 2 bytes past 16-byte alignment
    assert k.data_ptr() % 16 != 0
    tk.store_kv(k, v, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert kernel.misses == misses + 1, "a misaligned pointer launched the aligned variant"
    assert torch.equal(k_cache.view(-1, HKV, D)[slots], k) and torch.equal(v_cache.view(-1, HKV, D)[slots], v)
    tk.store_kv(k, v, k_cache, v_cache, slots)  # and that variant is a hit from now on
    assert kernel.misses == misses + 1


def test_a_pdl_variant_replays_in_a_graph_with_the_same_output() -> None:
    from engine.kernels import attention_decode as td

    heads, batch, blocks_per_seq = 8, 3, 4
    k_cache, v_cache = _cache(batch * blocks_per_seq)
    k_cache.normal_()
    v_cache.normal_()
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").int().view(batch, blocks_per_seq)
    lens = torch.tensor([5, 64, 33], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, D, device="cuda").to(torch.bfloat16)
    part_out = torch.empty(batch * heads * 2 * D, device="cuda")
    part_lse = torch.empty(batch * heads * 2, device="cuda")

    def run(out: torch.Tensor, pdl: bool) -> None:
        td.decode_attention(q, k_cache, v_cache, tables, lens, out, D**-0.5, 2, part_out, part_lse, pdl_launch=pdl)

    ref = torch.empty_like(q)
    run(ref, False)
    out = torch.zeros_like(q)
    for _ in range(2):  # the JIT path's launch, then the Launcher's
        run(out, True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert td._decode_kernel.hits > 0


def test_no_fast_launch_sends_every_launch_down_the_jit_path() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import torch\n"
        "from engine.kernels import attention as tk, configure\n"
        "configure(pdl=True, fast_launch=sys.argv[1] == '1', splitk_linear=True)\n"
        "k = torch.randn(4, 4, 64, device='cuda').to(torch.bfloat16)\n"
        "c = torch.zeros(8, 16, 4, 64, dtype=torch.bfloat16, device='cuda')\n"
        "s = torch.arange(4, device='cuda')\n"
        "for _ in range(3):\n"
        "    tk.store_kv(k, k, c, c, s)\n"
        "torch.cuda.synchronize()\n"
        "assert torch.equal(c.view(-1, 4, 64)[:4], k)\n"
        "print(tk._store_kv_kernel.hits, tk._store_kv_kernel.misses)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for flag, expected in (("0", "0 3"), ("1", "2 1")):
        p = subprocess.run([sys.executable, "-c", code, flag], cwd=root, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split("\n")[-2] == expected, (flag, p.stdout)


def test_a_recorded_launch_relaunches_with_other_tensors_and_a_jit_launch_records_none() -> None:
    from engine.kernels import attention as tk
    from engine.kernels.launcher import record_launches

    k_cache, v_cache = _cache()
    slots = torch.tensor([3, 17, 40], dtype=torch.int64, device="cuda")
    k, v = _rows(3), _rows(3)
    tk.store_kv(k, v, k_cache, v_cache, slots)  # compiled from now on
    with record_launches() as launches:
        tk.store_kv(k, v, k_cache, v_cache, slots)
    assert len(launches) == 1 and launches[0] is not None
    (launch,) = launches
    other_k, other_v = _rows(3), _rows(3)
    other_cache = _cache()
    values = [{id(k): other_k, id(v): other_v, id(k_cache): other_cache[0], id(v_cache): other_cache[1]}.get(id(x), x)
              for x in launch.values]
    launch.relaunch(values)
    torch.cuda.synchronize()
    flat_k, flat_v = other_cache[0].view(-1, HKV, D), other_cache[1].view(-1, HKV, D)
    assert torch.equal(flat_k[slots], other_k) and torch.equal(flat_v[slots], other_v)
    assert torch.equal(k_cache.view(-1, HKV, D)[slots], k), "the relaunch wrote the recorded cache"
    # A launch Triton compiles anew (float16: a variant first seen here) is recorded as None.
    k16 = _rows(3).half()
    c16 = torch.zeros(8, BLOCK, HKV, D, dtype=torch.float16, device="cuda")
    with record_launches() as launches:
        tk.store_kv(k16, k16, c16, c16, slots)
        tk.store_kv(k16, k16, c16, c16, slots)
    assert launches[0] is None and launches[1] is not None
