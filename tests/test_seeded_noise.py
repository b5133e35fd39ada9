"""The seeded rows' sampling noise in one launch (engine/kernels/seeded_noise.py, the sampler's
path on CUDA) on a CPU under Triton's interpreter and on a GPU: a row's noise is a function of
its seed alone (the same bits in any row of any batch), rows not named stay as they were, the
draws are Exp(1); and the sampler on that path keeps tests/test_sampler.py's seeded rules: a
seeded row's token is the same alone and in a batch, seed and step change it, and across steps
the draws follow the row's probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import interpret


def check_noise(device: str) -> None:
    from engine.kernels.seeded_noise import exponential_rows

    dev = torch.device(device)
    vocab = 50_000
    noise = torch.full((5, vocab), -1.0, device=dev)
    rows = torch.tensor([3, 0, 4], device=dev)
    seeds = torch.tensor([7, 2**63 - 1, 7], device=dev)
    exponential_rows(noise, rows, seeds)
    assert torch.equal(noise[3], noise[4]), "one seed, two rows: other bits"
    assert (noise[1:3] == -1.0).all(), "a row not named was written"
    alone = torch.full((1, vocab), -1.0, device=dev)
    exponential_rows(alone, torch.tensor([0], device=dev), seeds[1:2])
    assert torch.equal(alone[0], noise[0]), "a row's noise changed with the batch around it"
    assert not torch.equal(noise[0], noise[3]), "two seeds gave the same noise"
    for row in (noise[0], noise[3]):
        assert torch.isfinite(row).all() and (row >= 0).all()
        # Exp(1): mean 1 (standard error 1 / sqrt(vocab) = 0.0045), P(x > 1) = 1 / e (0.0022).
        assert abs(row.double().mean().item() - 1.0) < 0.03
        assert abs((row > 1).double().mean().item() - math.exp(-1)) < 0.015


def check_sampler(device: str) -> None:
    from test_sampler import assert_close, make_request

    from engine.runner.sampler import Sampler
    from engine.runner.sampling_batch import SamplingBatch

    dev = torch.device(device)

    def sample(logits: torch.Tensor, requests: list, seed: int = 0) -> list[int]:
        sampler = Sampler(seed=seed, device=dev)
        sampler.seeded_kernel = True
        return sampler(logits.to(dev), SamplingBatch.from_requests(requests, dev)).token_ids

    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    seeded = make_request(seed=1234, output=[7, 8, 9])
    alone = {sample(logits, [seeded], seed=s)[0] for s in range(3)}
    assert len(alone) == 1
    others = [make_request(), make_request(temperature=0.0), make_request(seed=99, top_k=5)]
    big = torch.cat([torch.randn(3, vocab), logits, torch.randn(2, vocab)])
    batch = [*others, seeded, make_request(top_p=0.5), make_request()]
    assert sample(big, batch, seed=77)[3] == alone.pop()
    flat = torch.zeros(1, vocab)
    assert len({sample(flat, [make_request(seed=s)])[0] for s in range(20)}) > 10
    assert len({sample(flat, [make_request(seed=1, output=[5] * n)])[0] for n in range(20)}) > 10
    probs = [0.5, 0.3, 0.2]
    rows = 600  # one step each, one batch: row i is step i of seed 11
    tokens = sample(torch.tensor(probs).log().repeat(rows, 1), [make_request(seed=11, output=[0] * i) for i in range(rows)])
    assert_close([tokens.count(i) / rows for i in range(3)], probs, tol=0.07)


def test_seeded_noise_under_the_interpreter() -> None:
    interpret("test_seeded_noise", "check_noise('cpu')\ncheck_sampler('cpu')\n", timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_noise_on_the_gpu() -> None:
    check_noise("cuda")
    check_sampler("cuda")


def test_the_kernel_compiles_for_hopper_without_spills() -> None:
    """sm_90 from this machine (bench/kernels/occupancy.py's compile): what a GPU would launch."""
    import os
    import sys

    pytest.importorskip("triton")
    kernels = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "kernels")
    sys.path.insert(0, kernels)
    try:
        from occupancy import compile_sm90
    finally:
        sys.path.remove(kernels)

    from engine.kernels.seeded_noise import BLOCK, _noise_kernel

    types = {"noise_ptr": "*fp32", "rows_ptr": "*i64", "seeds_ptr": "*i64", "vocab": "i32", "stride": "i32"}
    compiled = compile_sm90(_noise_kernel, types, {"BLOCK": BLOCK}, {"num_warps": 4}, ("vocab", "stride"))
    assert compiled["stack"] == 0 and compiled["per_sm_regs"] >= 4, {k: v for k, v in compiled.items() if k != "ttgir"}
