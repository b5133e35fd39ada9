"""`--deterministic` on CUDA (`pytest -m gpu`): tests/test_deterministic.py's tests with the engine
on the GPU. A request's tokens and logprobs are bit for bit the same alone and among random
companions (before and after it, sharing its prefix or not), across prefill chunk sizes, overlap
on and off and a release/resume, in float32 and bfloat16; re-scoring equals generation. On CUDA
the mode's matmuls are engine/kernels/invariant_matmul.py's (half precision) and it runs eagerly
with the row-wise attention."""

from __future__ import annotations

import pytest
import torch
from test_deterministic import (  # noqa: F401  (collected here, on CUDA)
    test_a_request_is_bitwise_the_same_whatever_else_runs,
    test_scoring_equals_generation,
    test_unseeded_requests_get_their_own_generators,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def device() -> str:
    return "cuda"
