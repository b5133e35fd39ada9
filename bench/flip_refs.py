"""The references of bench_flip.py, measured in the same run: a device-to-device copy of the
model's bytes (the floor of a CUDA IPC push), a pinned host-to-device copy and the CUDA driver's
own unmap/release and create/map of a region's bytes (memory_children.py's children, each a fresh
process on the server's GPU), and a plain `torch.distributed.broadcast` of the model's bytes
from the trainer's GPU to every GPU of the server (the floor of `update_weights_from_distributed`).
`driver_refs` takes the driver's floor while the server's regions are released, and
`control_round_trip` the HTTP, dispatch and validation an update pays besides its bytes.

The broadcast reference runs this process as rank 0 and one child per server rank (`python
bench/flip_refs.py broadcast`, CUDA_VISIBLE_DEVICES = that rank's GPU, as the server's rank sees
it) as ranks 1..n, the group a TP=n server joins; each child reads its job as one JSON line on
stdin and prints its timings as one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from bench_runtime import MIB, say  # noqa: E402
from flip_http import Http  # noqa: E402
from memory_children import spawn_child  # noqa: E402

DTYPE_NAMES = ("bfloat16", "float16", "float32", "uint8")


def d2d_copy(nbytes: int, device: Any, iters: int) -> dict[str, Any]:
    """`dst.copy_(src)` of one flat uint8 tensor of `nbytes`: CUDA events on a GPU (perf_counter
    on a CPU), median of `iters` after a warm-up. GB/s counts the bytes once (as a push moves
    them), not read + write."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    from device_timing import timed_copy

    times = [timed_copy(dst, src) for _ in range(iters + 1)][1:]  # the first is a warm-up
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    med = statistics.median(times)
    return {
        "bytes": nbytes,
        "device": str(device),
        "iters": iters,
        "times_s": times,
        "median_s": med,
        "bandwidth_bytes_per_s": nbytes / med,
    }


def h2d(nbytes: int, iters: int, env: dict[str, str]) -> dict[str, Any]:
    """memory_children's pinned host -> device copy, in a child on the server's GPU."""
    return spawn_child("h2d", nbytes, iters, env=env)


def driver(nbytes: int, iters: int, wait_s: float, env: dict[str, str]) -> dict[str, Any]:
    """memory_children's driver floor for one handle of `nbytes`, in a child on the server's GPU."""
    return spawn_child("driver", nbytes, iters, wait_s, env=env, timeout=600)


# ---- the broadcast reference ------------------------------------------------------------------


def _broadcast_rank(rank: int, job: dict[str, Any], device: Any) -> dict[str, Any]:
    """Every rank: join the group of 1 + len(receivers), broadcast (a) one flat uint8 tensor of the model's bytes and
    (b) the model's tensors one by one, from rank 0; a warm-up, then `iters` timed runs each
    (barrier, sync, broadcast, sync)."""
    import torch
    import torch.distributed as dist

    backend = job["backend"]
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{job['port']}",
        rank=rank,
        world_size=job["world_size"],
        timeout=timedelta(seconds=job.get("timeout_s", 120)),
        **kwargs,
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def barrier() -> None:
        dist.barrier(device_ids=[device.index]) if backend == "nccl" else dist.barrier()

    def timed(tensors: list[Any]) -> list[float]:
        times = []
        for i in range(job["iters"] + 1):
            barrier()
            sync()
            t = time.perf_counter()
            for x in tensors:
                dist.broadcast(x, src=0)
            sync()
            if i:
                times.append(time.perf_counter() - t)
        return times

    out: dict[str, Any] = {"rank": rank, "device": str(device), "backend": backend}
    try:
        flat = [torch.empty(job["nbytes"], dtype=torch.uint8, device=device).fill_(rank)]
        out["flat_s"] = timed(flat)
        if rank and int(flat[0].max()) != 0:  # rank 0 sent zeros
            raise RuntimeError("the flat broadcast did not arrive")
        del flat
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tensors = [
            torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for shape, dtype in job["specs"]
        ]
        out["list_s"] = timed(tensors)
        del tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return out


