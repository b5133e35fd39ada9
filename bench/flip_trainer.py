"""The trainer side of bench_flip.py: the checkpoint's tensor list (names, shapes, dtypes read from
the safetensors headers; for a checkpoint without weights, its config.json's model's), "new
weights" made in the freed memory, the three ways of pushing them
(a flattened bucket and per-tensor payloads over `update_weights_from_tensor`, a broadcast over a
weight-update group) and one timed flip over HTTP (flip_http.py's calls).

Rules:
- A checkpoint without weights (engine_shapes' MoE shapes: config.json alone, served with
  load_format dummy) lists the tensors of its Hugging Face model built on the meta device, in the
  config's dtype; per-expert names (transformers 4: `mlp.experts.{e}.gate_proj.weight`) are
  packed as transformers 5 names them (`mlp.experts.gate_up_proj` [E, 2I, hidden], gate rows
  then up rows; `mlp.experts.down_proj` [E, hidden, I]): 531 tensors at 30B-A3B, not 18,867.
- New weights are random (a generator seeded per flip, so every flip writes different values):
  normal(0, 0.02) for matrices, 1 + normal(0, 0.05) for 1-D tensors (norms), in the checkpoint's
  dtype, each tensor its own allocation. `checkpoint_weights` reads the checkpoint's own values.
- The trainer's packing (flatten + pickle) is timed apart from the push: it is not the server's.
- Everything the trainer made is freed (and CUDA IPC handles collected) before kv_cache resumes.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time
from typing import Any

import torch
from bench_runtime import free_port
from device_timing import sync
from flip_http import Beside, Http, Poster

from engine.weights.loader import INDEX_FILE, checkpoint_entries, iterate_checkpoint
from engine.weights.payload import flatten_bucket, serialize_named_tensors, serialize_payload

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
Spec = tuple[str, tuple[int, ...], torch.dtype]
GROUP = "bench_flip"
# The broadcast push modes and the load_format each sends: a broadcast per tensor, or one in all.
DIST_MODES = {"distributed": None, "distributed_bucket": "flattened_bucket"}
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_specs(path: str) -> list[Spec]:
    """(name, shape, dtype) of every tensor of the checkpoint, from the file headers only, in the
    order a trainer holds them: its Hugging Face model's `named_parameters()` (built on the meta
    device from the checkpoint's config; the files list them alphabetically)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    if not any(n.endswith(".safetensors") or n == INDEX_FILE for n in os.listdir(path)):
        return config_specs(path, model)
    specs = [(name, shape, DTYPES[dtype]) for name, shape, dtype in checkpoint_entries(path)]
    if not specs:
        raise RuntimeError(f"no safetensors tensors in {path}")
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return sorted(specs, key=lambda s: order.get(s[0], len(order)))


def config_specs(path: str, model: Any) -> list[Spec]:
    """A checkpoint without weights: its meta model's parameters, in the config's dtype, experts packed."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    dtype = getattr(torch, str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").removeprefix("torch."))
    specs: list[Spec] = []
    parts: dict[str, dict[str, tuple[int, ...]]] = {}  # experts prefix -> gate / up / down: one expert's shape
    count: dict[str, int] = {}  # experts prefix -> experts
    for name, p in model.named_parameters():
        m = _EXPERT.match(name)
        if m is None:
            specs.append((name, tuple(p.shape), dtype))
            continue
        prefix = m.group(1)
        if prefix not in parts:  # the packed pair takes the place of the first expert's tensors
            parts[prefix] = {}
            specs += [(f"{prefix}.gate_up_proj", (), dtype), (f"{prefix}.down_proj", (), dtype)]
        parts[prefix][m.group(3)] = tuple(p.shape)
        count[prefix] = max(count.get(prefix, 0), int(m.group(2)) + 1)
    for i, (name, _, d) in enumerate(specs):
        prefix, _, packed = name.rpartition(".")
        if prefix in parts:
            (inter, hidden), down = parts[prefix]["gate"], parts[prefix]["down"]
            specs[i] = (name, (count[prefix], 2 * inter, hidden) if packed == "gate_up_proj" else (count[prefix], *down), d)
    return specs


def nbytes(specs: list[Spec]) -> int:
    return sum(torch.Size(s).numel() * d.itemsize for _, s, d in specs)


def new_weights(
    specs: list[Spec], device: torch.device, seed: int
) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(seed)
    pairs = []
    for name, shape, dtype in specs:
        t = torch.empty(shape, dtype=dtype, device=device)
        if len(shape) == 1:
            t.normal_(1.0, 0.05, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        pairs.append((name, t))
    sync(device)
    return pairs


def checkpoint_weights(path: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    pairs = [(name, t.to(device)) for name, t in iterate_checkpoint(path)]
    sync(device)
    return pairs


def free(device: torch.device) -> None:
    """What the trainer made goes back to the driver (the caller dropped its references)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.ipc_collect()  # CUDA IPC blocks the server has let go of
        torch.cuda.empty_cache()


