"""Piecewise CUDA graphs on a GPU (`pytest -m gpu` on the device machine), Triton attention:

- for every size of a ladder (max_num_batched_tokens 512), mixed steps (decode rows with cached
  context + a fresh prefill chunk + a chunk after a cached prefix) of exactly that size and of a
  padded size: the replay equals its eager reference (`run_eager`: same padding, buffers and
  calls) bit for bit, hidden states and KV cache; the KV cache outside the step's slots is left
  as it was (padding writes nothing); and the replay equals the plain eager forward: bit for bit
  when no row is padding, within a tolerance when the graphs' matmuls run on more rows than the
  plain forward's (cuBLAS may pick another kernel for another row count);
- capture reads and writes no KV, and replays stay right after other sizes ran;
- in a process with torch_memory_saver's hook: the graphs' pool is in the `cuda_graph` region,
  is released with it, and replays give the same bits after the resume.

Every measured difference is also written to $OUT/piecewise_diffs.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_piecewise_graph import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    Step,
    eager_forward,
    load_model,
    make_backend,
    make_runner,
    make_step,
    mixed_specs,
    random_cache,
    written,
)

from engine.attention import AttentionBackend
from engine.runner.piecewise_graph import PiecewiseGraphRunner, piecewise_token_sizes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NUM_BATCHED_TOKENS = 512
# Padded steps against the plain forward: fp32 differs by matmul reduction order only; bf16 by
# an ULP (0.4 %) at some q/k/v elements, carried through the layers.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DIFFS: dict[str, float] = {}


def _record(name: str, value: float) -> None:
    DIFFS[name] = value
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "piecewise_diffs.json"), "w") as f:
            json.dump(DIFFS, f, indent=1, sort_keys=True)


def _triton() -> type[AttentionBackend]:
    from engine.attention.triton import TritonBackend

    return TritonBackend


def _run_three_ways(
    runner: PiecewiseGraphRunner, model: torch.nn.Module, cache: torch.Tensor, cache0: torch.Tensor, step: Step
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states, KV cache after) of the plain forward, the eager reference and the replay,
    each from the cache `cache0`."""
    results = {}
    for name in ("plain", "reference", "replay"):
        cache.copy_(cache0)
        if name == "plain":
            hidden = eager_forward(model, runner.backend, step)
        elif name == "reference":
            hidden = runner.run_eager(step.input_ids, step.positions, step.meta)
        else:
            hidden = runner.run(step.input_ids, step.positions, step.meta)
        results[name] = (hidden.clone(), cache.clone())
    torch.cuda.synchronize()
    return results


def _steps(sizes: list[int], vocab: int) -> list[Step]:
    """For each ladder size: a step of exactly that many tokens and a padded one; one decode-only
    step (20 rows)."""
    steps = []
    previous = 0
    for size in sizes:
        for n in sorted({size, max(previous + 1, size - 3)}):
            steps.append(make_step(mixed_specs(n, seed=n), "cuda", vocab, seed=n))
        previous = size
    steps.append(make_step([(17 + 9 * i, 1) for i in range(20)], "cuda", vocab, seed=99))
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_ladder_size_replays_the_eager_forward(arch_dir: str, dtype: torch.dtype) -> None:
    model = load_model(arch_dir, dtype, "cuda")
    cache = random_cache(model, dtype, "cuda")
    cache0 = cache.clone()
    sizes = piecewise_token_sizes(MAX_NUM_BATCHED_TOKENS, NUM_BLOCKS * BLOCK_SIZE)
    assert sizes == [16, 32, 64, 128, 256, 384, 512]
    runner = make_runner(model, make_backend(_triton(), model, cache), sizes)
    runner.capture()
    assert torch.equal(cache, cache0), "capture wrote the KV cache"
    assert runner.num_attention_calls == model.config.num_layers
    assert all(len(runner.graphs[s]) == model.config.num_layers + 1 for s in sizes)
    tag = f"{os.path.basename(arch_dir.rstrip('/'))}-{str(dtype)[6:]}"
    _record(f"{tag}/pool_MiB", runner.pool_bytes / (1 << 20))

    steps = _steps(sizes, model.config.vocab_size)
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    for step in steps:
        n = step.num_tokens
        size = runner.padded_size(n)
        r = _run_three_ways(runner, model, cache, cache0, step)
        (plain, plain_kv), (ref, ref_kv), (got, got_kv) = r["plain"], r["reference"], r["replay"]
        first = first or (got, got_kv)
        assert torch.equal(got, ref), f"T={n}: replay differs from its eager reference"
        assert torch.equal(got_kv, ref_kv), f"T={n}: replay's KV differs from its eager reference's"
        rows, rest = written(got_kv, step.slots)
        assert torch.equal(rest, written(cache0, step.slots)[1]), f"T={n}: a write outside the step's slots"
        plain_rows = written(plain_kv, step.slots)[0]
        diff = (got.float() - plain.float()).abs().max().item()
        kv_diff = (rows.float() - plain_rows.float()).abs().max().item()
        _record(f"{tag}/T{n}_in_{size}/hidden", diff)
        _record(f"{tag}/T{n}_in_{size}/kv", kv_diff)
        if n == size:
            assert torch.equal(got, plain) and torch.equal(rows, plain_rows), f"T={n} (no padding): {diff}, {kv_diff}"
        else:
            tol = TOLERANCE[dtype]
            assert diff <= tol * max(1.0, plain.abs().max().item()), f"T={n} in {size}: hidden differs by {diff}"
            assert kv_diff <= tol * max(1.0, plain_rows.abs().max().item()), f"T={n} in {size}: KV differs by {kv_diff}"
    # The first step again, after every other size replayed through the shared pool.
    again = _run_three_ways(runner, model, cache, cache0, steps[0])["replay"]
    assert first is not None and torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


