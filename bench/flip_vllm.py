"""bench_flip.py's vLLM-dialect flip (push mode `vllm_ipc`): the flip of flip_trainer.py driven
through vLLM's RL routes (server/vllm_api.py, server/vllm_weights_api.py) as SkyRL drives a
colocated vLLM server, against the same server and engine state as the SGLang dialect:

- SkyRL puts the servers to sleep after the rollout (skyrl/train/trainer.py,
  `RayPPOTrainer.train`: `inference_engine_client.sleep()`;
  skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py,
  `RemoteInferenceClient.sleep`: POST /sleep {level, tags}), then syncs the weights
  (skyrl/backends/skyrl_train/workers/worker_dispatch.py, `WorkerDispatch.save_weights_for_sampler`,
  colocated: `wake_up(tags=["weights"])` -> the weight broadcast -> the trainer offloads ->
  `wake_up(tags=["kv_cache"])`; `RemoteInferenceClient.wake_up`: POST /wake_up {tags}).
- The weights travel by vLLM's CUDA-IPC weight-transfer backend over HTTP
  (vllm/distributed/weight_transfer/ipc_engine.py, `IPCWeightTransferEngine.trainer_send_weights`,
  mode "http"): per tensor a {GPU UUID: reduce_tensor(tensor)} handle, the list pickled and
  base64'd as `update_info.ipc_handles_pickled` beside names, dtype_names and shapes, in one
  POST /update_weights.

Rules:
- Parameters go in the query, as vLLM reads them (`/sleep?level=1&tags=...`, `/wake_up?tags=...`).
- The sleep names the SGLang flip's tags (kv_cache, weights, and cuda_graph with
  `--release-graphs`) at level 1 (`--vllm-sleep-level`): level 1 keeps the weights' host copy, as
  SGLang's release does, so both dialects release and restore the same regions the same way and
  their ratio is the dialects' own cost. SkyRL sleeps at level 2 with no tags;
  `--vllm-sleep-level 2` measures level 2.
- vLLM's IPC backend names each handle by a GPU's UUID and every worker rebuilds the one of its
  own GPU, so the tensors are made on the server's GPU (cuda:0 here); with tp_size > 1 each
  handle names every rank's GPU, with a copy on each (ranks 1.. are cuda:1..).
- On a CPU there is no CUDA IPC: the update goes through vLLM's other weight-transfer backend,
  the broadcast (gloo here): /init_weight_transfer_engine once per mode, then per flip
  /update_weights {names, dtype_names, shapes} while this process broadcasts each tensor, as
  SkyRL's broadcast strategy does. The section's `transport` says which.
- vLLM's update names no weight version: the engine keeps its own, which the flip records as its
  `weight_version`; the generate after must answer with it.
- The trainer's packing (handles, pickle, base64) is timed apart from the push, as the tensor
  mode's; the generate after is SGLang's /generate in both dialects (one check for both).
"""

from __future__ import annotations

import base64
import pickle
import time
from typing import Any
from urllib.parse import urlencode

import torch
from bench_runtime import free_port
from device_timing import sync
from flip_http import Beside, Http
from flip_trainer import Spec, conclude, new_weights, settle

from server.vllm_weights_api import VLLM_GROUP

VLLM_MODES = ("vllm_ipc",)


def query(path: str, **params: Any) -> str:
    """`path` with vLLM's query parameters (a list repeats its name: tags=a&tags=b)."""
    return f"{path}?{urlencode(params, doseq=True)}"


