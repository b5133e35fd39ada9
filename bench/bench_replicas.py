"""Replica benchmark (issue #17): R `siesta serve` replicas, one per GPU, behind the SGLang Model
Gateway (smg) against one replica alone on the rollout benchmark's RL shape, then the RL flip
fanned out to every replica through the gateway. One run, one table of ratios; every number also
goes to the JSON file named by `--out`, rewritten after each section. See bench/README.md.

    python bench/bench_replicas.py --shape 0.6b --replicas 2 --out $OUT/replicas.json   # GPU (2 GPUs)
    python bench/bench_replicas.py --tiny --out /tmp/r.json                              # CPU smoke test

Rules:
- The serving suite's checkpoint (serving_checkpoint.py, in a child process, which also counts the
  GPUs: this process never touches CUDA), `Server` and load generator, with their rules. Replica i gets
  CUDA_VISIBLE_DEVICES = the i-th GPU this process sees; on the CPU all share the cores.
- Workload, slime's: N concurrent single-prompt `/generate` requests (`return_logprob`,
  `ignore_eos`, temperature 1), fresh random prompts per section. Untimed before each: min(N, 256)
  4-token requests to every replica directly (smg routes on each replica's reported throughput,
  which a warm-up routed through it skews), prefix caches flushed, two of smg's load polls awaited.
- Sections: "one" (one server, stopped after); "gateway" (R servers, then `python -m
  smg.launch_router --policy cache_aware --enable-rl` with this interpreter and environment,
  loopback ports); "flip" on those. Target: gateway tok/s >= 0.9 R x one's; "n/a (cpu)" on a CPU.
- Requests per replica: the growth of its `siesta_requests_total` (all outcomes). CPU: /proc of the
  gateway, servers and engines, % of one core; a client process above 90 % makes it `invalid`.
- Flip, fanned out by `/v1/rl/engine/<route>?selector=engine=sglang`: release all, resume weights,
  update from disk (same checkpoint, weight_version flip-1), resume kv_cache + cuda_graph; each
  call's wall time and slowest worker `latency_ms`, bytes freed per replica, nvidia-smi memory on
  GPUs. Each replica's greedy outputs before and after must match and carry flip-1, else FAIL.
- Bounded: every request and fan-out has `--request-timeout-s`; no section starts after
  `--deadline-s`; servers and gateway (own process groups) stop in `finally`, on Ctrl-C and SIGTERM too.
  Loopback only. Exit 1 on a crashed section, a failed request or a failed flip.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import httpx
from bench_runtime import elapsed, say, write_json
from replicas_gateway import Gateway, replica, requests_served
from replicas_table import FLIP_VERSION, print_table, table_rows
from serving_checkpoint import build_checkpoint
from serving_clients import CLIENT_CPU_LIMIT_PCT, ClientPool, random_prompts, rl_specs
from serving_server import Server, cpu_pct, cpu_s
from serving_summary import summarize

FULL = dict(shape="0.6b", server_args="", num_prompts=1024, input_len=256, output_len=256, client_procs=8,
            deadline_s=480.0, startup_timeout_s=600.0)
TINY = dict(shape="tiny", model_dir="/tmp/siesta-bench-replicas-tiny", num_prompts=16, input_len=16, output_len=8,
            server_args="--device cpu --dtype float32 --kv-cache-memory-gb 0.05 --max-model-len 256", client_procs=2,
            deadline_s=100.0, startup_timeout_s=120.0)
WARM_REQUESTS, GATEWAY_READY_S, LOAD_POLLS_S = 256, 60.0, 2.0
FLIP_PROMPTS, FLIP_TOKENS = 4, 8
FLIP_STEPS = (("release", "release_memory_occupation", {}), ("resume weights", "resume_memory_occupation", {"tags": ["weights"]}),
              ("update from disk", "update_weights_from_disk", None),
              ("resume kv_cache + cuda_graph", "resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))


def checkpoint_and_gpus(shape: str, model_dir: str | None, seed: int, tiny: bool) -> dict[str, Any]:
    """In a child process: the serving checkpoint, and how many GPUs CUDA sees there."""
    import torch

    return build_checkpoint(shape, model_dir, seed, tiny) | {"gpus": 0 if tiny else torch.cuda.device_count()}


async def warm_up(urls: list[str], prompts: list[list[int]], timeout_s: float) -> None:
    """`prompts` to every replica directly, alike, at once: smg's expected-wait score divides by each
    replica's reported gen_throughput (over its last 10 s), so a warm-up routed unevenly skews the run."""
    body = {"sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, "return_logprob": True}
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=None)) as c:
        rs = await asyncio.gather(*(c.post(f"{u}/generate", json=body | {"input_ids": p}) for u in urls for p in prompts))
    if any(r.status_code != 200 for r in rs):
        raise RuntimeError(f"warm-up: {sum(r.status_code != 200 for r in rs)} requests failed")


