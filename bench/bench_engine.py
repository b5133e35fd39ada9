"""Engine benchmark: decode step time against the memory roofline, a mixed step (decodes plus one
prompt chunk) against its two halves run apart, offline throughput against `transformers.generate`,
CUDA graph memory of the whole ladder against its largest graph, and for a mixture of experts the
prefill's TFLOP/s against the dense matmul rate.

One run, one table; every number also goes to the JSON file named by `--out` (rewritten after each
section, so a run cut short still leaves what it measured). See bench/README.md.

    python bench/bench_engine.py --shape 0.6b --out $OUT/bench.json   # GPU; --shape 8b, 30b-a3b or DIR
    python bench/bench_engine.py --tiny --out /tmp/b.json               # CPU smoke test
    python bench/bench_engine.py --tiny --shape tiny-moe --out /tmp/m.json   # CPU, the MoE paths

Rules of the shape: `--shape 0.6b|8b` builds a random checkpoint of Qwen3-0.6B's or Qwen3-8B's
shape into `--model-dir`, `--shape 30b-a3b` Qwen3-30B-A3B's config.json alone (an MoE shape has no
weights on disk: the engines load it with load_format dummy, random weights made in place, and no
host copy); `--shape DIR` measures DIR itself when it holds weights, else builds DIR's config.json
shape into `--model-dir`. Every byte count (roofline, KV) and every label comes from the
config.json of the checkpoint actually loaded, never from these constants. A directory that this
script did not build (no BUILT_MARKER file in it) is never overwritten. For an MoE shape the
decode engine records the routed experts (engine_experts.py: the roofline's experts are counted).

Sections, in this order (cheapest first, each engine freed before the next is built):
  1. checkpoint: a checkpoint of the chosen shape with random bf16 weights, made here (no download).
  2. copy: device-to-device copy bandwidth; the roofline's bandwidth.
  3. graph_memory: the ladder of decode graphs captured into one pool vs the largest graph alone.
  4. decode: one engine with CUDA graphs; step time at each context and batch size vs
     (weight bytes + KV bytes the step reads) / copy bandwidth; MoE: only the distinct experts read.
  4b. prefill (MoE shapes): on the same engine, N x L-token prompts prefilled; TFLOP/s vs the
     dense bf16 matmul rate (engine_prefill.py).
  5. mixed: on the same engine, the step of B decodes plus one fresh C-token prompt vs the decode
     step alone + the chunk's prefill step alone (B = --mixed-batch, C = --mixed-chunk).
  6. throughput: nano-vllm's workload (256 requests, prompt and output lengths uniform in
     100..1024, ignore_eos) on the same engine; output tokens per second.
  7. hf: `transformers.generate` on a subsample of the same workload; ratio to section 6 (not for
     a checkpoint without weights).

This file is the recipe (flags, the order of the sections, the deadline, the JSON); the sections
live in bench/engine_*.py (engine_shapes: checkpoints; engine_decode: decode steps; engine_experts:
an MoE step's bytes; engine_prefill; engine_graphs: graph memory; engine_mixed; engine_throughput:
throughput and hf; engine_table: the table rows),
the copy bandwidth in bench/device_timing.py, the table's printing in bench/report.py.
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import sys
import traceback
from typing import Any

import torch
from bench_runtime import GIB, MIB, elapsed, engine_process_heap, run_section, say, write_json
from device_timing import copy_bandwidth, free_memory
from engine_decode import decode_new_tokens, decode_steps, decode_weight_bytes
from engine_experts import ExpertBytes
from engine_graphs import count_graph_replays, graph_memory
from engine_mixed import mixed_steps
from engine_prefill import prefill_steps
from engine_shapes import checkpoint, is_moe
from engine_table import print_table, table_rows
from engine_throughput import hf_generate, throughput, workload

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.memory.kv_budget import kv_block_bytes

# Defaults of the full run; `--tiny` replaces them with TINY_DEFAULTS where a flag is not given.
FULL_DEFAULTS = dict(  # model_dir: the 0.6B shape's, for bench_memory.py; this script's is per shape
    shape="0.6b", model_dir="/tmp/siesta-bench-qwen3-0.6b", device="cuda", max_model_len=2048, mem_fraction=0.8,
    copy_mib=1024, copy_iters=20, graph_max_bs=256, graph_kv_blocks=2048,
    decode_batch_sizes="1,4,8,64,256", decode_contexts="512,8192,32768", decode_steps=30, decode_warmup=3,
    tp_requests=256, tp_min_len=100, tp_max_len=1024, hf_requests=16, hf_max_new_tokens=256,
    kv_cache_memory_gb=1.0, mixed_batch=64, mixed_chunk=512, mixed_reps=10, mixed_warmup=2, mixed_steps_per_rep=4,
    moe_route_steps=8, prefill_seqs=64, prefill_len=2048,
)
TINY_DEFAULTS = dict(
    shape="tiny", model_dir="/tmp/siesta-bench-tiny", device="cpu", max_model_len=256, mem_fraction=0.8,
    copy_mib=64, copy_iters=5, graph_max_bs=16, graph_kv_blocks=256,
    decode_batch_sizes="1,4,8", decode_contexts="32,128", decode_steps=5, decode_warmup=1,
    tp_requests=16, tp_min_len=8, tp_max_len=64, hf_requests=4, hf_max_new_tokens=16,
    kv_cache_memory_gb=0.05, mixed_batch=4, mixed_chunk=32, mixed_reps=3, mixed_warmup=1, mixed_steps_per_rep=2,
    moe_route_steps=2, prefill_seqs=4, prefill_len=64,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--tiny", action="store_true", help="tiny Qwen3 on the CPU, small workloads: a smoke test")
    p.add_argument("--shape", help="0.6b | 8b | 30b-a3b (Qwen3 shapes, random weights; 30b-a3b: MoE, config.json "
                   "only) | tiny | tiny-moe | DIR (its config.json; measured as it is if it holds weights)")
    p.add_argument("--model-dir", help="where a built checkpoint goes (default /tmp/siesta-bench-qwen3-<shape>; "
                   "--tiny: /tmp/siesta-bench-tiny for the tiny shape)")
    p.add_argument("--device")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", default="auto", help="EngineConfig.attention_backend")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--mem-fraction", type=float, help="of the decode/throughput engine")
    p.add_argument("--kv-cache-memory-gb", type=float, help="KV budget on CPU")
    p.add_argument("--copy-mib", type=int, help="size of the copied tensor")
    p.add_argument("--copy-iters", type=int)
    p.add_argument("--graph-max-bs", type=int, help="largest decode graph (graph memory and decode engine)")
    p.add_argument("--graph-kv-blocks", type=int, help="KV blocks of the graph-memory engine")
    p.add_argument("--decode-batch-sizes", help="comma-separated")
    p.add_argument("--decode-contexts", help="comma-separated prompt tokens of each decode sequence: every batch "
                   "size is measured at each (a point whose KV does not fit the cache is skipped)")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per batch size")
    p.add_argument("--decode-warmup", type=int, help="untimed decode steps before them")
    p.add_argument("--moe-route-steps", type=int, help="MoE: untimed decode steps after the timed ones whose routed "
                   "experts are counted (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of the decode engine's steps (default: "
                   "the engine's)")
    p.add_argument("--prefill-seqs", type=int, help="MoE prefill section: prompts (default 64)")
    p.add_argument("--prefill-len", type=int, help="MoE prefill section: tokens per prompt (default 2048)")
    p.add_argument("--prefill-warmup-seqs", type=int, help="MoE prefill section: untimed prompts first (default: "
                   "one full step)")
    p.add_argument("--mixed-batch", type=int, help="decodes running in the mixed section (B; default 64)")
    p.add_argument("--mixed-chunk", type=int, help="tokens of the fresh prompt the mixed step admits (C; "
                   "default 512)")
    p.add_argument("--mixed-reps", type=int, help="timed repetitions of each mixed-section step kind (median)")
    p.add_argument("--mixed-warmup", type=int, help="untimed repetitions before them")
    p.add_argument("--mixed-steps-per-rep", type=int, help="consecutive steps one repetition times together")
    p.add_argument("--tp-requests", type=int)
    p.add_argument("--tp-min-len", type=int, help="shortest prompt and output")
    p.add_argument("--tp-max-len", type=int, help="longest prompt and output")
    p.add_argument("--tp-time-limit-s", type=float, default=300.0, help="abort the throughput run after this")
    p.add_argument("--temperature", type=float, default=0.0, help="of the throughput requests (0: greedy, as HF)")
    p.add_argument("--hf-requests", type=int, help="transformers subsample size (one batch)")
    p.add_argument("--hf-max-new-tokens", type=int, help="new tokens per transformers request")
    p.add_argument("--hf-reserve-s", type=float, default=60.0, help="time kept for transformers")
    p.add_argument("--deadline-s", type=float, default=450.0, help="whole-run budget the sections plan against")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: "
                   "copy,graph_memory,decode,prefill,mixed,throughput,hf")
    args = p.parse_args(argv)
    tiny_shape = args.shape in (None, "tiny")
    for k, v in (TINY_DEFAULTS if args.tiny else FULL_DEFAULTS).items():
        if getattr(args, k) is None and (k != "model_dir" or (args.tiny and tiny_shape)):  # else per shape
            setattr(args, k, v)
    args.skip = {s for s in args.skip.split(",") if s}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    res: dict[str, Any] = {"meta": {
        "out": args.out, "tiny": args.tiny, "args": vars(args) | {"skip": sorted(args.skip)},
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }, "errors": {}}
    say(f"bench: {res['meta']['device_name']}, torch {torch.__version__}, transformers {transformers.__version__}")

    def section(name: str, fn: Any, *a: Any) -> Any:
        return run_section(res, args.out, args.skip, name, fn, *a, on_error=lambda: free_memory(device))

    ckpt = section("checkpoint", checkpoint, args.shape, args.model_dir, device, args.seed)
    if ckpt is None:
        print_table([], res)
        return 1
    args.model_path = ckpt["path"]
    shape = res["meta"]["model_shape"] = ckpt["shape"]  # what is loaded, read from its config.json
    moe, dummy = is_moe(shape), ckpt["load_format"] == "dummy"
    # Every engine's loading: random weights in place and no host copy of them without weights on disk.
    args.engine_options = dict(load_format=ckpt["load_format"], weights_backup="none" if dummy else "host")
    if moe and "prefill" not in args.skip:  # a prompt and its one token fit, rounded up to 256 tokens
        args.max_model_len = max(args.max_model_len, -(-(args.prefill_len + 1) // 256) * 256)
    contexts = [int(c) for c in args.decode_contexts.split(",")]
    args.decode_context = contexts[0]  # the mixed section's decodes
    if "decode" not in args.skip:  # the longest context and its new tokens fit, rounded up to 256 tokens
        args.max_model_len = max(args.max_model_len, -(-(max(contexts) + decode_new_tokens(args)) // 256) * 256)
    res["meta"]["max_model_len"] = args.max_model_len
    copy = section("copy", copy_bandwidth, device, args.copy_mib, args.copy_iters)
    if device.type == "cuda":
        section("graph_memory", graph_memory, args)
    else:
        say("graph_memory: skipped (needs CUDA)")

    work: list[tuple[list[int], int]] = []

    def engine_sections() -> dict[str, Any]:
        """Decode, prefill, mixed and throughput share one engine with CUDA graphs, freed at the end."""
        budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        core = EngineCore(EngineConfig(
            model=args.model_path, device=args.device, dtype="bfloat16", max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            max_num_seqs=args.graph_max_bs, cuda_graph_max_bs=args.graph_max_bs, mem_fraction=args.mem_fraction,
            kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed, enable_return_routed_experts=moe,
            **budget, **args.engine_options,
        ))
        info = core.get_info()
        info.pop("config", None)
        res["meta"]["attention_backend"] = info["attention_backend"]
        say(f"engine: backend {info['attention_backend']}, weights {info['weights_bytes'] / MIB:.0f} MiB, KV "
            f"{info['kv_cache_bytes'] / GIB:.2f} GiB ({info['kv_blocks_total']} blocks), graphs "
            f"{info['cuda_graph_bytes'] / MIB:.0f} MiB for bs {info['cuda_graph_batch_sizes'][-1:] or 'none'}")
        try:
            with engine_process_heap():  # as the engine process runs (engine/core/loop.py)
                work.extend(workload(args, core.model_config.vocab_size))
                weight_bytes = decode_weight_bytes(core)
                kv_token_bytes = kv_block_bytes(core.model_config, 1, core.runner.dtype)
                bandwidth = copy["bandwidth_bytes_per_s"] if copy else float("nan")
                replays = count_graph_replays(core)
                rng = random.Random(args.seed + 1)
                res["decode"] = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token_bytes,
                                 "bandwidth_bytes_per_s": bandwidth, "batches": []}
                experts = ExpertBytes(core) if moe else None
                routes = (lambda c, b: experts.measure(c, b, args.moe_route_steps)) if experts else None
                if experts:
                    res["decode"]["moe"] = experts.summary()
                if "decode" not in args.skip:
                    capacity = info["kv_blocks_total"] * core.config.block_size  # KV tokens the cache holds
                    for context, bs in [(c, int(b)) for c in contexts for b in args.decode_batch_sizes.split(",")]:
                        if bs * (context + decode_new_tokens(args) + core.config.block_size) > capacity:
                            say(f"decode bs={bs} context={context}: skipped (needs more KV than the cache's {capacity} tokens)")
                            res["decode"].setdefault("skipped", []).append({"batch_size": bs, "context": context})
                            continue
                        try:
                            res["decode"]["batches"].append(decode_steps(
                                core, args, bs, rng, weight_bytes, kv_token_bytes, bandwidth, replays, routes, context))
                        except Exception:
                            key = f"decode_bs{bs}" + (f"_ctx{context}" if len(contexts) > 1 else "")
                            res["errors"][key] = traceback.format_exc()
                            say(f"decode bs={bs} context={context}: FAILED\n{res['errors'][key]}")
                            core.abort(None)
                        write_json(args.out, res)
                if moe:
                    section("prefill", prefill_steps, core, args, random.Random(args.seed + 3), replays)
                section("mixed", mixed_steps, core, args, random.Random(args.seed + 2), replays)
                section("throughput", throughput, core, args, work)
        finally:
            del core
            free_memory(device)
        return info

    section("engine", engine_sections)
    if not work:
        work = workload(args, shape["vocab_size"])
    if dummy and "hf" not in args.skip:
        say("hf: skipped (the checkpoint has no weights for transformers to load)")
    elif elapsed() > args.deadline_s - 20:
        say("hf: skipped (no time left before --deadline-s)")
    else:
        section("hf", hf_generate, args, work, device)

    res["table"] = table_rows(res)
    res["meta"]["total_s"] = elapsed()
    write_json(args.out, res)
    print_table(res["table"], res)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
