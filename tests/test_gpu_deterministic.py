"""`--deterministic` on CUDA (`pytest -m gpu`): tests/test_deterministic.py's tests with the engine
on the GPU. A request's tokens and logprobs are bit for bit the same alone and among random
companions (before and after it, sharing its prefix or not), across prefill chunk sizes, overlap
on and off, preemption and recompute and a release/resume, in float32 and bfloat16; re-scoring equals generation. On CUDA
the mode's matmuls are engine/kernels/invariant_matmul.py's (half precision), its attention the
fixed-split kernel (engine/attention/triton_fixed.py), and its steps replay CUDA graphs, decode
and piecewise: a request's bits are the same replayed as run eagerly. A mixture of experts runs
the torch reference with those matmuls, eagerly."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import run_core
from test_deterministic import (  # noqa: F401  (collected here, on CUDA)
    KNOBS,
    companions,
    target,
    test_a_request_is_bitwise_the_same_whatever_else_runs,
    test_mixture_of_experts_sums_each_tokens_experts_in_expert_order,
    test_preemption_and_recompute_leave_a_request_bitwise_the_same,
    test_scoring_equals_generation,
    test_unseeded_requests_get_their_own_generators,
)
from test_models import random_tokens

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def device() -> str:
    return "cuda"


def _count_runs(core: EngineCore) -> list[int]:
    """[decode-graph replays, piecewise-graph steps], counted as the runners run (each calls through)."""
    counted = [0, 0]
    for i, runner in enumerate((core.runner.graphs, core.runner.piecewise)):
        if runner is not None:
            def run(*a, _run=runner.run, _i=i, **kw):
                counted[_i] += 1
                return _run(*a, **kw)

            runner.run = run
    return counted


@pytest.mark.parametrize("checkpoint", ["qwen3_dir", "wide_qwen3_dir"])
def test_graphs_replay_the_bits_of_eager_steps(checkpoint: str, request: pytest.FixtureRequest) -> None:
    """The mode's default backend on CUDA is the fixed-split kernel, with decode and piecewise
    graphs. A request alone (decode steps of one row: 16-row matmul tiles, the split attention)
    and among 20 companions (steps of more than 16 rows: 64-row tiles, one program a token)
    gives the same tokens and logprobs, replayed or eager, bit for bit. At Qwen3-0.6B's widths
    the mode's batch decode (engine/decode/batch_decode.py `invariant`) runs those decode steps,
    replayed and eager, and gives the bits of the engine without it (`batch_decode=False`: the
    layers one op at a time); the tiny Qwen3's shape gets none (rules.py INVARIANT_WARPS)."""
    from engine.decode.batch_decode import BatchDecode

    path = request.getfixturevalue(checkpoint)
    wide = checkpoint == "wide_qwen3_dir"
    prompt = random_tokens(37, seed=3)
    others, params = companions(random.Random(7), prompt, 20)
    batches = [([prompt], [target()]), ([*others[:4], prompt, *others[4:]], [*params[:4], target(), *params[4:]])]
    results, replays = {}, {}
    runs = [(True, True), (False, True)] + [(True, False)] * wide  # (graphs, batch decode)
    for graphs, batch in runs:
        core = EngineCore(EngineConfig(model=path, device="cuda", dtype="bfloat16", disable_cuda_graph=not graphs,
                                       batch_decode=batch, **KNOBS | dict(max_num_seqs=32, max_num_batched_tokens=24)))  # fmt: skip
        assert core.runner.backend_name == "triton_fixed"
        paths = core.runner.decode_paths
        assert len(paths) == int(wide and batch) and all(isinstance(p, BatchDecode) and p.invariant for p in paths)
        assert all((runner is not None) == graphs for runner in (core.runner.graphs, core.runner.piecewise))
        counted = _count_runs(core)
        results[graphs, batch] = []
        for prompts, params in batches:  # each request's (tokens, logprobs), in order
            outs = run_core(core, [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))])
            results[graphs, batch].append([outs[str(i)][:2] for i in range(len(prompts))])
        replays[graphs, batch] = counted
        del core
        torch.cuda.empty_cache()
    assert replays[True, True][0] > 0 and replays[True, True][1] > 0, replays  # decode graphs and piecewise graphs both ran
    alone, among = results[True, True]
    assert among[4] == alone[0]
    assert all(results[run] == results[True, True] for run in runs)
