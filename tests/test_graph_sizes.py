"""Which CUDA graphs an engine captures (engine/runner/graph_sizes.py), rule by rule. The rules
read the device's type only (and its memory when `cuda_graph_max_bs` is unset), so a CPU checks
them for a CUDA device with the graph size given."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention.sdpa import SdpaBackend
from engine.attention.triton import TritonBackend
from engine.config import EngineConfig, ModelConfig
from engine.runner.graph_sizes import GraphSizes
from engine.runner.piecewise_graph import piecewise_token_sizes

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def dense(qwen3_dir: str) -> ModelConfig:
    return ModelConfig.from_hf(qwen3_dir)


def _sizes(mc: ModelConfig, backend: type = TritonBackend, device: torch.device = CUDA, **knobs: object) -> GraphSizes:
    config = EngineConfig(model=mc.path, max_num_seqs=64, cuda_graph_max_bs=32, max_num_batched_tokens=2048)
    return GraphSizes.of(replace(config, **knobs), device, backend, mc)


def test_default_cuda_captures_decode_and_piecewise_graphs(dense: ModelConfig) -> None:
    sizes = _sizes(dense)
    assert (sizes.decode_max_bs, sizes.verify_rows, sizes.piecewise_max_tokens) == (32, 0, 2048)
    assert sizes.piecewise(10_000) == piecewise_token_sizes(2048, 10_000)
    assert sizes.piecewise(1000)[-1] == 1000  # never more tokens than the cache has slots
    assert _sizes(dense, cuda_graph_max_bs=500).decode_max_bs == 64  # at most max_num_seqs
    assert _sizes(dense, piecewise_cuda_graph_max_tokens=512).piecewise_max_tokens == 512


def test_none_on_a_cpu_or_when_disabled(dense: ModelConfig) -> None:
    assert _sizes(dense, device=torch.device("cpu")) == GraphSizes(0, 0, 0, 0)
    assert _sizes(dense, disable_cuda_graph=True) == GraphSizes(0, 0, 0, 0)
    assert _sizes(dense, piecewise_cuda_graph_max_tokens=0).piecewise(10_000) == []


def test_a_backend_without_graphs_keeps_piecewise_graphs_outside_the_mode(dense: ModelConfig) -> None:
    assert _sizes(dense, SdpaBackend) == GraphSizes(0, 0, 0, 2048)  # attention runs eagerly between pieces
    assert _sizes(dense, SdpaBackend, deterministic=True) == GraphSizes(0, 0, 0, 0)
    assert _sizes(dense, deterministic=True) == GraphSizes(32, 0, 0, 2048)


def test_verify_graphs_for_drafting_rows_outside_the_mode(dense: ModelConfig) -> None:
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3, "speculative_disable_by_batch_size": 8}
    assert _sizes(dense, **spec).verify_rows == 8 * 4
    assert _sizes(dense, deterministic=True, **spec).verify_rows == 0
    assert _sizes(dense, **spec).draft_rows == 0  # no draft model


def test_a_draft_model_gets_graphs_of_its_drafting_rows_in_both_modes(dense: ModelConfig) -> None:
    spec = {"speculative_algorithm": "draft", "speculative_draft_model_path": dense.path, "speculative_num_draft_tokens": 3,
            "speculative_disable_by_batch_size": 8}  # fmt: skip
    assert _sizes(dense, **spec).draft_rows == 8 * 4
    assert _sizes(dense, deterministic=True, **spec).draft_rows == 8 * 4  # its plain graphs serve the catch-up rows
    assert _sizes(dense, max_num_seqs=16, cuda_graph_max_bs=16, **spec).draft_rows == 16
    assert _sizes(dense, disable_cuda_graph=True, **spec).draft_rows == 0
    assert _sizes(dense, SdpaBackend, **spec).draft_rows == 0  # no decode graphs, none for the draft


def test_the_deterministic_mixture_of_experts_runs_eagerly(dense: ModelConfig) -> None:
    moe = replace(dense, num_experts=8)
    assert _sizes(moe, deterministic=True) == GraphSizes(0, 0, 0, 0)  # the torch reference syncs per expert
    assert _sizes(moe) == GraphSizes(32, 0, 0, 2048)
