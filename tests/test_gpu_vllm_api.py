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
    proc.long_request, proc.pause_after_s = 500, 0.02  # a token is well under a ms here
    yield proc
    proc.stop()


def test_vllm_ipc_update(http, model_name, models, qwen3_next_dir: str) -> None:  # noqa: F811  (the fixtures above)
    """vLLM's CUDA-IPC weight transfer over HTTP, as its trainer sends it
    (vllm/distributed/weight_transfer/ipc_engine.py, IPCWeightTransferEngine.trainer_send_weights,
    mode "http"): per tensor a {GPU UUID: reduce_tensor(weight)} handle, pickled and base64'd in
    update_info.ipc_handles_pickled. The engine rebuilds them on its GPU: the new weights' tokens."""
    import base64
    import pickle

    from oracle import hf_named_parameters
    from test_vllm_api import _generate, greedy
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    weights = [(n, t.detach().to("cuda").contiguous()) for n, t in hf_named_parameters(qwen3_next_dir)]
    info = {"names": [n for n, _ in weights], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps([{uuid: reduce_tensor(t)} for _, t in weights])).decode()}  # fmt: skip
    r = http.post("/update_weights", json={"update_info": info})
    assert r.status_code == 200, r.text
    assert _generate(http, model_name).json()["choices"][0]["token_ids"] == greedy(models["new"], [5, 9, 13, 200, 7, 31, 64], 12)
    wrong = [{"GPU-00000000": reduce_tensor(t)} for _, t in weights]
    bad = http.post("/update_weights", json={"update_info": info | {"ipc_handles_pickled": base64.b64encode(pickle.dumps(wrong)).decode()}})
    assert bad.status_code == 400 and "no IPC handle for this GPU" in bad.json()["error"]["message"]