def join_group(
    http: Http, backend: str, device: torch.device, server_ranks: int = 1
) -> tuple[Any, dict[str, Any]]:
    """Rank 0 of a weight-update group whose ranks 1..server_ranks are the server's tensor-parallel
    ranks (its HTTP call runs in a thread while this process hosts the rendezvous)."""
    from engine.weights.groups import trainer_group

    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 1 + server_ranks,
        "group_name": GROUP,
        "backend": backend,
    }
    t = time.perf_counter()
    call = Beside(http.post, "/init_weights_update_group", body)
    group = trainer_group("127.0.0.1", port, 1 + server_ranks, GROUP, backend, device=device)
    answer, _ = call.result("the server did not join the weight-update group")
    return group, {"seconds": time.perf_counter() - t, "answer": answer, "body": body}


def leave_group(http: Http, group: Any, name: str = GROUP) -> dict[str, Any]:
    """The server leaves the group `name` (destroy_weights_update_group), then this process drops
    its side (NCCL communicators aborted now, as the engine does, rather than at garbage collection)."""
    try:
        return http.post("/destroy_weights_update_group", {"group_name": name})[0]
    finally:
        backend = group.group.backend
        abort = getattr(backend, "abort", None)
        if backend.__class__.__name__ == "ProcessGroupNCCL" and callable(abort):
            abort()


def prepare(
    mode: str, pairs: list[tuple[str, torch.Tensor]], version: str, others: list[torch.device] = ()
) -> tuple[dict[str, Any], Any, float]:
    """(request body, what must stay alive until the answer, packing seconds) of a push. With
    `others` (the GPUs of tensor-parallel ranks 1..), an IPC push sends one payload per rank, each
    on its rank's GPU, as SGLang's `serialized_named_tensors[i]` (a colocated trainer rank per GPU)."""
    t = time.perf_counter()
    alive: Any = pairs
    if mode == "bucket":
        alive = [flatten_bucket(pairs)]
        alive += [{**alive[0], "flattened_tensor": alive[0]["flattened_tensor"].to(d)} for d in others]
        for b in alive:
            sync(b["flattened_tensor"].device)
        body = {
            "serialized_named_tensors": [serialize_payload(b) for b in alive],
            "load_format": "flattened_bucket",
        }
    elif mode == "tensor":
        alive = [pairs] + [[(n, x.to(d)) for n, x in pairs] for d in others]
        for d in others:
            sync(d)
        body = {"serialized_named_tensors": [serialize_named_tensors(p) for p in alive], "load_format": None}
    else:
        if DIST_MODES[mode] == "flattened_bucket":  # packed here, as the IPC bucket: one tensor sent
            from engine.weights.groups import pack_bucket

            alive = [("bucket", pack_bucket(pairs))]
            sync(alive[0][1].device)
        body = {
            "names": [n for n, _ in pairs],
            "dtypes": [str(x.dtype).removeprefix("torch.") for _, x in pairs],
            "shapes": [list(x.shape) for _, x in pairs],
            "group_name": GROUP,
            "load_format": DIST_MODES[mode],
        }
    return body | {"flush_cache": True, "weight_version": version}, alive, time.perf_counter() - t


