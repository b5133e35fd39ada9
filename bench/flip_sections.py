"""The sections of bench_flip.py, in its docstring's order: checkpoint, the references measured
before the server starts, the server, the initial checksum, the driver's floor (while the
server's memory is released), the flips of each push mode, and the restore check (for a
checkpoint without weights, served as load_format dummy: the last flip's tensors pushed again)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shlex
import time
from collections.abc import Iterator
from typing import Any

from bench_runtime import MIB, say, write_json
from flip_http import Http, Poster
from flip_refs import broadcast_reference, control_round_trip, d2d_copy, driver_refs, h2d
from flip_trainer import DIST_MODES, GROUP, checkpoint_specs, flip, join_group, leave_group, nbytes
from flip_verify import Verify
from flip_vllm import VLLM_GROUP, VLLM_MODES, vllm_flip
from flip_vllm import setup as vllm_setup
from serving_checkpoint import dummy_flags

MODE_INDEX = {"bucket": 0, "tensor": 1, "distributed": 2, "distributed_bucket": 3, "vllm_ipc": 4}
NEW_TOKENS = 8


def build_in_child(args: Any) -> dict[str, Any]:
    """The serving checkpoint (and demo tokenizer), built in a spawned child process."""
    from serving_checkpoint import build_checkpoint

    with mp.get_context("spawn").Pool(1) as child:
        job = child.apply_async(
            build_checkpoint, (args.shape, args.model_dir, args.seed, args.tiny)
        )
        return job.get(timeout=3600)


def prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 512)) for _ in range(16)] for _ in range(4)]


def server_flags(args: Any, tokenizer: str | None, load_format: str = "auto") -> list[str]:
    flags = ["--mem-fraction", str(args.mem_fraction), "--max-model-len", str(args.max_model_len)]
    if args.tiny:
        flags += ["--device", "cpu", "--num-kv-blocks", "256", "--dtype", "float32"]
    if args.weights_backup:
        flags += ["--weights-backup", args.weights_backup]
    if args.tp_size > 1:
        flags += ["--tp-size", str(args.tp_size)]
    flags += shlex.split(args.server_args) + (["--tokenizer", tokenizer] if tokenizer else [])
    return flags + dummy_flags(load_format, flags)


@contextlib.contextmanager
def env_set(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` while a child starts (serving_server's Server takes no env)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def push_mode(
    run: Any,
    http: Http,
    mode: str,
    device: Any,
    specs: list[Any],
    verify: Verify | None,
    probe: list[list[int]],
) -> None:
    import torch

    args, res = run.args, run.res
    if device is None:
        raise RuntimeError("distributed needs a second GPU for the trainer (--dist-gpu)")
    # A mode named again in --push runs another round: its flips join the earlier rounds' (the
    # table's medians pool them), each flip marked with its round.
    sec = res["push"].setdefault(mode, {"device": str(device), "warmup": [], "flips": [], "rounds": 0})
    sec["rounds"] += 1
    group = poster = None
    if mode in DIST_MODES:
        group, sec["group"] = join_group(
            http, "nccl" if device.type == "cuda" else "gloo", device, args.tp_size
        )
        if args.post_from == "process":
            poster = Poster(http.client.base_url, 300.0)
        say(
            f"push.{mode}: joined the weight-update group in {sec['group']['seconds'] * 1e3:.0f} ms"
        )
        sec["post_from"] = args.post_from
        sec["control_round_trip_s"] = control_round_trip(http, specs)
        say(
            f"push.{mode}: an update naming no group, validated and refused: {sec['control_round_trip_s'] * 1e3:.2f} "
            "ms round trip (median of 20)"
        )
    if mode in VLLM_MODES:  # a broadcast group on a CPU (no CUDA IPC there), none on a GPU
        group, info = vllm_setup(http, device, args.tp_size)
        sec |= info
        say(f"push.{mode}: {info['transport']}")
    total = args.warmup_flips + args.flips
    # Tensor-parallel ranks 1.. get their own payload on their own GPU (this process sees the
    # server's GPUs first, in rank order); on a CPU every rank reads the one payload.
    ipc_gpus = device.type == "cuda" and mode not in DIST_MODES
    others = [torch.device("cuda", r) for r in range(1, args.tp_size)] if ipc_gpus else []
    try:
        for i in range(total):
            if run.late():
                res["skipped"].append(f"push.{mode} flips {i + 1}..{total}")
                break
            seed = args.seed * 1000 + 100 * MODE_INDEX[mode] + i + 1 + 100_000 * (sec["rounds"] - 1)
            try:
                if mode in VLLM_MODES:
                    f = vllm_flip(http, specs, device, seed, args.vllm_sleep_level, args.release_graphs, probe,
                                  NEW_TOKENS, group, others)
                else:
                    f = flip(http, mode, specs, device, seed, f"{mode}-{i}", args.release_graphs, probe,
                             NEW_TOKENS, group, poster, others)
            except BaseException:
                with contextlib.suppress(Exception):  # leave the server usable for the next mode
                    http.post("/resume_memory_occupation", {"tags": None})
                raise
            version = f["weight_version"]  # pushed, or (vLLM's update names none) the engine's own
            f["version_ok"] = f["generate_weight_version"] == [version] and f["push_answer"].get("weight_version") == version
            if verify is not None and (args.verify == "every" or i == total - 1):
                verify.after_flip(f)
            time.sleep(args.rollout_s)  # the rollout phase: the host copy refreshes meanwhile
            warm = i < args.warmup_flips
            f["host_copy_wait_s"] = f["release_answer"].get("host_copy_wait_seconds")
            f["round"] = sec["rounds"]
            sec["warmup" if warm else "flips"].append(f)
            say(flip_line(mode, i, total, warm, f))
            write_json(args.out, res)
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                sec["destroy_answer"] = leave_group(http, group, VLLM_GROUP if mode in VLLM_MODES else GROUP)
        if poster is not None:
            poster.close()


def flip_line(mode: str, i: int, total: int, warm: bool, f: dict[str, Any]) -> str:
    """One flip's log line: its phases, then (a broadcast push) where the push's time went."""

    def ms(key: str) -> float:
        return (f.get(key) or 0) * 1e3

    parts = [
        f"push.{mode} flip {i + 1}/{total}{' (warm-up)' if warm else ''}: release {ms('release_wall_s'):.1f} ms, "
        f"resume weights {ms('resume_weights_wall_s'):.1f}, push {ms('push_wall_s'):.1f} (server {ms('push_s'):.1f}), "
        f"resume kv {ms('resume_kv_wall_s'):.1f} -> flip {ms('flip_total_s'):.1f} ms",
        f"packing {ms('pack_s'):.1f} ms",
        f"generate {ms('generate_wall_s'):.1f} ms, {f['generated_tokens']} tokens",
        f"release waited {ms('host_copy_wait_s'):.1f} ms for the host copy",
    ]
    if "push_call_wall_s" in f:
        parts.append(f"{ms('push_call_wall_s'):.1f} ms with the hand-over to the posting process")
    if "push_transferred_s" in f:
        phases = f["push_answer"].get("seconds_by_phase", {})
        parts += [
            f"trainer sends launched at {ms('push_launched_s'):.1f} ms, done at {ms('push_transferred_s'):.1f} ms",
            "server phases (ms) " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items()),
            str(f["push_answer"].get("receive_route")),
        ]
    if "verify" in f:
        parts.append(f"{f['verify']['changed']}/{f['verify']['tensors']} tensors changed")
    return "; ".join(parts)


def run_all(run: Any, modes: list[str]) -> None:
    import torch

    args, res, gpus = run.args, run.res, run.gpus
    ckpt = run.section("checkpoint", build_in_child, args)
    if ckpt is None:
        return
    res["checkpoint"] = ckpt
    dummy = ckpt["load_format"] == "dummy"  # no weights on disk: the trainer's tensors come from config.json
    # A checksum hashes every byte on the host (about a minute at 30B-A3B): asked for, not the default.
    args.verify = args.verify or ("none" if dummy else "last")
    specs = checkpoint_specs(ckpt["path"])
    model_bytes = nbytes(specs)
    res["meta"] |= {
        "model_bytes": model_bytes,
        "num_tensors": len(specs),
        "dtypes": sorted({str(d).removeprefix("torch.") for _, _, d in specs}),
    }
    cuda = gpus["cuda"]
    cpu = torch.device("cpu")
    ipc_dev = torch.device("cuda", gpus["trainer_local"]) if cuda else cpu
    dist_dev = (
        (torch.device("cuda", gpus["dist_local"]) if gpus["dist_local"] is not None else None)
        if cuda
        else cpu
    )
    child_env = run.env(gpus.get("server_only"))
    if cuda:
        res["meta"]["device_name"] = torch.cuda.get_device_name(0)
    say(
        f"checkpoint: {ckpt['path']}: {len(specs)} tensors, {model_bytes / 1e9:.3f} GB; push modes {modes}; "
        f"devices: server {gpus.get('server_visible', 'cpu')}, trainer {ipc_dev}, distributed trainer {dist_dev}"
    )

    def ref(name: str, fn: Any, *a: Any) -> Any:
        def go() -> Any:
            out = res["refs"][name] = fn(*a)
            bw = out.get("bandwidth_bytes_per_s") or out.get("best_bandwidth_bytes_per_s")
            say(
                f"refs.{name}: {out['bytes'] / 1e9:.3f} GB at {bw / 1e9:.1f} GB/s"
                if bw
                else f"refs.{name}: done"
            )
            return out

        return run.section(f"refs.{name}", go)

    if {"bucket", "tensor", *VLLM_MODES} & set(modes):
        ref("d2d", d2d_copy, model_bytes, ipc_dev, args.ref_iters)
    if cuda:
        ref("h2d", h2d, args.h2d_mib * MIB, 2 * args.ref_iters, child_env)
    if set(DIST_MODES) & set(modes) and dist_dev is not None:
        pairs = [(list(s), str(d).removeprefix("torch.")) for _, s, d in specs]
        ref(
            "broadcast",
            broadcast_reference,
            pairs,
            model_bytes,
            "nccl" if cuda else "gloo",
            dist_dev,
            [run.env(g) for g in gpus["server_ranks"]] if cuda else [child_env] * args.tp_size,
            args.ref_iters,
        )

    from serving_server import Server

    log = os.path.splitext(args.out)[0] + ".server.log"
    with env_set({"CUDA_VISIBLE_DEVICES": gpus["server_visible"]} if cuda else {}):
        server = Server(ckpt["path"], server_flags(args, ckpt.get("tokenizer"), ckpt["load_format"]), log)
    http: Http | None = None
    try:
        info = run.section("server", server.wait_ready, args.startup_timeout_s)
        if info is None:
            return
        res["server"] = info
        http = Http(server.url, args.request_timeout_s)
        res["memory_occupation"] = http.get("/memory_occupation")
        say(
            f"server: ready at {server.url} on {info.get('device')} ({info.get('dtype')}), weights "
            f"{info.get('weights_bytes', 0) / MIB:.0f} MiB, KV {info.get('kv_cache_bytes', 0) / MIB:.0f} MiB, graphs "
            f"{info.get('cuda_graph_bytes', 0) / MIB:.0f} MiB; memory saver {info.get('memory_saver')}"
        )
        verify = Verify(res, http) if args.verify != "none" else None
        if verify is not None:
            run.section("verify.initial", verify.initial)
            verify = None if "verify.initial" in res["errors"] else verify
        if cuda:
            run.section("refs.driver", driver_refs, run, http, child_env)
        probe = prompts(args.seed, ckpt["shape"]["vocab_size"])
        for mode in modes:
            run.section(
                f"push.{mode}",
                push_mode,
                run,
                http,
                mode,
                dist_dev if mode in DIST_MODES else ipc_dev,
                specs,
                verify,
                probe,
            )
        if verify is not None:
            flips = [f for sec in res["push"].values() for f in sec["warmup"] + sec["flips"]]
            others = [torch.device("cuda", r) for r in range(1, args.tp_size)] if cuda else []
            if dummy:
                run.section("verify.restore", verify.repush, specs, ipc_dev, flips, others)
            else:
                run.section("verify.restore", verify.restore, ckpt["path"], ipc_dev, flips, others)
    finally:
        if http is not None:
            http.close()
        server.stop()
