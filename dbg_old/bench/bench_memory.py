"""Memory benchmark: how much of the engine's GPU memory a release hands back, how fast release and
resume are, and how fast weights come back from the pinned host copy against the pinned
host-to-device bandwidth of the same machine (and against torch_memory_saver's own CPU backup).

One run, one table; every number also goes to the JSON file named by `--out` (rewritten after each
section, so a run cut short still leaves what it measured). Needs a CUDA GPU; `--help` works
anywhere.

    python bench/bench_memory.py --model-dir /tmp/siesta-bench-qwen3-0.6b --out $OUT/memory.json

This process never opens a CUDA context of its own (one costs hundreds of MiB and would blur the
readings): the engine runs in its own process (`engine.Engine`, started with torch_memory_saver's
LD_PRELOAD hook), the reference measurements run in child processes (memory_children.py), and
device memory is read through NVML (`pynvml`, else `nvidia-smi`; memory_meter.py): per process
where the driver lists the engine's pid, else device-wide (total - free) against a baseline read
before the engine started.

Sections, in this order:
  1. checkpoint: the Qwen3-0.6B-shaped checkpoint of bench_engine.py (random bf16 weights, made on
     the CPU, reused if there), plus the demo tokenizer (prompts are token ids anyway).
  2. idle: an idle CUDA process (context + one tiny tensor): its device memory.
  3. engine: `Engine(mem_fraction=0.8)`, CUDA graphs on (bs 1..256); region sizes; memory at ready.
  4. traffic: a batch of requests (prefill, graph decode), then memory "when ready".
  5. reclaim: release every tag; reclaim = 1 - (released - idle) / (ready - idle); residual over
     idle; then resume.
  6. cycles: up to 100 cycles of release all / resume kv_cache + cuda_graph / resume weights / a
     short greedy generate (4 prompts, one at a time; its first forward restores the weights from
     the host copy): timings of each call (its own `seconds` and the wall time around it), weights
     restore bandwidth (`last_weights_restore` of memory_occupation), memory drift, outputs identical to the
     same requests' before any release (run at the start of section 4).
  7. scrubbed: a few cycles that wait `--scrub-wait-s` between release and resume, as a trainer's
     step would, and as long again before the next release: the driver scrubs freed pages in the
     background (~400 GB/s on an H200), a resume right after a release waits for that scrub, and a
     release right after a resume races the new pages' zeroing (the cycles above do that).
  8. h2d: (engine shut down) a child process times a 1 GiB pinned host-to-device copy.
  9. driver: a child process calls the CUDA driver's VMM functions (bench/probe_vmm_driver.py)
     on the bytes of every region together, in equal handles of about the KV region's size:
     unmap + release, then create + map + set access, right after and `--scrub-wait-s` after. The
     floor under release all and resume all (kv_cache + cuda_graph, then weights), same run.
 10. tms_cpu_backup: a child process started with torch_memory_saver's LD_PRELOAD holds a
     weights-sized bf16 tensor in `region(enable_cpu_backup=True)` and times pause and resume.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_runtime import table_number
from memory_children import CHILD, spawn_child
from memory_meter import EngineMemory, GpuMeter, gpu_index, pick

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20
GIB = 1 << 30

TAGS = ("weights", "kv_cache", "cuda_graph")
RECLAIM_TARGET = 0.995
RESIDUAL_TARGET = 256 * MIB
DRIFT_TARGET = 4 * MIB
RELEASE_TARGET_S = 0.050
RESUME_KV_GRAPH_TARGET_S = 0.020
RESTORE_BW_TARGET = 0.90

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---- sections ---------------------------------------------------------------------------------


def idle_footprint(meter: GpuMeter) -> dict[str, Any]:
    before = meter.used()
    proc = subprocess.Popen([sys.executable, CHILD, "idle"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the idle CUDA process failed to start")
        time.sleep(0.5)
        per_pid = meter.process_used(proc.pid)
        device = meter.used() - before
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    meter.wait_used_at_most(before + 4 * MIB)
    out = {"per_pid": per_pid, "device": device}
    say(f"idle: an idle CUDA process holds {device / MIB:.0f} MiB device-wide"
        + (f", {per_pid / MIB:.0f} MiB per NVML" if per_pid is not None else " (its pid is not listed by the driver)"))
    return out


def make_prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    first = min(1000, vocab // 2)  # clear of the special tokens at the start of the vocabulary
    return [[rng.randrange(first, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def mib(x: float | None) -> float | None:
    return None if x is None else x / MIB


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import torch  # CPU work only in this process: the checkpoint
    from bench_engine import FULL_DEFAULTS, FULL_SHAPE, make_checkpoint, run_section, write_json

    if args.model_dir is None:
        args.model_dir = FULL_DEFAULTS["model_dir"]
    res: dict[str, Any] = {"meta": {"out": args.out, "args": vars(args), "torch": torch.__version__}, "errors": {}}
    try:
        meter = GpuMeter(gpu_index())
    except RuntimeError as e:
        res["errors"]["gpu"] = str(e)
        write_json(args.out, res)
        say(f"bench_memory needs an NVIDIA GPU: {e}")
        return 2
    res["meta"] |= {"device_name": meter.name(), "memory_source": meter.source, "device_total_bytes": meter.used_total()[1]}
    say(f"bench_memory: {res['meta']['device_name']}, memory read through {meter.source}")

    def section(name: str, fn: Any, *a: Any) -> Any:
        return run_section(res, args.out, args.skip, name, fn, *a)

    def checkpoint() -> dict[str, Any]:
        out = make_checkpoint(args.model_dir, FULL_SHAPE, torch.device("cpu"), args.seed)
        if not os.path.isfile(os.path.join(args.model_dir, "tokenizer.json")):
            from engine.demo_model import save_tokenizer

            save_tokenizer(args.model_dir)  # Engine loads a tokenizer; the prompts are ids
        return out

    if section("checkpoint", checkpoint) is None:
        print_table(res)
        return 1
    idle = section("idle", idle_footprint, meter)

    state: dict[str, Any] = {}
    try:
        section("engine", start_engine, args, meter, state)
        if "llm" in state:
            section("traffic", traffic, args, state)
            section("reclaim", reclaim, state, idle)
            section("cycles", cycles, args, state)
            section("scrubbed", scrubbed, args, state)
    finally:
        if "llm" in state:
            base = state["baseline"]
            state.pop("llm").shutdown()
            back = meter.wait_used_at_most(base + 64 * MIB)
            say(f"engine: shut down; device used {back / MIB:.0f} MiB (baseline {base / MIB:.0f} MiB)")

    h2d = section("h2d", lambda: spawn_child("h2d", args.h2d_mib * MIB, args.h2d_iters))
    if h2d:
        say(f"h2d: pinned host -> device, {args.h2d_mib} MiB: {h2d['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
            f"(best {h2d['bandwidth_best_bytes_per_s'] / 1e9:.1f})")
    regions = (res.get("engine") or {}).get("region_bytes") or {}
    if regions.get("kv_cache"):  # the same bytes as a release of every tag, in handles of the KV region's size
        section("driver", driver_floor, sum(regions.values()), regions["kv_cache"], args.scrub_cycles, args.scrub_wait_s)
    weights_bytes = (res.get("engine") or {}).get("weights_host_copy_bytes") or weights_bytes_estimate(FULL_SHAPE)
    section("tms_cpu_backup", tms_cpu_backup, weights_bytes, args.tms_iters)

    res["table"] = table_rows(res)
    res["meta"]["total_s"] = time.perf_counter() - T0
    write_json(args.out, res)
    print_table(res)
    return 1 if res["errors"] else 0


def weights_bytes_estimate(shape: dict[str, Any]) -> int:
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * shape["head_dim"]
    return 2 * (shape["vocab_size"] * h + L * per_layer + h)


def start_engine(args: argparse.Namespace, meter: GpuMeter, state: dict[str, Any]) -> dict[str, Any]:
    from engine import Engine

    baseline = meter.used()
    t = time.perf_counter()
    llm = Engine(
        model=args.model_dir, device="cuda", dtype="bfloat16", mem_fraction=args.mem_fraction,
        max_model_len=args.max_model_len, max_num_seqs=args.graph_max_bs, cuda_graph_max_bs=args.graph_max_bs,
        seed=args.seed, log_level=args.engine_log_level,
    )
    startup_s = time.perf_counter() - t
    pid = llm.info.get("engine_pid") or llm._core.process.pid
    state |= {"llm": llm, "baseline": baseline, "mem": EngineMemory(meter, pid, baseline)}
    info = {k: v for k, v in llm.info.items() if k != "config"}
    occ = llm.memory_occupation()
    at_start = state["mem"].read()
    own = meter.process_used(os.getpid())  # None: this process holds no CUDA context, as intended
    say(f"engine: up in {startup_s:.1f} s (pid {pid}); memory_saver {occ['memory_saver']} ({occ['hook_mode']}); regions "
        + ", ".join(f"{t} {occ['tags'][t]['bytes'] / MIB:.0f} MiB" for t in TAGS)
        + f"; engine holds {at_start['device'] / MIB:.0f} MiB device-wide"
        + (f", {at_start['per_pid'] / MIB:.0f} MiB per NVML" if at_start["per_pid"] is not None else ""))
    if own:
        say(f"engine: WARNING: this bench process holds {own / MIB:.0f} MiB of device memory (a CUDA context?)")
    if not occ["memory_saver"]:
        raise RuntimeError("memory_saver is off in the engine: nothing can be released (see the engine log)")
    return {"startup_s": startup_s, "pid": pid, "baseline_used_bytes": baseline, "info": info,
            "memory_occupation": occ, "weights_host_copy_bytes": occ["weights_host_copy_bytes"],
            "region_bytes": {t: occ["tags"][t]["bytes"] for t in TAGS}, "used_at_start": at_start,
            "bench_process_device_bytes": own}


def probe(llm: Any) -> list[tuple[Any, ...]]:
    """4 short greedy requests, one at a time after a prefix-cache flush, so that every run
    schedules and rounds alike: (token ids, logprobs, finish reason) of each."""
    from engine import SamplingParams

    prompts = make_prompts(1, 4, 32, 96, llm.info["vocab_size"])
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    got = []
    for p in prompts:
        llm.flush_cache()
        o = llm.generate(input_ids=[p], sampling_params=sp)[0]
        got.append((o.output_ids, o.output_token_logprobs, o.finish_reason))
    return got


def traffic(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    from engine import SamplingParams

    llm = state["llm"]
    state["reference"] = probe(llm)  # before any release: what every cycle must reproduce
    vocab = llm.info["vocab_size"]
    longest = min(512, llm.info["max_context_length"] - args.traffic_new_tokens)
    prompts = make_prompts(args.seed, args.traffic_requests, min(64, longest), longest, vocab)
    sp = SamplingParams(max_new_tokens=args.traffic_new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=sp)
    wall = time.perf_counter() - t
    tokens = sum(len(o.output_ids) for o in outs)
    bad = [o.error for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{len(bad)} traffic requests did not finish: {bad[:3]}")
    ready = state["mem"].read()
    state["ready"] = ready
    say(f"traffic: {len(prompts)} requests, {tokens} tokens in {wall:.1f} s; engine holds "
        f"{ready['device'] / MIB:.0f} MiB device-wide" + (f", {ready['per_pid'] / MIB:.0f} MiB per NVML" if ready["per_pid"] is not None else ""))
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": wall, "used_ready": ready}


def reclaim(state: dict[str, Any], idle: dict[str, Any] | None) -> dict[str, Any]:
    llm, mem = state["llm"], state["mem"]
    ready = state.get("ready") or mem.read()
    t = time.perf_counter()
    rel = llm.release_memory_occupation()
    wall = time.perf_counter() - t
    released = mem.read()
    t = time.perf_counter()
    res = llm.resume_memory_occupation()
    resume_wall = time.perf_counter() - t
    out: dict[str, Any] = {"used_ready": ready, "used_released": released, "release": rel, "release_wall_s": wall,
                           "resume": res, "resume_wall_s": resume_wall, "after_resume": mem.read()}
    if idle is None:
        raise RuntimeError("no idle footprint to compare with (section idle failed)")
    how = pick([ready, released, idle])
    r, z, i = ready[how], released[how], idle[how]
    out |= {"method": how, "idle_bytes": i, "reclaim": 1 - (z - i) / (r - i) if r > i else None, "residual_over_idle_bytes": z - i}
    say(f"reclaim ({how}): ready {r / MIB:.0f} MiB, all released {z / MIB:.0f} MiB, idle process {i / MIB:.0f} MiB -> "
        f"reclaim {(out['reclaim'] or 0) * 100:.3f} %, residual over idle {(z - i) / MIB:.0f} MiB; release said "
        f"{rel['bytes_freed'] / MIB:.0f} MiB freed in {rel['seconds'] * 1e3:.1f} ms (wall {wall * 1e3:.1f} ms)")
    return out


def cycles(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    llm, mem = state["llm"], state["mem"]
    host_bytes = llm.memory_occupation()["weights_host_copy_bytes"]
    rows: list[dict[str, Any]] = []
    first: list[Any] | None = state.get("reference")
    partial = False
    t_start = time.perf_counter()

    def timed(fn: Any, **kw: Any) -> tuple[dict[str, Any], float]:
        t = time.perf_counter()
        answer = fn(**kw)
        return answer, time.perf_counter() - t

    # Keep time for the sections after this one (h2d, tms_cpu_backup) within --deadline-s.
    limit = max(10.0, min(args.cycles_time_limit_s, args.deadline_s - (time.perf_counter() - T0) - 75))
    for i in range(args.cycles):
        if time.perf_counter() - t_start > limit:
            say(f"cycles: time limit of {limit:.0f} s reached after {i} cycles (result is partial)")
            partial = True
            break
        rel, rel_wall = timed(llm.release_memory_occupation)
        released = mem.read()
        kv, kv_wall = timed(llm.resume_memory_occupation, tags=["kv_cache", "cuda_graph"])
        w, w_wall = timed(llm.resume_memory_occupation, tags=["weights"])
        resumed = mem.read()
        got = probe(llm)  # its first forward restores the weights from the host copy
        first = got if first is None else first
        restore_s = llm.memory_occupation()["last_weights_restore"]["seconds"]
        rows.append({
            "release_s": rel["seconds"], "release_wall_s": rel_wall, "bytes_freed": rel["bytes_freed"],
            "resume_kv_graph_s": kv["seconds"], "resume_kv_graph_wall_s": kv_wall,
            "resume_weights_s": w["seconds"], "resume_weights_wall_s": w_wall, "weights_restore_s": restore_s,
            "restore_bandwidth_bytes_per_s": host_bytes / restore_s if restore_s > 0 else None,
            "bytes_restored": kv["bytes_restored"] + w["bytes_restored"],
            "used_released": released, "used_resumed": resumed, "identical": got == first,
            "changed": [rel["changed"], kv["changed"], w["changed"]],
        })
        if i < 3 or (i + 1) % 20 == 0:
            say(f"cycle {i + 1}: release {rel['seconds'] * 1e3:.1f} ms (wall {rel_wall * 1e3:.1f}), resume kv+graph "
                f"{kv['seconds'] * 1e3:.1f} ms (wall {kv_wall * 1e3:.1f}), weights {w['seconds'] * 1e3:.1f} ms "
                f"(restore {restore_s * 1e3:.1f} ms), identical {got == first}")
    if not rows:
        raise RuntimeError("no cycle ran")
    how = pick([r["used_released"] for r in rows] + [r["used_resumed"] for r in rows])
    rel_series = [r["used_released"][how] for r in rows]
    res_series = [r["used_resumed"][how] for r in rows]
    bw = [r["restore_bandwidth_bytes_per_s"] for r in rows if r["restore_bandwidth_bytes_per_s"]]

    def stats(key: str) -> dict[str, float | None]:
        xs = [r[key] for r in rows]
        return {"median": median(xs), "min": min(xs), "max": max(xs), "first": xs[0]}

    out = {
        "cycles": len(rows), "partial": partial, "wall_s": time.perf_counter() - t_start, "method": how,
        "weights_host_copy_bytes": host_bytes,
        "drift_released_bytes": rel_series[-1] - rel_series[0], "drift_resumed_bytes": res_series[-1] - res_series[0],
        "spread_released_bytes": max(rel_series) - min(rel_series), "spread_resumed_bytes": max(res_series) - min(res_series),
        "identical": sum(r["identical"] for r in rows),
        "release_s": stats("release_s"), "release_wall_s": stats("release_wall_s"),
        "resume_kv_graph_s": stats("resume_kv_graph_s"), "resume_kv_graph_wall_s": stats("resume_kv_graph_wall_s"),
        "resume_weights_s": stats("resume_weights_s"), "weights_restore_s": stats("weights_restore_s"),
        "restore_bandwidth_median_bytes_per_s": median(bw), "restore_bandwidth_best_bytes_per_s": max(bw) if bw else None,
        "per_cycle": rows,
    }
    say(f"cycles: {len(rows)} in {out['wall_s']:.1f} s; drift released {out['drift_released_bytes'] / MIB:+.1f} MiB, "
        f"resumed {out['drift_resumed_bytes'] / MIB:+.1f} MiB ({how}); identical {out['identical']}/{len(rows)}; "
        f"weights restore {(median(bw) or 0) / 1e9:.1f} GB/s")
    return out


def scrubbed(args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    """Release all, wait as a trainer's step would, resume kv_cache + cuda_graph, then weights."""
    llm = state["llm"]
    rows = []
    for _ in range(args.scrub_cycles):
        time.sleep(args.scrub_wait_s)  # the last resume's pages settle, as the driver child lets them
        rel = llm.release_memory_occupation()
        time.sleep(args.scrub_wait_s)
        kv = llm.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
        w = llm.resume_memory_occupation(tags=["weights"])
        rows.append({"release_s": rel["seconds"], "release_by_tag": rel["seconds_by_tag"],
                     "resume_kv_graph_s": kv["seconds"], "resume_by_tag": kv["seconds_by_tag"],
                     "resume_all_s": kv["seconds"] + w["seconds"]})
    if probe(llm) != state.get("reference"):
        raise RuntimeError("outputs changed over the scrubbed cycles")
    out = {"wait_s": args.scrub_wait_s, "cycles": rows,
           "resume_kv_graph_median_s": median([r["resume_kv_graph_s"] for r in rows]),
           "resume_kv_graph_max_s": max(r["resume_kv_graph_s"] for r in rows),
           "resume_all_median_s": median([r["resume_all_s"] for r in rows]),
           "release_median_s": median([r["release_s"] for r in rows]),
           "resume_kv_median_s": median([r["resume_by_tag"]["kv_cache"] for r in rows]),
           "release_kv_median_s": median([r["release_by_tag"]["kv_cache"] for r in rows])}
    say(f"scrubbed: resume kv+graph {args.scrub_wait_s:.1f} s after release: {out['resume_kv_graph_median_s'] * 1e3:.1f} ms "
        f"median (kv_cache alone {out['resume_kv_median_s'] * 1e3:.1f} ms); release's kv_cache pause "
        f"{out['release_kv_median_s'] * 1e3:.1f} ms")
    return out