def broadcast_reference(
    specs: list[tuple[list[int], str]],
    nbytes: int,
    backend: str,
    device: Any,
    child_envs: list[dict[str, str]],
    iters: int,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """This process as rank 0 on `device`, one child per env in `child_envs` as ranks 1.. (each on
    its cuda:0, or the CPU). A run ends when its last receiver has the bytes: per run the slowest
    receiver's time, then the median; GB/s of the flat tensor and of the tensor list."""
    from bench_runtime import free_port

    for _, dtype in specs:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype}")
    job = {
        "backend": backend,
        "port": free_port(),
        "world_size": 1 + len(child_envs),
        "nbytes": nbytes,
        "specs": specs,
        "iters": iters,
        "device": "cuda" if device.type == "cuda" else "cpu",
    }
    children = []
    for rank, env in enumerate(child_envs, start=1):
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "broadcast"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert child.stdin is not None
        child.stdin.write(json.dumps(job | {"rank": rank}) + "\n")
        child.stdin.flush()
        children.append(child)
    theirs = []
    try:
        mine = _broadcast_rank(0, job, device)
        for child in children:
            stdout, stderr = child.communicate(timeout=timeout_s)
            if child.returncode != 0:
                raise RuntimeError(f"broadcast child exited with {child.returncode}:\n{stderr[-4000:]}")
            theirs.append(json.loads(stdout.strip().splitlines()[-1]))
    except BaseException:
        for child in children:
            child.kill()
            child.communicate()
        raise
    out: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": len(specs),
        "backend": backend,
        "iters": iters,
        "world_size": job["world_size"],
        "sender": mine,
        "receivers": theirs,
    }
    for key in ("flat", "list"):
        med = statistics.median(max(runs) for runs in zip(*(r[f"{key}_s"] for r in theirs), strict=True))
        out[f"{key}_median_s"] = med
        out[f"{key}_bandwidth_bytes_per_s"] = nbytes / med
    out["best_bandwidth_bytes_per_s"] = max(
        out["flat_bandwidth_bytes_per_s"], out["list_bandwidth_bytes_per_s"]
    )
    return out


def _child_main() -> int:
    import torch

    job = json.loads(sys.stdin.readline())
    device = torch.device("cuda", 0) if job["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    print(json.dumps(_broadcast_rank(job["rank"], job, device)), flush=True)
    return 0


def driver_refs(run: Any, http: Http, env: dict[str, str]) -> dict[str, Any] | None:
    """The driver's floor for the released regions' bytes, measured while they are released."""
    args, res = run.args, run.res
    occ = http.get("/memory_occupation")
    if not occ.get("memory_saver"):
        res["skipped"].append("refs.driver (the server's memory saver is off)")
        return None
    tags = ["kv_cache", "weights"] + (["cuda_graph"] if args.release_graphs else [])
    sizes = {t: occ["tags"][t]["bytes"] for t in tags if occ["tags"][t]["bytes"] > 0}
    http.post("/release_memory_occupation", {"tags": tags})
    try:
        out = {t: driver(n, args.ref_iters, args.driver_wait_s, env) for t, n in sizes.items()}
    finally:
        http.post("/resume_memory_occupation", {"tags": tags})
    res["refs"]["driver"] = out
    if (
        occ.get("weights_backup") != "none"
    ):  # the next forward restores every weight from the host copy
        body = {
            "input_ids": [[5, 6, 7]],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        http.post("/generate", body)
        restore = res["refs"]["weights_restore"] = http.get("/memory_occupation").get(
            "last_weights_restore"
        )
        if restore and restore.get("seconds"):
            say(
                f"refs.weights_restore: {restore['bytes'] / 1e9:.2f} GB from the host copy at the first forward in "
                f"{restore['seconds'] * 1e3:.1f} ms = {restore['bytes'] / restore['seconds'] / 1e9:.1f} GB/s"
            )
    for t, d in out.items():
        a = d["right_after"]
        say(
            f"refs.driver: {t} {d['bytes'] / MIB:.0f} MiB in one handle: unmap + release {a['pause_median_s'] * 1e3:.1f} "
            f"ms, create + map {a['resume_median_s'] * 1e3:.1f} ms right after "
            f"({d['after_wait']['resume_median_s'] * 1e3:.1f} ms {d['wait_s']} s after)"
        )
    return out


def control_round_trip(http: Http, specs: list[Any]) -> float:
    """Median wall of an `update_weights_from_distributed` carrying the checkpoint's full list
    but naming an unknown group: the HTTP, dispatch and validation a push pays besides its bytes."""
    body = {
        "names": [n for n, _, _ in specs],
        "dtypes": [str(d).removeprefix("torch.") for _, _, d in specs],
        "shapes": [list(s) for _, s, _ in specs],
        "group_name": "no-such-group",
    }
    walls = []
    for _ in range(20):
        t = time.perf_counter()
        r = http.client.post("/update_weights_from_distributed", json=body)
        walls.append(time.perf_counter() - t)
        if r.status_code != 400:
            raise RuntimeError(f"an update naming no group answered {r.status_code}: {r.text[:500]}")
    return sorted(walls)[len(walls) // 2]


if __name__ == "__main__":
    if sys.argv[1:] != ["broadcast"]:
        print("usage: flip_refs.py broadcast  (job as one JSON line on stdin)", file=sys.stderr)
        sys.exit(2)
    sys.exit(_child_main())
