"""Memory benchmark: how much of the engine's GPU memory a release hands back, how fast release and
resume are, and how fast weights come back from the pinned host copy against the pinned
host-to-device bandwidth of the same machine (and against torch_memory_saver's own CPU backup).

One run, one table; every number also goes to the JSON file named by `--out` (rewritten after each
section, so a run cut short still leaves what it measured). Needs a CUDA GPU; `--help` works
anywhere.

    python bench/bench_memory.py --model-dir /tmp/siesta-bench-qwen3-0.6b --out $OUT/memory.json

This process never opens a CUDA context of its own (one costs hundreds of MiB and would blur the
readings): the engine runs in its own process (`engine.Engine`, started with torch_memory_saver's
LD_PRELOAD hook; memory_cycles.py), the reference measurements run in child processes
(memory_children.py), and device memory is read through NVML (`pynvml`, else `nvidia-smi`;
memory_meter.py): per process
where the driver lists the engine's pid, else device-wide (total - free) against a baseline read
before the engine started.

Sections, in this order:
  1. checkpoint: the Qwen3-0.6B-shaped checkpoint of engine_shapes.py (random bf16 weights, made on
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
  9. driver: a child process calls the CUDA driver's VMM functions (bench/memory_driver.py)
     on the bytes of every region together, in equal handles of about the KV region's size:
     unmap + release, then create + map + set access, right after and `--scrub-wait-s` after. The
     floor under release all and resume all (kv_cache + cuda_graph, then weights), same run.
 10. tms_cpu_backup: a child process started with torch_memory_saver's LD_PRELOAD holds a
     weights-sized bf16 tensor in `region(enable_cpu_backup=True)` and times pause and resume.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from bench_runtime import GIB, MIB, elapsed, run_section, say, write_json
from memory_children import CHILD, spawn_child
from memory_cycles import cycles, reclaim, scrubbed, start_engine, traffic
from memory_meter import GpuMeter, gpu_index
from memory_table import print_table, table_rows


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    import torch  # CPU work only in this process: the checkpoint
    from engine_shapes import FULL_SHAPE, make_checkpoint, resolve_checkpoint

    if args.model_dir is None:
        args.model_dir = resolve_checkpoint("0.6b", None)[1]
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
    res["meta"]["total_s"] = elapsed()
    write_json(args.out, res)
    print_table(res)
    return 1 if res["errors"] else 0


def weights_bytes_estimate(shape: dict[str, Any]) -> int:
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * shape["head_dim"]
    return 2 * (shape["vocab_size"] * h + L * per_layer + h)


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
