"""vLLM's RL dialect on a GPU (`pytest -m gpu`): tests/test_vllm_api.py's step sequences against a
server on CUDA (float32, so greedy tokens are transformers'; decode and piecewise graphs, overlap
scheduling, memory regions): prime-rl's pause keep -> disk update -> resume, where the frozen
request's graph state must carry across the update; sleep and wake as releases; a sleep that
keeps requests frozen; tokens-in generate. (SkyRL's NCCL broadcast needs a trainer GPU of its own:
the two-GPU kinds.)"""

from __future__ import annotations

import pytest
import torch
from server_util import ServerProcess
from test_vllm_api import (  # noqa: F401  (fixtures and tests collected here, on this module's server)
    http,
    model_name,
    models,
    test_level_2_sleep_needs_an_update_before_the_wake,
    test_prime_rl_pause_keep_disk_update_resume,
    test_skyrl_sleep_wake_is_a_release,
    test_sleep_keep_freezes_requests_until_the_wake,
    test_tokens_in_generate_equals_transformers,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    log = str(tmp_path_factory.mktemp("logs") / "gpu_vllm_api_server.log")
    proc = ServerProcess(None, "--model", qwen3_dir, "--device", "cuda", "--dtype", "float32", "--max-model-len", "512",
                         "--cuda-graph-max-bs", "8", log_path=log)  # fmt: skip
    yield proc
    proc.stop()