def push(
    http: Http, mode: str, body: dict[str, Any], alive: Any, group: Any, out: dict[str, Any],
    poster: Poster | None = None,
) -> tuple[dict[str, Any], float]:
    """The push, wall time: one HTTP call, with the broadcast beside it. For a broadcast, `out`
    also gets when (from the call) this rank had launched its sends and when they had finished
    on its device: the server's receive ends then, so the rest is its answer.

    With a `poster` the wall runs from the HTTP call going out (or this rank's first send, if
    sooner) to its answer coming in, as the posting process sees them: the hand-over of the
    body to that process and of the answer back (0.5-1.4 ms on an H200 host) is this bench's
    plumbing, not the server's, and is kept apart as `push_call_wall_s`."""
    if mode not in DIST_MODES:
        return http.post("/update_weights_from_tensor", body)
    from engine.weights.groups import broadcast_from_trainer

    t = time.perf_counter()
    called = time.monotonic()
    path = "/update_weights_from_distributed"
    call = poster.start(path, body) if poster is not None else Beside(http.post, path, body)
    sends = time.monotonic()
    broadcast_from_trainer(group, alive)  # each tensor, or the one packed bucket
    out["push_launched_s"] = time.perf_counter() - t
    sync(alive[0][1].device)
    out["push_transferred_s"] = time.perf_counter() - t
    if poster is None:
        answer, _ = call.result("update_weights_from_distributed failed")
        return answer, time.perf_counter() - t
    answer, sent, answered = poster.result("update_weights_from_distributed failed")
    out["push_call_wall_s"] = time.monotonic() - called
    return answer, answered - min(sent, sends)


def flip(
    http: Http, mode: str, specs: list[Spec], device: torch.device, seed: int, version: str,
    release_graphs: bool, prompts: list[list[int]], new_tokens: int, group: Any = None,
    poster: Poster | None = None, others: list[torch.device] = (),
) -> dict[str, Any]:
    """One flip: release -> new weights in the freed memory (+ packing) -> resume weights -> push
    -> free -> resume kv_cache (+ cuda_graph) -> greedy generate (timed apart). `others`: the
    GPUs of tensor-parallel ranks 1.. (prepare)."""
    graphs = ["cuda_graph"] if release_graphs else []
    out: dict[str, Any] = {"mode": mode, "seed": seed, "weight_version": version}
    rel, out["release_wall_s"] = http.post(
        "/release_memory_occupation", {"tags": ["kv_cache", "weights", *graphs]}
    )
    t = time.perf_counter()
    pairs = new_weights(specs, device, seed)
    out["trainer_make_s"] = time.perf_counter() - t
    body, alive, out["pack_s"] = prepare(mode, pairs, version, others)
    if mode in ("bucket", "distributed_bucket"):  # the bucket holds the bytes now: a trainer keeps one copy
        t = time.perf_counter()
        del pairs
        free(device)
        out["pack_free_s"] = time.perf_counter() - t
    resw, out["resume_weights_wall_s"] = http.post(
        "/resume_memory_occupation", {"tags": ["weights"]}
    )
    pushed, out["push_wall_s"] = push(http, mode, body, alive, group, out, poster)
    del body, alive
    pairs = []
    settle(out, [device, *others])
    resk, out["resume_kv_wall_s"] = http.post(
        "/resume_memory_occupation", {"tags": ["kv_cache", *graphs]}
    )
    return conclude(http, out, (rel, resw, pushed, resk), prompts, new_tokens)


def settle(out: dict[str, Any], devices: list[torch.device]) -> None:
    """The trainer frees what it made (the caller dropped its references), before kv_cache resumes."""
    t = time.perf_counter()
    for d in devices:
        free(d)
    out["trainer_free_s"] = time.perf_counter() - t
    if devices[0].type == "cuda":  # CUDA IPC memory the server still holds would not come back
        out["trainer_device_free_bytes"] = torch.cuda.mem_get_info(devices[0])[0]


def conclude(
    http: Http, out: dict[str, Any], answers: tuple[dict[str, Any], ...], prompts: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    """A flip's total (release, resume weights, push, resume kv: the walls of `answers`' calls),
    then one greedy `/generate`, timed apart; every answer kept verbatim."""
    phases = ("release_wall_s", "resume_weights_wall_s", "push_wall_s", "resume_kv_wall_s")
    out["flip_total_s"] = sum(out[k] for k in phases)
    gen_body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    gen, out["generate_wall_s"] = http.post("/generate", gen_body)
    out["generated_tokens"] = sum(len(g["output_ids"]) for g in gen)
    out["generate_weight_version"] = sorted({g["meta_info"].get("weight_version") for g in gen})
    out["output_ids"] = [g["output_ids"] for g in gen]
    for key, answer in zip(("release", "resume_weights", "push", "resume_kv"), answers, strict=True):
        out[f"{key}_s"] = answer.get("seconds")  # the server's own time, where it says
        out[f"{key}_answer"] = answer  # verbatim: seconds_by_tag, seconds_by_phase, host_copy_wait_seconds, ...
    out["memory_occupation_after_generate"] = http.get("/memory_occupation")
    return out