# ---- torch_memory_saver -------------------------------------------------------------------------


def _saver_child(model_dir: str) -> dict[str, object]:
    """In a process started with the saver's LD_PRELOAD hook: static buffers in the cuda_graph
    region, the ladder captured through the region's graph context; release and resume the
    cuda_graph and kv_cache regions; replay again."""
    from engine.memory.regions import MemoryRegions

    device = torch.device("cuda")
    memory = MemoryRegions(device, enabled=True)
    assert memory.enabled, "torch_memory_saver is not active in the child"
    dtype = torch.bfloat16
    model = load_model(model_dir, dtype, "cuda")
    host_cache = random_cache(model, dtype, "cpu")
    with memory.region("kv_cache"):
        cache = host_cache.to(device)
    sizes = piecewise_token_sizes(128, NUM_BLOCKS * BLOCK_SIZE)
    with memory.region("cuda_graph"):
        runner = make_runner(model, make_backend(_triton(), model, cache), sizes)
    runner.capture(memory.graph_capture)
    memory.bytes["cuda_graph"] += runner.pool_bytes
    steps = [make_step(mixed_specs(n, seed=n), "cuda", model.config.vocab_size, seed=n) for n in (13, 64, 100)]

    def replay_all() -> list[tuple[torch.Tensor, torch.Tensor]]:
        outs = []
        for step in steps:
            cache.copy_(host_cache)
            hidden = runner.run(step.input_ids, step.positions, step.meta).clone()
            outs.append((hidden, cache.clone()))
        torch.cuda.synchronize()
        return outs

    before = replay_all()
    torch.cuda.empty_cache()  # so that the release frees the regions' memory alone
    graph_release = memory.release(["cuda_graph"])
    kv_release = memory.release(["kv_cache"])
    resume = memory.resume(["cuda_graph", "kv_cache"])
    after = replay_all()
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after, strict=True))
    return {
        "pool_bytes": runner.pool_bytes,
        "static_bytes": runner.static_bytes,
        "graph_released_bytes": graph_release.bytes,
        "kv_released_bytes": kv_release.bytes,
        "resumed": resume.changed,
        "same": same,
    }


def test_graphs_in_the_memory_saver_region_replay_after_release_and_resume(qwen3_dir: str) -> None:
    tms = pytest.importorskip("torch_memory_saver")
    with tms.configure_subprocess():
        env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    proc = subprocess.run(
        [sys.executable, __file__, qwen3_dir], env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("pool_bytes", "graph_released_bytes", "kv_released_bytes"):
        _record(f"saver/{key}", result[key])
    assert result["same"], result
    assert result["resumed"] == ["cuda_graph", "kv_cache"], result
    # The pool and the static buffers went back to the driver with the region.
    assert result["graph_released_bytes"] >= result["pool_bytes"] + result["static_bytes"], result


if __name__ == "__main__":
    with torch.inference_mode():
        print(json.dumps(_saver_child(sys.argv[1])))
