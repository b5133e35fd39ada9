"""CUDA graphs in bench_engine.py: the memory of the whole decode ladder against its largest graph
(section graph_memory), and a counter of the engine's graph replays (decode section)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from bench_runtime import MIB, say
from device_timing import free_memory

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.runner.cuda_graph import CudaGraphRunner

# ---- 3. graph memory ----------------------------------------------------------------------------


def graph_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Capture the ladder, then the largest graph alone, each with a fresh backend, on an engine
    that captured nothing itself; compare the memory of each capture's graph pool (`pool_bytes`).
    The engine loads the checkpoint as bench_engine.py says (`args.engine_options`: an MoE shape's
    random weights in place); the fused MoE workspace is the engine's, outside both pools."""
    core = EngineCore(EngineConfig(
        model=args.model_path, device=args.device, dtype="bfloat16", disable_cuda_graph=True,
        attention_backend=args.attention_backend,
        num_kv_blocks=args.graph_kv_blocks, max_num_seqs=args.graph_max_bs,
        max_model_len=args.max_model_len, **getattr(args, "engine_options", {}),
    ))
    runner = core.runner
    device = runner.device
    if not type(runner.attn_backend).supports_cuda_graph:
        name = runner.backend_name
        del core, runner
        free_memory(device)
        raise RuntimeError(f"attention backend {name!r} does not support CUDA graphs")
    vocab = core.model_config.vocab_size
    max_bs = args.graph_max_bs

    # A throwaway capture first pays one-time costs (kernel compilation, cuBLAS workspaces of the
    # capture stream) so that neither measured capture carries them.
    _capture(runner, max_bs, vocab, [max_bs])
    ladder, sizes, ladder_s = _capture(runner, max_bs, vocab, None)
    say(f"graph memory: ladder of {len(sizes)} graphs (bs {sizes[0]}..{sizes[-1]}): {ladder / MIB:.1f} MiB in {ladder_s:.1f} s")
    single, _, single_s = _capture(runner, max_bs, vocab, [max_bs])
    say(f"graph memory: bs {max_bs} alone: {single / MIB:.1f} MiB in {single_s:.1f} s")
    del core, runner
    free_memory(device)
    return {"max_bs": max_bs, "ladder_batch_sizes": sizes, "ladder_bytes": ladder, "single_bytes": single,
            "ratio": ladder / single if single > 0 else None, "ladder_capture_s": ladder_s,
            "single_capture_s": single_s}


def _capture(runner: Any, max_bs: int, vocab: int, batch_sizes: list[int] | None) -> tuple[int, list[int], float]:
    """One capture with a fresh backend over the engine's KV cache; (pool_bytes, sizes, seconds)."""
    backend = runner.make_backend(runner.kv_cache)
    graphs = CudaGraphRunner(runner.model, backend, max_bs, vocab, runner.device, batch_sizes=batch_sizes)
    t = time.perf_counter()
    graphs.capture()
    result = (graphs.pool_bytes, list(graphs.batch_sizes), time.perf_counter() - t)
    del graphs, backend
    free_memory(runner.device)
    return result


# ---- graph replays, counted for section 4 -------------------------------------------------------


def count_graph_replays(core: EngineCore) -> list[int]:
    """Wraps the engine's graph runners so the benchmark can tell replayed steps from eager ones:
    [steps replayed from a decode graph, steps run through the piecewise graphs (prefill and
    mixed steps)], counted as they happen."""
    counter = [0, 0]
    for i, graphs in enumerate((core.runner.graphs, core.runner.piecewise)):
        if graphs is not None:
            graphs.run = _counted(graphs.run, counter, i)  # type: ignore[method-assign]
    return counter


def _counted(run: Callable[..., Any], counter: list[int], i: int) -> Callable[..., Any]:
    def counted(*a: Any, **kw: Any) -> Any:
        counter[i] += 1
        return run(*a, **kw)

    return counted
