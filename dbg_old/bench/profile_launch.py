"""Host time of one launch of the kernels an eager (prefill or mixed) step launches per layer, at
the 0.6B attention shape (16 heads, 8 KV heads, head_dim 128) and a small mixed step's rows (a
16-token chunk beside 4 decodes: the arguments of any mixed step, with device work short enough
that the host never waits for it): through Triton's JIT path (the `Launcher` told to skip its cache), through
engine/launcher.py's `Launcher` (a repeat launch), and a torch op for scale. The
host's time per launch is the median over 25 rounds of 200 launches, each round started on an
idle device (fewer launches than the driver's queue holds: the host never waits on the device),
the two paths' rounds interleaved (the host's speed drifts within a process). Results: bench/RESULTS.md, nineteenth session.

    python3 bench/profile_launch.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch

from engine.attention import triton_decode as td
from engine.attention import triton_kernels as tk
from engine.attention import triton_prefill as tp
from engine.launcher import Launcher

H, HKV, D, BLOCK = 16, 8, 128, 16
CHUNK, DECODES, CTX = 16, 4, 16  # a mixed step's rows, small: the device keeps up with the host


def host_us(fns: list[Callable[[], None]], n: int = 200, rounds: int = 25) -> list[float]:
    """Median host microseconds per call of each fn, over rounds of n calls each, the rounds of the
    fns interleaved (the host's speed drifts within a process) and the device drained before
    each: n launches stay below the driver's queue, so the host never waits for the device."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times, strict=True):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            ts.append((time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize()
    return [statistics.median(ts) for ts in times]


def main() -> None:
    dev = "cuda"
    tokens, seqs = CHUNK + DECODES, 1 + DECODES
    blocks = seqs * (CTX + CHUNK) // BLOCK
    k_cache = torch.zeros(blocks, BLOCK, HKV, D, dtype=torch.bfloat16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(tokens, H, D, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    k, v = (torch.randn(tokens, HKV, D, device=dev).to(torch.bfloat16) for _ in range(2))
    qsl = torch.tensor([0] + [CHUNK + i for i in range(seqs)], dtype=torch.int32, device=dev)
    seq_lens = torch.full((seqs,), CTX, dtype=torch.int32, device=dev)
    seq_lens[0] = CHUNK
    tables = torch.randperm(blocks, device=dev).int().view(seqs, -1)
    slots = torch.arange(tokens, dtype=torch.int64, device=dev)
    part_out, part_lse = torch.empty(1, device=dev), torch.empty(1, device=dev)

    def store() -> None:
        tk.store_kv(k, v, k_cache, v_cache, slots)

    def prefill() -> None:
        tp.prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, out, D**-0.5, CHUNK, skip_single=True)

    def decode() -> None:
        td.decode_attention(q, k_cache, v_cache, tables, seq_lens, out, D**-0.5, 1, part_out, part_lse, query_start_loc=qsl)

    cases = [("store_kv", store, tk._store_kv_kernel), ("prefill (mixed)", prefill, tp._prefill_kernel),
             ("decode (mixed)", decode, td._decode_kernel)]  # fmt: skip
    print(f"{torch.cuda.get_device_name()}; host us per launch, median of 25 rounds x 200")
    print("| kernel | Triton JIT path | Launcher | ratio |")
    print("| --- | --- | --- | --- |")
    for name, fn, launcher in cases:
        fn()  # compiled, and known to the Launcher

        def jit_path(fn: Callable[[], None] = fn, launcher: Launcher = launcher) -> None:
            launcher._fast = False  # the same call site, down Triton's JIT path
            try:
                fn()
            finally:
                launcher._fast = True

        slow, fast = host_us([jit_path, fn])
        print(f"| {name} | {slow:.1f} | {fast:.1f} | {slow / fast:.2f} |", flush=True)
    print(f"| torch `out.add_(1)` | {host_us([lambda: out.add_(1)])[0]:.1f} | - | - |")


if __name__ == "__main__":
    main()
