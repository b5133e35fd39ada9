"""bench_memory.py's sections on the running engine: its start (regions, memory at start), traffic
(then memory "when ready"), reclaim (release all against an idle CUDA process), the release/resume
cycles (timings, drift, restore bandwidth, outputs identical) and the scrubbed cycles (a wait between
release and resume, as a trainer's step). Each takes the run's `state`: the Engine, its memory
meter, the reference outputs taken before any release."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from bench_runtime import MIB, elapsed, say
from memory_meter import EngineMemory, GpuMeter, pick

TAGS = ("weights", "kv_cache", "cuda_graph")


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def make_prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    first = min(1000, vocab // 2)  # clear of the special tokens at the start of the vocabulary
    return [[rng.randrange(first, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


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


def greedy_outputs(llm: Any) -> list[tuple[Any, ...]]:
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
    state["reference"] = greedy_outputs(llm)  # before any release: what every cycle must reproduce
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
    limit = max(10.0, min(args.cycles_time_limit_s, args.deadline_s - elapsed() - 75))
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
        got = greedy_outputs(llm)  # its first forward restores the weights from the host copy
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
    if greedy_outputs(llm) != state.get("reference"):
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


