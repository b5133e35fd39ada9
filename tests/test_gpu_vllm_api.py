"""vLLM's RL dialect on a GPU (`pytest -m gpu`): tests/test_vllm_api.py's step sequences against a
server on CUDA (float32, so greedy tokens are transformers'; decode and piecewise graphs, overlap
scheduling, memory regions): prime-rl's pause keep -> disk update -> resume, where the frozen
request's graph state must carry across the update; sleep and wake as releases; a sleep that
keeps requests frozen; tokens-in generate; vLLM's CUDA-IPC update; and, with a second GPU for the
trainer, SkyRL's update over vLLM's NCCL backend, the trainer speaking vLLM's own wire."""

from __future__ import annotations

from typing import Any

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one")
def test_skyrl_nccl_update_from_vllms_own_trainer(http, model_name, models, qwen3_dir: str, qwen3_next_dir: str) -> None:  # noqa: F811
    """SkyRL's weight sync over vLLM's NCCL backend (broadcast_strategy.py::_send_chunks_vllm_native):
    /init_weight_transfer_engine with BroadcastInitInfo's payload while the trainer, on GPU 1,
    runs vLLM's NCCLWeightTransferEngine.trainer_init (tests/vllm_trainer.py: the
    StatelessProcessGroup store, the pickled ncclUniqueId, PyNccl's warm-up all-reduce); then
    /update_weights {update_info} while it runs trainer_send_weights, per tensor and packed.
    Each update's greedy tokens are transformers' on the pushed weights."""
    from oracle import hf_named_parameters
    from server_util import free_port
    from test_vllm_api import PROMPT, N, _generate, _in_thread, greedy
    from vllm_trainer import trainer_init, trainer_send_weights

    from server.vllm_weights_api import VLLM_GROUP

    gpu = torch.device("cuda", 1)
    world_size = http.get("/get_world_size").json()["world_size"]

    def init() -> Any:
        port = free_port()
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size + 1}
        joiner, joined = _in_thread(lambda: http.post("/init_weight_transfer_engine", json={"init_info": init_info}))
        trainer = trainer_init("127.0.0.1", port, world_size + 1, gpu)
        joiner.join(120)
        assert joined and joined[0].status_code == 200, joined and joined[0].text
        return trainer

    def update(trainer: Any, model_dir: str, key: str, packed: bool) -> None:
        pairs = [(n, t.to(gpu)) for n, t in hf_named_parameters(model_dir)]
        info = {"names": [n for n, _ in pairs], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in pairs],
                "shapes": [list(t.shape) for _, t in pairs], "packed": packed}
        sender, sent = _in_thread(lambda: http.post("/update_weights", json={"update_info": info}))
        trainer_send_weights(trainer, pairs, packed)
        sender.join(120)
        assert sent and sent[0].status_code == 200, sent and sent[0].text
        assert sent[0].json()["receive_route"].startswith("packed") == packed
        assert _generate(http, model_name).json()["choices"][0]["token_ids"] == greedy(models[key], PROMPT, N), (key, packed)

    trainer = init()
    for model_dir, key, packed in ((qwen3_next_dir, "new", False), (qwen3_dir, "old", True),
                                   (qwen3_next_dir, "new", True), (qwen3_dir, "old", False)):
        update(trainer, model_dir, key, packed)
    update(init(), qwen3_next_dir, "new", False)  # a restarted trainer: the second init replaces the group
    assert http.post("/destroy_weights_update_group", json={"group_name": VLLM_GROUP}).status_code == 200


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one")
def test_prime_rl_nccl_broadcaster_from_vllms_own_trainer(http, model_name, models, qwen3_next_dir: str, tmp_path) -> None:  # noqa: F811
    """prime-rl's NCCL broadcast (tests/test_vllm_api.py's test of it, here over NCCL): its
    trainer on GPU 1 joins with vLLM's trainer_init (tests/vllm_trainer.py) while
    /init_broadcaster runs, then sends its chunks per tensor while /update_weights {weight_dir}
    reads their manifests. Greedy tokens are transformers' on the pushed weights."""
    from oracle import hf_named_parameters
    from server_util import free_port
    from test_vllm_api import PROMPT, N, _generate, _in_thread, greedy, prime_rl_nccl_update
    from vllm_trainer import trainer_init, trainer_send_weights

    from server.vllm_weights_api import PRIME_GROUP

    gpu = torch.device("cuda", 1)
    port = free_port()
    body = {"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": 1, "timeout": 120,
            "quantize_in_weight_transfer": False}
    joiner, joined = _in_thread(lambda: http.post("/init_broadcaster", json=body))
    trainer = trainer_init("127.0.0.1", port, 2, gpu)
    joiner.join(120)
    assert joined and joined[0].status_code == 200, joined and joined[0].text
    pairs = [(n, t.to(gpu)) for n, t in hf_named_parameters(qwen3_next_dir)]
    try:
        prime_rl_nccl_update(http, pairs, lambda chunk: trainer_send_weights(trainer, chunk), tmp_path / "step_1")
        assert _generate(http, model_name).json()["choices"][0]["token_ids"] == greedy(models["new"], PROMPT, N)
    finally:
        assert http.post("/destroy_weights_update_group", json={"group_name": PRIME_GROUP}).status_code == 200


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