def load_section(url: str, servers: list[Server], gateway: Gateway | None, seed: int, vocab: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Warm up (prompts of its own: the gateway's prefix tree learns what it routes), flush every
    replica, then the N singles at `url`, every process's CPU and replica's requests read around."""
    rng, sampling = random.Random(seed), {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature}
    warm = random_prompts(rng, min(args.num_prompts, WARM_REQUESTS), args.input_len, vocab)
    prompts = random_prompts(rng, args.num_prompts, args.input_len, vocab)
    pool = ClientPool(url, args.client_procs, args.request_timeout_s)
    try:
        shares, expected = rl_specs("singles", prompts, sampling, args.client_procs)
        pool.warm([min(len(s), 1024) for s in shares])
        asyncio.run(warm_up([s.url for s in servers], warm, args.request_timeout_s))
        for s in servers:
            s.flush()
        time.sleep(LOAD_POLLS_S if gateway else 0.0)  # the gateway routes on loads polled since the warm-up
        pids = {"gateway": gateway.proc.pid if gateway else None} | {
            f"{kind}{i}": pid for i, s in enumerate(servers) for kind, pid in (("server", s.proc.pid), ("engine", s.engine_pid))}
        served, before = [requests_served(s.url) for s in servers], {k: cpu_s(p) for k, p in pids.items()}
        start_at, results = pool.run(shares)
        after = {k: cpu_s(p) for k, p in pids.items()}
        served = [requests_served(s.url) - b for s, b in zip(servers, served, strict=True)]
    finally:
        pool.close()
    out = summarize(start_at, results, expected)
    cpu = {k: cpu_pct(before[k], after[k], out["wall_s"]) for k in pids}
    out |= {"requests_per_replica": served, "gateway_cpu_pct": cpu["gateway"],
            "server_cpu_pct": [cpu[f"server{i}"] for i in range(len(servers))],
            "engine_cpu_pct": [cpu[f"engine{i}"] for i in range(len(servers))],
            "invalid": out["client_cpu_pct_max"] > CLIENT_CPU_LIMIT_PCT}
    say(f"{url}: {out['ok']}/{out['requests']} ok, {out['output_tokens']} tokens in {out['wall_s']:.2f} s = "
        f"{out['tokens_per_s']:.0f} tok/s; requests per replica {served}; CPU gateway {cpu['gateway'] or 0:.0f} %, "
        f"clients {out['client_cpu_pct_max']:.0f} % max")
    return out


def greedy(url: str, prompts: list[list[int]], timeout_s: float) -> dict[str, Any]:
    """The replica's greedy outputs of `prompts` (one batched request) and the weight versions."""
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": FLIP_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=timeout_s)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
    return {"output_ids": [x["output_ids"] for x in r.json()], "weight_versions": sorted({x["meta_info"]["weight_version"] for x in r.json()})}


def gpu_memory_mib() -> dict[str, int] | None:
    """Used memory per GPU (nvidia-smi's index), MiB; None where nvidia-smi cannot tell."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
        return {i.strip(): int(m) for i, m in (line.split(",") for line in text.strip().splitlines())}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def flip(gateway: Gateway, servers: list[Server], model: str, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """The RL flip through the gateway's fan-out; `ok` when every call succeeded on every replica
    and each replica's greedy outputs after equal those before, with the new weight_version."""
    prompts = random_prompts(random.Random(args.seed + 17), FLIP_PROMPTS, 16, vocab)
    index = {s.url: i for i, s in enumerate(servers)}
    out: dict[str, Any] = {"before": [greedy(s.url, prompts, args.request_timeout_s) for s in servers], "phases": {},
                           "gpu_memory_mib": {"before": gpu_memory_mib() if args.gpu else None}}
    for name, route, body in FLIP_STEPS:
        body = {"model_path": model, "weight_version": FLIP_VERSION} if body is None else body
        p = out["phases"][name] = gateway.fanout(route, body, args.request_timeout_s)
        say(f"flip: {name}: HTTP {p['status']}, {p['succeeded']}/{len(servers)} ok in {p['wall_ms']:.0f} ms "
            f"(slowest worker {p['worker_max_latency_ms'] or 0:.0f} ms)")
        if name == "release":
            out["gpu_memory_mib"]["released"] = gpu_memory_mib() if args.gpu else None
            out["bytes_freed"] = [0] * len(servers)
            for r in p["results"].values():
                if r.get("url") in index:
                    out["bytes_freed"][index[r["url"]]] = (r.get("body") or {}).get("bytes_freed")
    out["gpu_memory_mib"]["after"] = gpu_memory_mib() if args.gpu else None
    out["after"] = [greedy(s.url, prompts, args.request_timeout_s) for s in servers]
    out["all_calls_ok"] = all(p["status"] == 200 and p["succeeded"] == len(servers) for p in out["phases"].values())
    out["identical"] = all("error" not in b and b.get("output_ids") == a.get("output_ids") for b, a in zip(out["before"], out["after"], strict=True))
    out["versions_after"] = sorted({v for a in out["after"] for v in a.get("weight_versions", ["(error)"])})
    out["ok"] = out["all_calls_ok"] and out["identical"] and out["versions_after"] == [FLIP_VERSION]
    say(f"flip: outputs identical {out['identical']}, versions {out['versions_after']}, bytes freed {out['bytes_freed']}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file (server and gateway logs go beside it)")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU, tiny workloads: a smoke test")
    p.add_argument("--shape", help="0.6b | 8b | DIR, as bench_engine.py takes it (default 0.6b)")
    p.add_argument("--model-dir", help="where a built checkpoint goes (default /tmp/siesta-bench-qwen3-<shape>)")
    p.add_argument("--replicas", type=int, default=2, help="replicas behind the gateway, one per GPU")
    p.add_argument("--server-args", help="engine and server flags of every `siesta serve`, one string")
    p.add_argument("--num-prompts", type=int, help="N concurrent single-prompt requests per section (default 1024)")
    p.add_argument("--input-len", type=int, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, help="new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (RL rollouts sample)")
    p.add_argument("--client-procs", type=int, help="client processes (default 8)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="every request's and fan-out's timeout")
    p.add_argument("--startup-timeout-s", type=float)
    p.add_argument("--deadline-s", type=float, help="no section starts after this, seconds from the start (default 480)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.gpu = not args.tiny
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    if args.tiny:  # 2 CPU cores shared by everything: torch's spinning threads would thrash
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    stem = os.path.splitext(args.out)[0]
    res: dict[str, Any] = {"meta": {"out": args.out, "tiny": args.tiny, "gpu": args.gpu, "python": platform.python_version(),
                                    "args": vars(args)}, "servers": {}, "errors": {}, "skipped": []}
    servers: list[Server] = []  # the replicas and then the gateway: all stopped in `finally`

    def section(name: str, fn: Any, *a: Any) -> None:
        if elapsed() > args.deadline_s:
            res["skipped"].append(name)
            return say(f"{name}: skipped (past --deadline-s)")
        try:
            res[name] = fn(*a)
        except Exception:
            res["errors"][name] = traceback.format_exc()
            say(f"{name}: FAILED\n{res['errors'][name]}")
        write_json(args.out, res)

    def one(model: str, flags: list[str], vocab: int) -> dict[str, Any]:
        server = replica(model, flags, f"{stem}.one.log", 0, args.gpu)
        try:
            res["servers"]["one"] = server.wait_ready(args.startup_timeout_s)
            return load_section(server.url, [server], None, args.seed * 7919 + 1, vocab, args)
        finally:
            server.stop()

    def behind_gateway(model: str, flags: list[str], vocab: int) -> dict[str, Any]:
        for i in range(args.replicas):  # all spawned first: they start side by side
            servers.append(replica(model, flags, f"{stem}.replica{i}.log", i, args.gpu))
        res["servers"]["replicas"] = [s.wait_ready(args.startup_timeout_s) for s in servers]
        servers.append(Gateway([s.url for s in servers], f"{stem}.gateway.log"))
        servers[-1].wait_ready(GATEWAY_READY_S)
        return load_section(servers[-1].url, servers[:-1], servers[-1], args.seed * 7919 + 2, vocab, args)

    try:
        with mp.get_context("spawn").Pool(1) as child:  # bounded: an hour covers writing 16 GB
            ckpt = res["checkpoint"] = child.apply_async(checkpoint_and_gpus, (args.shape, args.model_dir, args.seed,
                                                                               args.tiny)).get(timeout=3600)
        if args.gpu and ckpt["gpus"] < args.replicas:
            raise RuntimeError(f"{args.replicas} replicas need as many GPUs; CUDA sees {ckpt['gpus']}")
        work = (ckpt["path"], shlex.split(args.server_args) + (["--tokenizer", ckpt["tokenizer"]] if ckpt["tokenizer"] else []),
                ckpt["shape"]["vocab_size"])
        section("one", one, *work)
        section("gateway", behind_gateway, *work)
        if "gateway" in res:
            section("flip", flip, servers[-1], servers[:-1], work[0], work[2], args)
    except KeyboardInterrupt:
        res["errors"]["interrupted"] = "KeyboardInterrupt"
        say("interrupted")
    except Exception:
        res["errors"]["checkpoint"] = traceback.format_exc()
        say(f"checkpoint: FAILED\n{res['errors']['checkpoint']}")
    finally:
        for s in reversed(servers):
            s.stop()
    res["table"] = table_rows(res, args.replicas, args.gpu)
    res["meta"]["total_s"] = elapsed()
    write_json(args.out, res)
    print_table(res)
    failed = any((res.get(k) or {}).get("failed") for k in ("one", "gateway")) or not (res.get("flip") or {}).get("ok")
    return 1 if res["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