def setup(http: Http, device: torch.device, tp_size: int) -> tuple[Any, dict[str, Any]]:
    """(the broadcast group on a CPU, else None; what the section records of the transport)."""
    if device.type == "cuda":
        if device.index != 0:
            raise RuntimeError("vllm_ipc makes the tensors on the server's GPU (vLLM's IPC handles name the "
                               "GPU each worker rebuilds on): leave --trainer-gpu at the server's")
        return None, {"transport": "CUDA IPC: update_info.ipc_handles_pickled (vLLM's IPC backend)"}
    from engine.weights.groups import trainer_group

    port = free_port()
    body = {"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                          "world_size": 1 + tp_size}}
    t = time.perf_counter()
    call = Beside(http.post, "/init_weight_transfer_engine", body)
    group = trainer_group("127.0.0.1", port, 1 + tp_size, VLLM_GROUP, "gloo", device=device)
    answer, _ = call.result("the server did not join vLLM's weight-transfer group")
    return group, {
        "transport": "gloo broadcast: vLLM's broadcast weight-transfer backend (CUDA IPC needs a GPU)",
        "group": {"seconds": time.perf_counter() - t, "answer": answer, "body": body},
    }


def prepare(
    pairs: list[tuple[str, torch.Tensor]], others: list[torch.device], broadcast: bool
) -> tuple[dict[str, Any], Any, float]:
    """(the /update_weights body, what must stay alive until the answer, packing seconds)."""
    t = time.perf_counter()
    info: dict[str, Any] = {
        "names": [n for n, _ in pairs],
        "dtype_names": [str(x.dtype).split(".")[-1] for _, x in pairs],
        "shapes": [list(x.shape) for _, x in pairs],
    }
    alive: Any = pairs
    if not broadcast:
        from torch.multiprocessing.reductions import reduce_tensor

        alive = [pairs] + [[(n, x.to(d)) for n, x in pairs] for d in others]
        for d in others:
            sync(d)
        uuids = [str(torch.cuda.get_device_properties(copy[0][1].device).uuid) for copy in alive]
        handles = [
            {uuid: reduce_tensor(copy[i][1].detach().contiguous()) for uuid, copy in zip(uuids, alive, strict=True)}
            for i in range(len(pairs))
        ]
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("utf-8")
    return {"update_info": info}, alive, time.perf_counter() - t


def push(http: Http, body: dict[str, Any], alive: Any, group: Any) -> tuple[dict[str, Any], float]:
    """POST /update_weights, wall time; on a CPU with this process's broadcast beside it."""
    if group is None:
        return http.post("/update_weights", body)
    from engine.weights.groups import broadcast_from_trainer

    t = time.perf_counter()
    call = Beside(http.post, "/update_weights", body)
    broadcast_from_trainer(group, alive)
    answer, _ = call.result("/update_weights failed")
    return answer, time.perf_counter() - t


def vllm_flip(
    http: Http, specs: list[Spec], device: torch.device, seed: int, level: int, release_graphs: bool,
    prompts: list[list[int]], new_tokens: int, group: Any = None, others: list[torch.device] = (),
) -> dict[str, Any]:
    """One flip in vLLM's dialect: sleep -> new weights in the freed memory (+ packing) -> wake
    weights -> update_weights -> free -> wake kv_cache (+ cuda_graph) -> greedy generate (timed
    apart). The same keys as flip_trainer.flip's, so one summary and one table read both."""
    graphs = ["cuda_graph"] if release_graphs else []
    out: dict[str, Any] = {"mode": "vllm_ipc", "seed": seed, "sleep_level": level}
    rel, out["release_wall_s"] = http.post(query("/sleep", level=level, tags=["kv_cache", "weights", *graphs]))
    t = time.perf_counter()
    pairs = new_weights(specs, device, seed)
    out["trainer_make_s"] = time.perf_counter() - t
    body, alive, out["pack_s"] = prepare(pairs, list(others), group is not None)
    resw, out["resume_weights_wall_s"] = http.post(query("/wake_up", tags=["weights"]))
    pushed, out["push_wall_s"] = push(http, body, alive, group)
    out["weight_version"] = pushed.get("weight_version")  # the engine's own: vLLM's update names none
    del body, alive, pairs
    settle(out, [device, *others])
    resk, out["resume_kv_wall_s"] = http.post(query("/wake_up", tags=["kv_cache", *graphs]))
    return conclude(http, out, (rel, resw, pushed, resk), prompts, new_tokens)
