"""Engine benchmark: decode step time against the memory roofline, offline throughput against
`transformers.generate`, and CUDA graph memory of the whole ladder against its largest graph.

One run, one table; every number also goes to the JSON file named by `--out` (rewritten after each
section, so a run cut short still leaves what it measured). See bench/README.md.

    python bench/bench_engine.py --shape 0.6b --out $OUT/bench.json   # GPU; --shape 8b or DIR
    python bench/bench_engine.py --tiny --out /tmp/b.json               # CPU smoke test

Rules of the shape: `--shape 0.6b|8b` builds a random checkpoint of Qwen3-0.6B's or Qwen3-8B's
shape into `--model-dir`; `--shape DIR` measures DIR itself when it holds weights, else builds DIR's
config.json shape into `--model-dir`. Every byte count (roofline, KV) and every label comes from
the config.json of the checkpoint actually loaded, never from these constants. A directory that
this script did not build (no BUILT_MARKER file in it) is never overwritten.

Sections, in this order (cheapest first, each engine freed before the next is built):
  1. checkpoint: a checkpoint of the chosen shape with random bf16 weights, made here (no download).
  2. copy: device-to-device copy bandwidth; the roofline's bandwidth.
  3. graph_memory: the ladder of decode graphs captured into one pool vs the largest graph alone.
  4. decode: one engine with CUDA graphs; step time at each batch size vs
     (weight bytes + KV bytes the step reads) / copy bandwidth.
  5. throughput: nano-vllm's workload (256 requests, prompt and output lengths uniform in
     100..1024, ignore_eos) on the same engine; output tokens per second.
  6. hf: `transformers.generate` on a subsample of the same workload; ratio to section 5.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.cuda_graph import CudaGraphRunner  # noqa: E402
from engine.kv_budget import kv_block_bytes  # noqa: E402
from engine.protocol import AddRequest  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

_GIB = 1 << 30
_MIB = 1 << 20

# Shapes `--shape` names (random weights); `--tiny` uses "tiny". max_position_embeddings is kept
# at 4096 (the real models have 40960): the workloads here are short.
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(  # Qwen3-0.6B
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=True,
    ),
    "8b": dict(  # Qwen3-8B
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    ),
}
# Names bench_memory.py and bench_fused_ops.py import: the 0.6B shape, and the tiny one.
FULL_SHAPE, TINY_SHAPE = SHAPES["0.6b"], SHAPES["tiny"]
# The config.json keys a shape is made of (and compared on, when a built checkpoint is reused).
SHAPE_KEYS = tuple(SHAPES["0.6b"])
# A file written into every checkpoint this script builds: only such a directory is rebuilt.
BUILT_MARKER = "siesta_bench_checkpoint.json"

# Defaults of the full run; `--tiny` replaces them with TINY_DEFAULTS where a flag is not given.
FULL_DEFAULTS = dict(  # model_dir: the 0.6B shape's, for bench_memory.py; this script's is per shape
    shape="0.6b", model_dir="/tmp/siesta-bench-qwen3-0.6b", device="cuda", max_model_len=2048, mem_fraction=0.8,
    copy_mib=1024, copy_iters=20, graph_max_bs=256, graph_kv_blocks=2048,
    decode_batch_sizes="1,8,64,256", decode_context=512, decode_steps=30, decode_warmup=3,
    tp_requests=256, tp_min_len=100, tp_max_len=1024, hf_requests=16, hf_max_new_tokens=256,
    kv_cache_memory_gb=1.0,
)
TINY_DEFAULTS = dict(
    shape="tiny", model_dir="/tmp/siesta-bench-tiny", device="cpu", max_model_len=256, mem_fraction=0.8,
    copy_mib=64, copy_iters=5, graph_max_bs=16, graph_kv_blocks=256,
    decode_batch_sizes="1,4,8", decode_context=32, decode_steps=5, decode_warmup=1,
    tp_requests=16, tp_min_len=8, tp_max_len=64, hf_requests=4, hf_max_new_tokens=16,
    kv_cache_memory_gb=0.05,
)

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def write_json(path: str, results: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, path)


def run_section(
    res: dict[str, Any], out: str, skip: Any, name: str, fn: Any, *a: Any, on_error: Any = None
) -> Any:
    """One benchmark section: skipped when asked; a crash is recorded under res["errors"] (and
    `on_error()` runs), not raised; the JSON is rewritten after every section."""
    if name in skip:
        say(f"{name}: skipped (--skip)")
        return None
    try:
        value = fn(*a)
    except Exception:
        res["errors"][name] = traceback.format_exc()
        say(f"{name}: FAILED\n{res['errors'][name]}")
        if on_error is not None:
            on_error()
        value = None
    res[name] = value
    write_json(out, res)
    return value


# ---- 1. checkpoint ------------------------------------------------------------------------------


def read_shape(path: str) -> dict[str, Any]:
    """The SHAPE_KEYS of a checkpoint's config.json, with head_dim and the KV heads filled in as
    the engine fills them (hidden / heads; as many KV heads as heads) and rope_theta found where
    transformers 5 puts it."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    shape = {k: hf.get(k) for k in SHAPE_KEYS}
    shape["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    shape["num_key_value_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    shape["rope_theta"] = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    shape["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-6)
    shape["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    return shape


def has_weights(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json"))


def resolve_checkpoint(spec: str, model_dir: str | None) -> tuple[dict[str, Any], str, bool]:
    """`--shape` and `--model-dir` -> (shape, checkpoint directory, whether to build it there).
    A named shape is built into `model_dir` (default /tmp/siesta-bench-qwen3-<name>); a directory
    with weights is measured as it is; a directory with only a config.json lends its shape."""
    if spec in SHAPES:
        return dict(SHAPES[spec]), model_dir or f"/tmp/siesta-bench-qwen3-{spec}", True
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise ValueError(f"--shape {spec!r}: neither one of {sorted(SHAPES)} nor a directory with a config.json")
    shape = read_shape(spec)
    if has_weights(spec):
        return shape, os.path.abspath(spec), False
    name = os.path.basename(os.path.abspath(spec))
    return shape, model_dir or f"/tmp/siesta-bench-{name}", True


def shape_label(shape: dict[str, Any]) -> str:
    """One line naming a shape, for logs and table titles."""
    return (f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} "
            f"heads, {shape['num_key_value_heads']} KV heads, head_dim {shape['head_dim']}, intermediate "
            f"{shape['intermediate_size']}, vocab {shape['vocab_size']}, "
            f"{'tied' if shape['tie_word_embeddings'] else 'untied'}")


def make_checkpoint(path: str, shape: dict[str, Any], device: torch.device, seed: int) -> dict[str, Any]:
    """Random bf16 Qwen3 of `shape` (tied embeddings when it says so), saved with save_pretrained
    and marked with BUILT_MARKER; kept if `path` already holds that shape. Refuses to overwrite a
    non-empty directory it did not build."""
    if has_weights(path) and os.path.isfile(os.path.join(path, "config.json")):
        have = read_shape(path)
        if all(have.get(k) == v for k, v in shape.items() if k != "rope_theta"):
            say(f"checkpoint: reusing {path}")
            return {"path": path, "created": False}
        if not os.path.isfile(os.path.join(path, BUILT_MARKER)):
            raise RuntimeError(f"{path} holds another shape and was not built here: not overwriting it "
                               "(give another --model-dir)")
        say(f"checkpoint: {path} holds another shape; recreating it")
    elif os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, BUILT_MARKER)):
        raise RuntimeError(f"{path} is not empty and was not built here: not writing into it")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t0 = time.perf_counter()
    tied = bool(shape.get("tie_word_embeddings", True))
    config = Qwen3Config(**(shape | {"tie_word_embeddings": tied}))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
            assert p.dtype == torch.bfloat16, name
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    free_memory(device)
    with open(os.path.join(path, BUILT_MARKER), "w") as f:
        json.dump({"shape": shape, "seed": seed}, f)
    dt = time.perf_counter() - t0
    say(f"checkpoint: created {path} ({n_params / 1e6:.1f} M params, bf16) in {dt:.1f} s")
    return {"path": path, "created": True, "num_params": n_params, "seconds": dt}


def checkpoint(spec: str, model_dir: str | None, device: torch.device, seed: int) -> dict[str, Any]:
    """The checkpoint section: resolve `--shape`, build if needed; the result names the directory
    loaded (`path`) and the shape read back from its config.json (`shape`)."""
    shape, path, build = resolve_checkpoint(spec, model_dir)
    out = make_checkpoint(path, shape, device, seed) if build else {"path": path, "created": False}
    out["shape"] = read_shape(path)
    say(f"checkpoint: {path}: {shape_label(out['shape'])}")
    return out


# ---- 2. copy bandwidth --------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, mib: int, iters: int) -> dict[str, Any]:
    """Device-to-device copy of a bf16 tensor; bandwidth = (bytes read + bytes written) / time."""
    n = mib * _MIB // 2
    src = torch.randn(n, dtype=torch.float32, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    nbytes = 2 * src.numel() * src.element_size()
    med = statistics.median(times)
    del src, dst
    free_memory(device)
    out = {"tensor_bytes": nbytes // 2, "iters": iters, "median_s": med, "min_s": min(times),
           "bandwidth_bytes_per_s": nbytes / med, "bandwidth_best_bytes_per_s": nbytes / min(times)}
    say(f"copy: {mib} MiB bf16, median {med * 1e3:.3f} ms -> {nbytes / med / 1e9:.0f} GB/s (read + write)")
    return out


# ---- 3. graph memory ----------------------------------------------------------------------------


def graph_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Capture the ladder, then the largest graph alone, each with a fresh backend, on an engine
    that captured nothing itself; compare the memory of each capture's graph pool (`pool_bytes`)."""
    core = EngineCore(EngineConfig(
        model=args.model_path, device=args.device, dtype="bfloat16", disable_cuda_graph=True,
        attention_backend=args.attention_backend,
        num_kv_blocks=args.graph_kv_blocks, max_num_seqs=args.graph_max_bs,
        max_model_len=args.max_model_len,
    ))
    runner = core.runner
    device = runner.device
    if not type(runner.attn_backend).supports_cuda_graph:
        name = runner.backend_name
        del core, runner
        free_memory(device)
        raise RuntimeError(f"attention backend {name!r} does not support CUDA graphs")
    vocab = core.model_config.vocab_size
    max_bs = args.graph_max_bs

    # A throwaway capture first pays one-time costs (kernel compilation, cuBLAS workspaces of the
    # capture stream) so that neither measured capture carries them.
    _capture(runner, max_bs, vocab, [max_bs])
    ladder, sizes, ladder_s = _capture(runner, max_bs, vocab, None)
    say(f"graph memory: ladder of {len(sizes)} graphs (bs {sizes[0]}..{sizes[-1]}): {ladder / _MIB:.1f} MiB in {ladder_s:.1f} s")
    single, _, single_s = _capture(runner, max_bs, vocab, [max_bs])
    say(f"graph memory: bs {max_bs} alone: {single / _MIB:.1f} MiB in {single_s:.1f} s")
    del core, runner
    free_memory(device)
    return {"max_bs": max_bs, "ladder_batch_sizes": sizes, "ladder_bytes": ladder, "single_bytes": single,
            "ratio": ladder / single if single > 0 else None, "ladder_capture_s": ladder_s,
            "single_capture_s": single_s}


def _capture(runner: Any, max_bs: int, vocab: int, batch_sizes: list[int] | None) -> tuple[int, list[int], float]:
    """One capture with a fresh backend over the engine's KV cache; (pool_bytes, sizes, seconds)."""
    backend = runner.make_backend(runner.kv_cache)
    graphs = CudaGraphRunner(runner.model, backend, max_bs, vocab, runner.device, batch_sizes=batch_sizes)
    t = time.perf_counter()
    graphs.capture()
    result = (graphs.pool_bytes, list(graphs.batch_sizes), time.perf_counter() - t)
    del graphs, backend
    free_memory(runner.device)
    return result


# ---- 4. decode step time ------------------------------------------------------------------------


def count_graph_replays(core: EngineCore) -> list[int]:
    """Wraps the engine's graph runner so the benchmark can tell replayed steps from eager ones."""
    counter = [0]
    graphs = core.runner.graphs
    if graphs is not None:
        run = graphs.run

        def counted(*a: Any, **kw: Any) -> torch.Tensor:
            counter[0] += 1
            return run(*a, **kw)

        graphs.run = counted  # type: ignore[method-assign]
    return counter


def decode_weight_bytes(core: EngineCore) -> int:
    """Weight bytes one decode step reads: every parameter once (a tied embedding is one
    parameter), less an untied input embedding, of which a step reads only its batch's rows."""
    model = core.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if core.model_config.tie_word_embeddings:
        return total
    embed = model.model.embed_tokens.weight
    return total - embed.numel() * embed.element_size()


def decode_steps(core: EngineCore, args: argparse.Namespace, bs: int, rng: random.Random,
                 weight_bytes: int, kv_token_bytes: int, bandwidth: float, replays: list[int]) -> dict[str, Any]:
    if bs > core.config.max_num_seqs:
        raise RuntimeError(f"batch {bs} is more than the engine's max_num_seqs ({core.config.max_num_seqs})")
    vocab = core.model_config.vocab_size
    new_tokens = min(args.max_model_len - args.decode_context, 4 * (args.decode_steps + args.decode_warmup) + 64)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        prompt = [rng.randrange(vocab) for _ in range(args.decode_context)]
        err = core.add_request(AddRequest(request_id=f"decode-{bs}-{i}", prompt_token_ids=prompt, sampling_params=params))
        if err is not None:
            raise RuntimeError(f"request refused: {err.error}")
    preempt0 = core.scheduler.num_preemptions
    t = time.perf_counter()
    started: set[str] = set()
    prefill_steps = 0
    while len(started) < bs:  # until every request has its first token: all of them decode now
        for d in core.step():
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            if d.new_token_ids:
                started.add(d.request_id)
        prefill_steps += 1
        if prefill_steps > 10 * bs * args.decode_context:
            raise RuntimeError("prefill does not finish")
    prefill_s = time.perf_counter() - t
    for _ in range(args.decode_warmup):
        core.step()
    replays0 = replays[0]
    times, kv_tokens = [], []
    for _ in range(args.decode_steps):
        running = core.scheduler.running
        if len(running) != bs or core.scheduler.num_waiting:
            raise RuntimeError(f"expected {bs} running requests, found {len(running)} (preemption?)")
        kv_tokens.append(sum(r.num_tokens for r in running))  # KV positions each sequence reads
        t = time.perf_counter()
        deltas = core.step()
        times.append(time.perf_counter() - t)
        if sum(len(d.new_token_ids) for d in deltas) != bs:
            raise RuntimeError(f"a decode step at batch {bs} produced {len(deltas)} deltas")
    graph_steps = replays[0] - replays0
    core.abort(None)
    mean_s = sum(times) / len(times)
    kv_bytes = kv_token_bytes * sum(kv_tokens) / len(kv_tokens)
    roofline_s = (weight_bytes + kv_bytes) / bandwidth
    out = {
        "batch_size": bs, "context": args.decode_context, "prefill_steps": prefill_steps, "prefill_s": prefill_s,
        "steps": len(times), "step_mean_s": mean_s, "step_median_s": statistics.median(times),
        "step_min_s": min(times), "step_max_s": max(times), "graph_replayed_steps": graph_steps,
        "mean_kv_tokens_read": sum(kv_tokens) / len(kv_tokens), "kv_bytes_read": kv_bytes,
        "weight_bytes_read": weight_bytes, "roofline_s": roofline_s, "measured_over_roofline": mean_s / roofline_s,
        "roofline_bandwidth_fraction": roofline_s / mean_s,
        "preemptions": core.scheduler.num_preemptions - preempt0,
    }
    say(f"decode bs={bs}: step {mean_s * 1e3:.3f} ms (median {out['step_median_s'] * 1e3:.3f}), roofline "
        f"{roofline_s * 1e3:.3f} ms, measured/roofline {out['measured_over_roofline']:.2f}, "
        f"{graph_steps}/{len(times)} steps from CUDA graphs, prefill {prefill_s:.2f} s in {prefill_steps} steps")
    return out


# ---- 5. throughput ------------------------------------------------------------------------------


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """nano-vllm's bench: random ids in [0, 10000], prompt and output lengths uniform in [lo, hi]."""
    rng = random.Random(args.seed)
    top = min(10000, vocab - 1)
    return [([rng.randint(0, top) for _ in range(rng.randint(args.tp_min_len, args.tp_max_len))],
             rng.randint(args.tp_min_len, args.tp_max_len)) for _ in range(args.tp_requests)]


def throughput(core: EngineCore, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    limit = max(30.0, min(args.tp_time_limit_s, args.deadline_s - elapsed() - args.hf_reserve_s))
    expected = sum(n for _, n in work)
    say(f"throughput: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, {expected} output "
        f"tokens expected; time limit {limit:.0f} s")
    preempt0 = core.scheduler.num_preemptions
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        sp = SamplingParams(max_new_tokens=n, temperature=args.temperature, ignore_eos=True)
        err = core.add_request(AddRequest(request_id=f"tp-{i}", prompt_token_ids=prompt, sampling_params=sp))
        if err is not None:
            raise RuntimeError(f"request refused: {err.error}")
    tokens, steps, finished, last_print, cut = 0, 0, 0, t0, False
    while core.has_work():
        for d in core.step():
            tokens += len(d.new_token_ids)
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            finished += d.finished
        steps += 1
        now = time.perf_counter()
        if now - last_print > 10:
            say(f"throughput: {now - t0:.0f} s, {tokens} tokens, {finished} finished, "
                f"{core.scheduler.num_running} running, {tokens / (now - t0):.0f} tok/s")
            last_print = now
        if now - t0 > limit:
            say(f"throughput: time limit of {limit:.0f} s reached; aborting the rest (result is partial)")
            core.abort(None)
            cut = True
            break
    wall = time.perf_counter() - t0
    out = {"requests": len(work), "output_tokens": tokens, "expected_output_tokens": expected, "wall_s": wall,
           "steps": steps, "tokens_per_s": tokens / wall, "partial": cut, "temperature": args.temperature,
           "preemptions": core.scheduler.num_preemptions - preempt0}
    say(f"throughput: {tokens} tokens in {wall:.1f} s over {steps} steps = {tokens / wall:.0f} tok/s")
    return out


# ---- 6. transformers ----------------------------------------------------------------------------


def hf_generate(args: argparse.Namespace, work: list[tuple[list[int], int]], device: torch.device) -> dict[str, Any]:
    """`generate` on the first `hf_requests` prompts of the workload, left-padded into one batch,
    exactly `hf_max_new_tokens` greedy tokens each."""
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.bfloat16).to(device).eval()
    prompts = [p for p, _ in work[: args.hf_requests]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    n_new = args.hf_max_new_tokens
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        say(f"hf: generate on {len(prompts)} requests (prompts {min(map(len, prompts))}..{width} tokens, left-padded "
            f"to {width}), {n_new} new tokens each, one batch, greedy, bf16, attn {model.config._attn_implementation}")
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        sync(device)
        wall = time.perf_counter() - t
    generated = (out.shape[1] - width) * out.shape[0]
    if generated != len(prompts) * n_new:
        say(f"hf: WARNING: generated {generated} tokens, expected {len(prompts) * n_new}")
    res = {"requests": len(prompts), "prompt_lens": [len(p) for p in prompts], "padded_width": width,
           "max_new_tokens": n_new, "generated_tokens": generated, "wall_s": wall,
           "tokens_per_s": generated / wall, "step_ms": wall / max(1, out.shape[1] - width) * 1e3,
           "attn_implementation": model.config._attn_implementation, "transformers": transformers.__version__}
    say(f"hf: {generated} tokens in {wall:.1f} s = {generated / wall:.0f} tok/s ({res['step_ms']:.1f} ms per step)")
    del model, out
    free_memory(device)
    return res


# ---- the run ------------------------------------------------------------------------------------


def table_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    copy = res.get("copy")
    if copy:
        rows.append(dict(metric="copy bandwidth, read + write (GB/s)", measured=copy["bandwidth_bytes_per_s"] / 1e9,
                         reference=None, ratio=None, target="-", ok=None))
    for d in (res.get("decode") or {}).get("batches", []):
        bs = d["batch_size"]
        if bs == 1:
            rows.append(dict(metric="decode step bs=1 (ms); ratio = measured / roofline",
                             measured=d["step_mean_s"] * 1e3, reference=d["roofline_s"] * 1e3,
                             ratio=d["measured_over_roofline"], target="<= 2.00",
                             ok=d["measured_over_roofline"] <= 2.0))
        else:
            target = bs >= 64
            rows.append(dict(metric=f"decode step bs={bs} (ms); ratio = roofline / measured",
                             measured=d["step_mean_s"] * 1e3, reference=d["roofline_s"] * 1e3,
                             ratio=d["roofline_bandwidth_fraction"], target=">= 0.50" if target else "-",
                             ok=d["roofline_bandwidth_fraction"] >= 0.5 if target else None))
    tp, hf = res.get("throughput"), res.get("hf")
    if tp:
        ratio = tp["tokens_per_s"] / hf["tokens_per_s"] if hf else None
        partial = " PARTIAL (time limit)" if tp["partial"] else ""
        rows.append(dict(metric=f"offline throughput (tok/s); ref = transformers generate{partial}",
                         measured=tp["tokens_per_s"], reference=hf["tokens_per_s"] if hf else None, ratio=ratio,
                         target=">= 20", ok=ratio >= 20 if ratio is not None else None))
    gm = res.get("graph_memory")
    if gm:
        rows.append(dict(metric=f"graph memory (MiB): ladder of {len(gm['ladder_batch_sizes'])} vs bs={gm['max_bs']} alone",
                         measured=gm["ladder_bytes"] / _MIB, reference=gm["single_bytes"] / _MIB, ratio=gm["ratio"],
                         target="<= 1.20", ok=gm["ratio"] is not None and gm["ratio"] <= 1.2))
    return rows


def print_table(rows: list[dict[str, Any]], res: dict[str, Any]) -> None:
    def num(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:.3g}" if abs(x) < 0.01 else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"

    head = ["metric", "measured", "roofline/reference", "ratio", "target", "ok"]
    lines = [[r["metric"], num(r["measured"]), num(r["reference"]), num(r["ratio"]), r["target"],
              "-" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")] for r in rows]
    meta = res["meta"]
    print(f"\n## siesta engine benchmark: {meta['device_name']}, backend {meta.get('attention_backend')}, "
          f"{'TINY smoke run (numbers mean nothing): ' if meta['tiny'] else ''}"
          f"{shape_label(meta['model_shape']) if meta.get('model_shape') else 'no checkpoint'}")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(" --- " for _ in head) + "|")
    for line in lines:
        print("| " + " | ".join(line) + " |")
    hf = res.get("hf")
    if hf:
        print(f"(transformers ran {hf['requests']} requests x {hf['max_new_tokens']} new tokens in one batch, "
              f"left-padded to {hf['padded_width']}; siesta ran the full workload)")
    for section, err in res["errors"].items():
        print(f"section {section} FAILED: {err.splitlines()[-1] if err else ''}")
    print(f"total {elapsed():.0f} s; JSON in {res['meta']['out']}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--tiny", action="store_true", help="tiny Qwen3 on the CPU, small workloads: a smoke test")
    p.add_argument("--shape", help="0.6b | 8b (Qwen3 shapes, random weights) | DIR (its config.json; measured as "
                   "it is if it holds weights)")
    p.add_argument("--model-dir", help="where a built checkpoint goes (default /tmp/siesta-bench-qwen3-<shape>)")
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
    p.add_argument("--decode-context", type=int, help="prompt tokens of each decode sequence")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per batch size")
    p.add_argument("--decode-warmup", type=int, help="untimed decode steps before them")
    p.add_argument("--tp-requests", type=int)
    p.add_argument("--tp-min-len", type=int, help="shortest prompt and output")
    p.add_argument("--tp-max-len", type=int, help="longest prompt and output")
    p.add_argument("--tp-time-limit-s", type=float, default=300.0, help="abort the throughput run after this")
    p.add_argument("--temperature", type=float, default=0.0, help="of the throughput requests (0: greedy, as HF)")
    p.add_argument("--hf-requests", type=int, help="transformers subsample size (one batch)")
    p.add_argument("--hf-max-new-tokens", type=int, help="new tokens per transformers request")
    p.add_argument("--hf-reserve-s", type=float, default=60.0, help="time kept for transformers")
    p.add_argument("--deadline-s", type=float, default=450.0, help="whole-run budget the sections plan against")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: copy,graph_memory,decode,throughput,hf")
    args = p.parse_args(argv)
    for k, v in (TINY_DEFAULTS if args.tiny else FULL_DEFAULTS).items():
        if getattr(args, k) is None and (k != "model_dir" or args.tiny):  # else resolve_checkpoint's, per shape
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
    copy = section("copy", copy_bandwidth, device, args.copy_mib, args.copy_iters)
    if device.type == "cuda":
        section("graph_memory", graph_memory, args)
    else:
        say("graph_memory: skipped (needs CUDA)")

    work: list[tuple[list[int], int]] = []

    def engine_sections() -> dict[str, Any]:
        """Decode and throughput share one engine with CUDA graphs, freed at the end."""
        core = EngineCore(EngineConfig(
            model=args.model_path, device=args.device, dtype="bfloat16", max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            max_num_seqs=args.graph_max_bs, cuda_graph_max_bs=args.graph_max_bs, mem_fraction=args.mem_fraction,
            kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed,
        ))
        info = core.get_info()
        info.pop("config", None)
        res["meta"]["attention_backend"] = info["attention_backend"]
        say(f"engine: backend {info['attention_backend']}, weights {info['weights_bytes'] / _MIB:.0f} MiB, KV "
            f"{info['kv_cache_bytes'] / _GIB:.2f} GiB ({info['kv_blocks_total']} blocks), graphs "
            f"{info['cuda_graph_bytes'] / _MIB:.0f} MiB for bs {info['cuda_graph_batch_sizes'][-1:] or 'none'}")
        try:
            work.extend(workload(args, core.model_config.vocab_size))
            weight_bytes = decode_weight_bytes(core)
            kv_token_bytes = kv_block_bytes(core.model_config, 1, core.runner.dtype)
            bandwidth = copy["bandwidth_bytes_per_s"] if copy else float("nan")
            replays = count_graph_replays(core)
            rng = random.Random(args.seed + 1)
            res["decode"] = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token_bytes,
                             "bandwidth_bytes_per_s": bandwidth, "batches": []}
            if "decode" not in args.skip:
                for bs in [int(b) for b in args.decode_batch_sizes.split(",")]:
                    try:
                        res["decode"]["batches"].append(
                            decode_steps(core, args, bs, rng, weight_bytes, kv_token_bytes, bandwidth, replays))
                    except Exception:
                        res["errors"][f"decode_bs{bs}"] = traceback.format_exc()
                        say(f"decode bs={bs}: FAILED\n{res['errors'][f'decode_bs{bs}']}")
                        core.abort(None)
                    write_json(args.out, res)
            section("throughput", throughput, core, args, work)
        finally:
            del core
            free_memory(device)
        return info

    section("engine", engine_sections)
    if not work:
        work = workload(args, shape["vocab_size"])
    if elapsed() > args.deadline_s - 20:
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