def driver_floor(nbytes: int, chunk: int, iters: int, wait_s: float) -> dict[str, Any]:
    out = spawn_child("driver", nbytes, iters, wait_s, chunk)
    a, b = out["right_after"], out["after_wait"]
    say(f"driver: {out['bytes'] / GIB:.1f} GiB in {out['handles']} handle(s): pause {a['pause_median_s'] * 1e3:.1f} ms; resume right "
        f"after {a['resume_median_s'] * 1e3:.1f} ms, {wait_s:.1f} s after {b['resume_median_s'] * 1e3:.1f} ms")
    return out


def tms_cpu_backup(nbytes: int, iters: int) -> dict[str, Any]:
    from torch_memory_saver import configure_subprocess

    with configure_subprocess():
        env = dict(os.environ)
    out = spawn_child("tms", nbytes, iters, env=env)
    say(f"tms_cpu_backup: {out['bytes'] / MIB:.0f} MiB, pause {out['pause_median_s'] * 1e3:.1f} ms, resume "
        f"{out['resume_median_s'] * 1e3:.1f} ms -> {out['restore_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
        f"content identical after every cycle: {out['all_identical']}")
    return out


# ---- table ------------------------------------------------------------------------------------


def table_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def row(metric: str, measured: float | None, reference: float | None = None, ratio: float | None = None,
            target: str = "-", ok: bool | None = None) -> None:
        rows.append(dict(metric=metric, measured=measured, reference=reference, ratio=ratio, target=target, ok=ok))

    idle, rc, cy = res.get("idle"), res.get("reclaim"), res.get("cycles")
    h2d, tms = res.get("h2d"), res.get("tms_cpu_backup")
    if idle:
        how = (rc or {}).get("method") or ("per_pid" if idle["per_pid"] is not None else "device")
        row(f"idle CUDA process footprint (MiB, {how})", mib(idle[how]))
    if rc:
        how = rc["method"]
        row(f"engine used when ready, after traffic (MiB, {how}); ref = regions", mib(rc["used_ready"][how]),
            mib(sum(res["engine"]["region_bytes"].values())) if res.get("engine") else None)
        row("reclaim = 1 - (released - idle) / (ready - idle)", rc["reclaim"], target=">= 0.995",
            ok=rc["reclaim"] is not None and rc["reclaim"] >= RECLAIM_TARGET)
        row("residual over idle, all released (MiB); ref = idle", mib(rc["residual_over_idle_bytes"]), mib(rc["idle_bytes"]),
            target="<= 256", ok=rc["residual_over_idle_bytes"] <= RESIDUAL_TARGET)
    if cy:
        n = cy["cycles"]
        part = " PARTIAL" if cy["partial"] else ""
        for state in ("released", "resumed"):
            drift = cy[f"drift_{state}_bytes"]
            row(f"drift over {n} cycles, {state} (MiB); ref = spread{part}", mib(drift), mib(cy[f"spread_{state}_bytes"]),
                target="<= 4", ok=abs(drift) <= DRIFT_TARGET)
        row(f"outputs identical to the run before any release (of {n} cycles)", cy["identical"], target=f"= {n}", ok=cy["identical"] == n)
        for key, what, limit in (("release_s", "release all: the call's seconds", RELEASE_TARGET_S),
                                 ("release_wall_s", "release all: wall around the call", RELEASE_TARGET_S),
                                 ("resume_kv_graph_s", "resume kv_cache + cuda_graph: the call's seconds", RESUME_KV_GRAPH_TARGET_S),
                                 ("resume_kv_graph_wall_s", "resume kv_cache + cuda_graph: wall", RESUME_KV_GRAPH_TARGET_S)):
            s = cy[key]
            row(f"{what} (ms, median; ref = max)", s["median"] * 1e3, s["max"] * 1e3, target=f"< {limit * 1e3:.0f}",
                ok=s["median"] < limit)
        row("resume weights: the call's seconds (ms, median)", cy["resume_weights_s"]["median"] * 1e3)
    sc, drv = res.get("scrubbed"), res.get("driver")
    if sc:
        row(f"resume kv_cache + cuda_graph {sc['wait_s']:.1f} s after release (ms, median; ref = max)",
            sc["resume_kv_graph_median_s"] * 1e3, sc["resume_kv_graph_max_s"] * 1e3,
            target=f"< {RESUME_KV_GRAPH_TARGET_S * 1e3:.0f}", ok=sc["resume_kv_graph_median_s"] < RESUME_KV_GRAPH_TARGET_S)
    ours_release = (cy or {}).get("release_s", {}).get("median")
    if drv:
        gib = drv["bytes"] / GIB
        a, b = drv["right_after"], drv["after_wait"]

        def against_driver(metric: str, driver_s: float, ours_s: float | None) -> None:
            row(metric, driver_s * 1e3, ours_s * 1e3 if ours_s else None, ours_s / driver_s if ours_s else None)

        resume_all = None
        if cy:
            resume_all = cy["resume_kv_graph_s"]["median"] + cy["resume_weights_s"]["median"]
        against_driver(f"driver alone, {gib:.0f} GiB (every region's bytes): unmap + release, pages settled (ms); "
                       "ref = siesta release all, pages settled (section scrubbed); target ratio <= 1.10",
                       a["pause_median_s"], (sc or {}).get("release_median_s"))
        against_driver(f"driver alone, {gib:.0f} GiB: create + map right after release (ms); "
                       "ref = siesta resume kv+graph, then weights; target ratio <= 1.10", a["resume_median_s"], resume_all)
        against_driver(f"driver alone, {gib:.0f} GiB: create + map {drv['wait_s']:.1f} s after (ms); "
                       "ref = siesta resume kv+graph + weights after the same wait",
                       b["resume_median_s"], (sc or {}).get("resume_all_median_s"))
    h2d_bw = h2d["bandwidth_bytes_per_s"] if h2d else None
    if h2d:
        row(f"pinned host -> device copy, {h2d['bytes'] // MIB} MiB (GB/s)", h2d_bw / 1e9)
    if cy and cy["restore_bandwidth_median_bytes_per_s"]:
        bw = cy["restore_bandwidth_median_bytes_per_s"]
        ratio = bw / h2d_bw if h2d_bw else None
        row("siesta weights restore (GB/s); ref = pinned H2D", bw / 1e9, h2d_bw / 1e9 if h2d_bw else None, ratio,
            ">= 0.90", ratio >= RESTORE_BW_TARGET if ratio is not None else None)
    if tms:
        bw = tms["restore_bandwidth_bytes_per_s"]
        ratio = bw / h2d_bw if h2d_bw else None
        row("torch_memory_saver enable_cpu_backup restore (GB/s); ref = pinned H2D", bw / 1e9,
            h2d_bw / 1e9 if h2d_bw else None, ratio)
        row("torch_memory_saver enable_cpu_backup pause, weights only (ms); ref = siesta release all",
            tms["pause_median_s"] * 1e3, ours_release * 1e3 if ours_release is not None else None)
        row("torch_memory_saver enable_cpu_backup content identical after resume", float(tms["all_identical"]),
            target="= 1", ok=tms["all_identical"])
    return rows


