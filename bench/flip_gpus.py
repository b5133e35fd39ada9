"""bench_flip.py's device plan: which GPUs the server, the IPC trainer and the broadcast trainer
use, and the CUDA_VISIBLE_DEVICES order this process sees them in (set before CUDA starts)."""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any


def nvidia_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (without a CUDA context)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [x.strip() for x in visible.split(",") if x.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [x.strip() for x in out.stdout.splitlines() if x.strip()] if out.returncode == 0 else []


def plan_gpus(args: argparse.Namespace) -> dict[str, Any]:
    """This process sees the server's GPU as cuda:0 (then the trainer's): CUDA IPC handles name a
    device by index, and the server (CUDA_VISIBLE_DEVICES = its GPU, + the trainer's if apart)
    reads the same index. Call before CUDA is initialized."""
    ids = [] if args.tiny else nvidia_gpus()
    if not ids:
        return {"cuda": False, "gpus": 0}
    n, server = len(ids), args.server_gpu
    ranks = list(range(server, server + args.tp_size))  # the server's GPUs, rank order
    trainer = server if args.trainer_gpu is None else args.trainer_gpu
    dist = (
        args.dist_gpu
        if args.dist_gpu is not None
        else next((i for i in range(n) if i not in ranks), None)
    )
    for name, i in (("--server-gpu", ranks[-1]), ("--trainer-gpu", trainer), ("--dist-gpu", dist)):
        if i is not None and not 0 <= i < n:
            raise ValueError(f"{name} {i}: only {n} GPUs")
    order = list(dict.fromkeys([*ranks, trainer, *([dist] if dist is not None else []), *range(n)]))
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in order)
    server_ids = [ids[i] for i in ranks] + ([ids[trainer]] if trainer not in ranks else [])
    return {
        "cuda": True,
        "gpus": n,
        "ids": ids,
        "this_process_order": [ids[i] for i in order],
        "server_visible": ",".join(server_ids),
        "server_only": ids[server],
        "server_ranks": [ids[i] for i in ranks],  # one GPU per tensor-parallel rank
        "trainer_local": order.index(trainer),
        "dist_local": order.index(dist) if dist is not None else None,
    }
