"""The RL flip fanned out through the real SGLang Model Gateway to two replicas on GPUs (`pytest -m
gpu` on the device machine): replica i on GPU i where there are two, both on GPU 0 where there is
one. Under smg's `paused(...)`: release everything on both (each replica's bytes come back to the
driver), resume the weights, update both from disk to a new checkpoint, resume the KV cache and
graphs; then every replica generates what transformers generates on the new weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from gateway_util import Gateway, replicas
from oracle import greedy_of
from server_util import ServerProcess
from transformers import AutoModelForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("smg")

PROMPTS = [[5, 17, 33, 60, 7], [9, 100, 200, 301]]
N = 16
EVERY = "engine=sglang"
# float32, 2 layers x 2 KV heads x 16 dims: 8 KiB a block; 512 MiB of KV per replica.
SERVER_ARGS = ("--device", "cuda", "--num-kv-blocks", "65536")


def _hf_greedy(model_dir: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    return greedy_of(model, PROMPTS, N)


def _outputs(url: str) -> tuple[list[list[int]], set[str]]:
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    outs = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    return [o["output_ids"] for o in outs], {o["meta_info"]["weight_version"] for o in outs}


def _free_bytes(devices: list[int]) -> list[int]:
    return [torch.cuda.mem_get_info(d)[0] for d in devices]


@pytest.fixture(scope="module")
def pair(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[ServerProcess]]]:
    envs = [{"CUDA_VISIBLE_DEVICES": str(i % torch.cuda.device_count())} for i in range(2)]
    with replicas(qwen3_dir, str(tmp_path_factory.mktemp("gpu-gateway")), 2, server_args=SERVER_ARGS, envs=envs) as both:
        yield both


def test_the_rl_flip_fans_out_to_both_replicas(pair, qwen3_dir: str, qwen3_next_dir: str) -> None:
    from smg.rl import RL, paused

    gateway, servers = pair
    old, new = _hf_greedy(qwen3_dir), _hf_greedy(qwen3_next_dir)
    assert old != new
    for s in servers:
        assert _outputs(s.url)[0] == old
    devices = sorted({i % torch.cuda.device_count() for i in range(2)})
    held = []  # each replica's regions: weights, KV cache, graphs and workspaces
    for s in servers:
        info = httpx.get(f"{s.url}/server_info", timeout=30).json()
        held.append(info["weights_bytes"] + info["kv_cache_bytes"] + info["cuda_graph_bytes"])
    rl = RL(gateway.url, timeout=300.0)
    with paused(rl, EVERY, mode="abort"):
        before = _free_bytes(devices)
        released = rl.fanout("release_memory_occupation", {}, selector=EVERY)
        gained = sum(a - b for a, b in zip(_free_bytes(devices), before, strict=True))
        assert gained >= 0.95 * sum(held), (gained, held)  # both replicas' pages went back to the driver
        # A replica measures the device's free memory: on a shared GPU it also sees the other's pages.
        freed = sorted(r.body["bytes_freed"] for r in released.results.values())
        assert all(f >= 0.95 * h for f, h in zip(freed, sorted(held), strict=True)), (freed, held)
        def resume(tags: list[str]) -> None:
            resumed = rl.fanout("resume_memory_occupation", {"tags": tags}, selector=EVERY)
            assert all(r.body["success"] for r in resumed.results.values())

        resume(["weights"])
        update = rl.fanout("update_weights_from_disk", {"model_path": qwen3_next_dir, "weight_version": "gpu-1"},
                           selector=EVERY)
        assert {r.body["weight_version"] for r in update.results.values()} == {"gpu-1"}
        resume(["kv_cache", "cuda_graph"])
    for s in servers:
        assert _outputs(s.url) == (new, {"gpu-1"})
    assert _outputs(gateway.url) == (new, {"gpu-1"})