def print_table(res: dict[str, Any]) -> None:
    num = table_number

    meta = res["meta"]
    head = ["metric", "measured", "reference", "ratio", "target", "ok"]
    print(f"\n## siesta memory benchmark: {meta.get('device_name')}, Qwen3-0.6B shape, random bf16 weights, "
          f"mem_fraction {meta['args']['mem_fraction']}, graphs up to bs {meta['args']['graph_max_bs']}")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(" --- " for _ in head) + "|")
    for r in res.get("table", []):
        ok = "-" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        print(f"| {r['metric']} | {num(r['measured'])} | {num(r['reference'])} | {num(r['ratio'])} | {r['target']} | {ok} |")
    for section, err in res["errors"].items():
        print(f"section {section} FAILED: {err.strip().splitlines()[-1] if err else ''}")
    print(f"total {time.perf_counter() - T0:.0f} s; JSON in {meta['out']}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--model-dir", help="checkpoint directory; created if missing (default: bench_engine.py's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-fraction", type=float, default=0.8)
    p.add_argument("--max-model-len", type=int, default=4096, help="the checkpoint's full context, so that "
                   "mem_fraction, not max_num_seqs x context, sizes the KV cache")
    p.add_argument("--graph-max-bs", type=int, default=256, help="largest decode graph, and max_num_seqs")
    p.add_argument("--traffic-requests", type=int, default=64)
    p.add_argument("--traffic-new-tokens", type=int, default=64)
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--cycles-time-limit-s", type=float, default=100.0, help="stop the cycles after this (partial)")
    p.add_argument("--deadline-s", type=float, default=220.0, help="whole-run budget the cycles plan against")
    p.add_argument("--scrub-wait-s", type=float, default=1.0, help="wait between release and resume in the "
                   "scrubbed and driver sections (a trainer's step)")
    p.add_argument("--scrub-cycles", type=int, default=5)
    p.add_argument("--h2d-mib", type=int, default=1024)
    p.add_argument("--h2d-iters", type=int, default=10)
    p.add_argument("--tms-iters", type=int, default=5)
    p.add_argument("--engine-log-level", default="WARNING", help="the engine process's log level (INFO logs every release)")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: idle,traffic,reclaim,cycles,scrubbed,h2d,driver,"
                   "tms_cpu_backup")
    args = p.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    return args


if __name__ == "__main__":
    sys.exit(main())
