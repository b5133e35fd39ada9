"""Qwen3-MoE on a GPU (`pytest -m gpu`): the sparse layers' CUDA forward (engine/kernels/fused_moe.py)
against the torch reference the CPU runs, on the tiny checkpoint: the same router choices, logits
within fp32 rounding, and the engine's greedy tokens (graphs on) equal transformers'."""

from __future__ import annotations

import pytest
import torch
from oracle import hf_greedy
from test_models import PagedRunner, assert_close, random_tokens

from engine.config import EngineConfig, ModelConfig
from engine.models import get_model_class
from engine.weights.loader import load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(path: str, device: str) -> torch.nn.Module:
    config = ModelConfig.from_hf(path)
    with torch.device(device):
        model = get_model_class(config.architecture)(config)
    load_checkpoint(model, path)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe_dir", "qwen2_moe_dir", "mixtral_dir"])
def test_cuda_forward_equals_the_reference(family: str, request: pytest.FixtureRequest) -> None:
    """Qwen3-MoE, Qwen2-MoE with its shared expert (a dense MLP on the fused path), Mixtral."""
    pytest.importorskip("engine.kernels.fused_moe")
    path = request.getfixturevalue(family)
    cpu, gpu = _model(path, "cpu"), _model(path, "cuda")
    routed = {"cpu": cpu.capture_routed_experts(64), "cuda": None}
    with torch.device("cuda"):
        routed["cuda"] = gpu.capture_routed_experts(64)
    prompts = {i: random_tokens(n, seed=i) for i, n in enumerate([37, 5, 16])}
    ours = PagedRunner(gpu, 16).step(prompts)
    ref = PagedRunner(cpu, 16).step(prompts)
    for i in prompts:
        assert_close(ours[i].cpu(), ref[i])
    total = sum(len(p) for p in prompts.values())
    assert torch.equal(routed["cuda"].last(total).cpu(), routed["cpu"].last(total))


def test_engine_greedy_equals_transformers(qwen3_moe_dir: str) -> None:
    pytest.importorskip("engine.kernels.fused_moe")
    from engine.core.engine_core import EngineCore
    from engine.core.protocol import AddRequest
    from engine.request import SamplingParams

    prompts = [random_tokens(n, seed=10 + n) for n in (3, 17, 40)]
    want = hf_greedy(qwen3_moe_dir, prompts, 16)
    core = EngineCore(EngineConfig(model=qwen3_moe_dir, device="cuda", dtype="float32", num_kv_blocks=128,
                                   max_num_seqs=8, cuda_graph_max_bs=8, max_model_len=512))  # fmt: skip
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert core.add_request(AddRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params)) is None
    ids: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_work():
        for d in core.step():
            ids[d.request_id] += d.new_token_ids
    assert [ids[str(i)] for i in range(len(prompts))] == want


def test_served_with_graphs_routes_releases_and_resumes(qwen3_moe_dir: str) -> None:
    """The engine process on the GPU (decode and piecewise graphs, the fused kernels): greedy
    tokens and every position's routed experts as transformers'; with every tag released it holds
    what an idle CUDA process holds (the MoE workspace and the routes' record live in the
    `cuda_graph` region); after a resume that poisons what it maps again, the same answers."""
    pytest.importorskip("engine.kernels.fused_moe")
    from test_gpu_memory import RESIDUAL_OVER_IDLE, _idle_footprint, _process_used
    from test_routed_experts import rows, want

    from engine import Engine, SamplingParams

    prompts = [random_tokens(n, seed=20 + n) for n in (3, 17, 40, 9, 70)]
    expected = hf_greedy(qwen3_moe_dir, prompts, 12)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    with Engine(model=qwen3_moe_dir, device="cuda", dtype="float32", max_model_len=512, num_kv_blocks=256,
                max_num_seqs=16, cuda_graph_max_bs=8, enable_return_routed_experts=True,
                debug_poison_on_resume=True) as llm:  # fmt: skip
        assert llm.info["cuda_graph_batch_sizes"] and llm.info["piecewise_cuda_graph_tokens"]
        for attempt in ("startup", "after a poisoned resume"):
            outs = llm.generate(input_ids=prompts, sampling_params=params)
            assert [o.output_ids for o in outs] == expected, attempt
            for p, o in zip(prompts, outs, strict=True):
                assert torch.equal(rows(o.routed_experts), want(qwen3_moe_dir, (p + o.output_ids)[:-1])), attempt
            llm.release_memory_occupation()
            if attempt == "startup":
                held, idle = _process_used(llm._core.process.pid), _idle_footprint()["per_pid"]
                if held is not None and idle is not None:
                    assert held - idle <= RESIDUAL_OVER_IDLE, (held, idle)
            llm.resume_memory_occupation()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("family", ["qwen3_moe_dir", "qwen2_moe_dir"])
def test_two_ranks_with_graphs_equal_transformers_and_route_alike(family: str, request: pytest.FixtureRequest) -> None:
    """TP=2 on two GPUs: each rank holds a slice of every expert's intermediate dimension (and of
    Qwen2-MoE's shared expert), the partial sums meet in the layer's all-reduce, captured in the
    decode graphs. Greedy tokens are transformers', and the routed experts both ranks record are
    transformers' router's (Qwen3-MoE's layout)."""
    pytest.importorskip("engine.kernels.fused_moe")
    from test_routed_experts import rows, want

    from engine import Engine, SamplingParams

    path = request.getfixturevalue(family)
    prompts = [random_tokens(n, seed=30 + n) for n in (3, 17, 40)]
    expected = hf_greedy(path, prompts, 12)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    with Engine(model=path, device="cuda", dtype="float32", tp_size=2, max_model_len=512, num_kv_blocks=256,
                max_num_seqs=16, cuda_graph_max_bs=8, enable_return_routed_experts=True) as llm:  # fmt: skip
        assert llm.get_server_info()["tp_size"] == 2 and llm.info["cuda_graph_batch_sizes"]
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        assert [o.output_ids for o in outs] == expected
        for p, o in zip(prompts, outs, strict=True):
            if family == "qwen3_moe_dir":
                assert torch.equal(rows(o.routed_experts), want(path, (p + o.output_ids)[:-1]))
