"""Serving benchmark: the real `siesta serve` under RL-shaped and online load, against the
in-process `engine.Engine` on the same work. One run, one table of ratios; every number also goes
to the JSON file named by `--out`, rewritten after each section. See bench/README.md.

    python bench/bench_serving.py --shape 0.6b --num-prompts 256,1024 --out $OUT/serving.json   # GPU
    python bench/bench_serving.py --shape 30b-a3b --routed-experts --out $OUT/moe.json            # GPU, MoE
    python bench/bench_serving.py --tiny --out /tmp/s.json                                      # CPU smoke test
    python bench/bench_serving.py --tiny --shape tiny-moe --routed-experts --out /tmp/m.json    # CPU, MoE paths

Rules:
- The checkpoint is built by serving_checkpoint.py (`--shape 0.6b|8b|30b-a3b|DIR`, random bf16
  weights; an MoE shape as its config.json alone, served with `--load-format dummy`) in a child
  process, so this process never holds the GPU. The server needs a tokenizer: the demo tokenizer
  (512 tokens) is written into a checkpoint built here, or into a directory of its own passed as
  `--tokenizer` when DIR is someone else's, widened so that every id of the model decodes to a
  word. Prompts are token ids.
- Order: the in-process Engine first (all N), stopped; then the server (all N, then online),
  stopped. Never both at once. Each uses the engine flags of `--server-args`.
- RL shape, for each N: (1) one `/generate` holding N prompts, (2) N concurrent single-prompt
  requests, (3) N concurrent streams (no logprobs), (4) N/8 concurrent requests with `n: 8` (N
  samples); all with `ignore_eos`, `--output-len` new tokens, logprobs unless streamed. Fresh
  random prompts per section, prefix cache flushed before each; batched and Engine share theirs.
- CPU: /proc/PID/stat utime+stime of the server (every API server process, summed; the target is
  on the busiest) and the engine process before and after each section, as % of one core over the
  section's wall time; each client process reports its own.
  A section with a client process above 90 % of a core is `invalid` (the load generator may have
  been the bottleneck: raise --client-procs).
- `--routed-experts` (MoE only, serving_routes.py): after the server sections, a second server
  with `--enable-return-routed-experts` runs batched, singles and n8 again, every request asking
  for its routed experts; each mode against itself without (`--server-args "--routed-experts-dtype
  uint8"`: in SGLang's smallest wire integers).
- `--compare-server-args FLAGS` (serving_routes.py): the same, a second server with FLAGS added
  (`--deterministic`: issue 76's cost over HTTP), each mode against itself without, target
  `--compare-target`.
- Long tail (serving_longtail.py): S concurrent sequences of P-token prompts generating O tokens
  each (`--longtail`, 8x16384x4096), after the online shape.
- `--rounds K`: each section (the Engine's too) runs K times, the modes interleaved (batched,
  singles, streams, n8, batched, ...), and the round with the median tok/s is reported, with every
  round's tok/s beside it (`rounds_tokens_per_s`): on a machine whose speed drifts by +-10 %
  between runs, ratios of medians say what one round cannot.
- Bounded: every request has `--request-timeout-s`; no section starts after `--deadline-s`; the
  server (its own process group) is stopped in `finally`, on Ctrl-C and SIGTERM too. Loopback only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing as mp
import os
import platform
import random
import shlex
import signal
import sys
import time
import traceback
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import elapsed, say, write_json  # noqa: E402
from serving_checkpoint import build_checkpoint, dummy_flags  # noqa: E402
from serving_clients import (  # noqa: E402
    CLIENT_CPU_LIMIT_PCT,
    SAMPLES,
    ClientPool,
    online_specs,
    random_prompts,
    rl_specs,
)
from serving_longtail import longtail_specs, summarize_longtail  # noqa: E402
from serving_routes import ROUTED_MODES, route_bytes, route_ids  # noqa: E402
from serving_server import Server, cpu_pct, cpu_s, py_spy, stop_py_spy  # noqa: E402
from serving_summary import summarize  # noqa: E402
from serving_table import print_table, table_rows  # noqa: E402

MODES = ("batched", "singles", "streams", "n8")
FULL = dict(shape="0.6b", server_args="", num_prompts="64,256,1024", input_len=256, output_len=256,
            online_output_len=256, num_online=256, request_rate=16.0, client_procs=8, deadline_s=480.0, startup_timeout_s=600.0,
            longtail="8x16384x4096")
TINY = dict(shape="tiny", num_prompts="8", input_len=16,
            output_len=8, server_args="--device cpu --dtype float32 --kv-cache-memory-gb 0.05 --max-model-len 256",
            # streams long enough that a server starved of CPU (CI: 2 cores) cannot send one whole
            # in a single event, so they have inter-token gaps to measure
            online_output_len=48, num_online=6, request_rate=20.0, client_procs=2, deadline_s=120.0, startup_timeout_s=120.0,
            longtail="2x64x16")


def http_section(server: Server, pool: ClientPool, shares: list[list[dict[str, Any]]], expected: int,
                 profile: tuple[str | None, str] = (None, "")) -> dict[str, Any]:
    """Flush, open connections, then run with the server's and the engine's CPU read around it
    (and sampled by py-spy when `profile` = (binary, file prefix) names one)."""
    server.flush()
    pool.warm([min(len(s), 1024) for s in shares])
    spies = py_spy(profile[0], {"server": server.proc.pid, "engine": server.engine_pid}, profile[1])
    pids = [*server.api_pids, server.engine_pid]
    steps0 = server.steps()
    before = [cpu_s(pid) for pid in pids]
    start_at, results = pool.run(shares)
    after = [cpu_s(pid) for pid in pids]
    stop_py_spy(spies)
    out = summarize(start_at, results, expected)
    out["engine_steps"] = server.steps() - steps0
    api = [cpu_pct(b, a, out["wall_s"]) for b, a in zip(before[:-1], after[:-1], strict=True)]
    # Server CPU: all its API processes together, and the busiest one (a process is the ceiling).
    out["server_cpu_pct"] = None if None in api else sum(api)
    out["server_cpu_pct_max"] = None if None in api else max(api)
    if out["server_cpu_pct"] is not None and out["output_tokens"]:  # predicts the % at other rates
        out["server_cpu_us_per_token"] = 1e4 * out["server_cpu_pct"] * out["wall_s"] / out["output_tokens"]
    out["engine_cpu_pct"] = cpu_pct(before[-1], after[-1], out["wall_s"])
    out["invalid"] = out["client_cpu_pct_max"] > CLIENT_CPU_LIMIT_PCT
    return out


def engine_runs(args: argparse.Namespace, model: str, flags: list[str], work: dict[int, list[list[int]]],
                res: dict[str, Any]) -> None:
    """The in-process Engine on each N's batched prompts: one `generate` call each, timed."""
    from engine import Engine, SamplingParams
    from server.cli import build_parser, engine_config_from

    cfg = engine_config_from(build_parser().parse_args(["serve", "--model", model, *flags]))
    knobs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model"}
    sp = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True, temperature=args.temperature, logprobs=True)
    with Engine(model=model, log_level="WARNING", **knobs) as llm:
        pid = llm._core.process.pid  # noqa: SLF001
        llm.generate(input_ids=work[min(work)][:16], sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        for n, prompts in work.items():
            if elapsed() > args.deadline_s:
                say(f"engine N={n}: skipped (past --deadline-s)")
                continue
            runs = []
            for _ in range(args.rounds):
                llm.flush_cache()
                steps0 = llm.get_server_info()["num_steps"]
                before, cpu0, t = cpu_s(pid), time.process_time(), time.perf_counter()
                outs = llm.generate(input_ids=prompts, sampling_params=sp)
                wall = time.perf_counter() - t
                steps = llm.get_server_info()["num_steps"] - steps0
                tokens = sum(len(o.output_ids) for o in outs)
                bad = [o for o in outs if o.finish_reason != "length" or len(o.output_ids) != args.output_len
                       or len(o.output_token_logprobs or []) != args.output_len]
                runs.append({
                    "requests": n, "ok": n - len(bad), "failed": len(bad), "output_tokens": tokens,
                    "expected_output_tokens": n * args.output_len, "wall_s": wall, "tokens_per_s": tokens / wall,
                    "engine_cpu_pct": cpu_pct(before, cpu_s(pid), wall),
                    "client_cpu_pct_max": 100.0 * (time.process_time() - cpu0) / wall, "invalid": False,
                    "engine_steps": steps})
                say(f"engine N={n}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s in {steps} steps")
            res["rl"].setdefault(str(n), {})["engine"] = median_section(runs)
            write_json(args.out, res)


def median_section(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a section's rounds, the one with the median tok/s (the lower of two middles), with every
    round's tok/s beside it: a mode's ratio is of medians, so one slow round moves nothing."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2] | {"rounds_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def serve_runs(args: argparse.Namespace, model: str, flags: list[str], work: dict[int, list[list[int]]],
               vocab: int, res: dict[str, Any], routes: int = 0, extra: list[str] | None = None) -> None:
    """The server: every mode at each N, then the online shape; stopped whatever happens. With
    `routes` (expert ids of routes per position) it records them and every request asks for
    them: ROUTED_MODES only, into res["rl_routed"]. With `extra` flags (--compare-server-args):
    ROUTED_MODES only, into res["rl_compare"]."""
    variant = "routed" if routes else "compare" if extra else ""
    key, modes = (f"rl_{variant}", ROUTED_MODES) if variant else ("rl", MODES)
    flags = [*flags, "--enable-return-routed-experts"] if routes else [*flags, *(extra or [])]
    server = Server(model, flags, os.path.splitext(args.out)[0] + (f".{variant}" if variant else "") + ".server.log")
    pool: ClientPool | None = None
    try:
        info = res[f"server_{variant}" if variant else "server"] = server.wait_ready(args.startup_timeout_s)
        say(f"server: ready at {server.url}, engine pid {server.engine_pid}, device {info.get('device')}")
        routes = route_bytes(routes, info) if routes else 0
        pool = ClientPool(server.url, args.client_procs, args.request_timeout_s)
        sampling = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature}
        warm = rl_specs("batched", work[min(work)][:16], sampling | {"max_new_tokens": 4}, args.client_procs)
        http_section(server, pool, *warm)  # untimed: the first request's one-time costs
        for n, batched_prompts in work.items():
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for _, (i, mode) in itertools.product(range(args.rounds), enumerate(MODES)):
                if mode not in modes or mode in args.skip or (mode == "n8" and n < SAMPLES) or elapsed() > args.deadline_s:
                    continue
                prompts = batched_prompts if mode == "batched" else random_prompts(
                    random.Random(args.seed * 7919 + n * 10 + i), n, args.input_len, vocab)
                shares = rl_specs(mode, prompts, sampling, args.client_procs, SAMPLES, routes)
                profile = (args.py_spy, f"{os.path.splitext(args.out)[0]}.{mode}.{n}")
                r = http_section(server, pool, *shares, profile=profile)
                runs[mode].append(r)
                res[key].setdefault(str(n), {})[mode] = median_section(runs[mode])
                say(f"{mode}{f' {variant}' if variant else ''} N={n}: {r['output_tokens']}/{r['expected_output_tokens']} tokens in {r['wall_s']:.2f} s = "
                    f"{r['tokens_per_s']:.0f} tok/s; {r['failed']} failed; CPU server {r['server_cpu_pct'] or 0:.0f} % "
                    f"({r.get('server_cpu_us_per_token', 0):.1f} us/token), "
                    f"engine {r['engine_cpu_pct'] or 0:.0f} %, clients {r['client_cpu_pct_max']:.0f} % max, {r['engine_steps']} steps")
                write_json(args.out, res)
        if not variant and "online" not in args.skip and elapsed() <= args.deadline_s:
            shares = online_specs(random.Random(args.seed + 99), args.num_online, args.request_rate, args.input_len,
                                  args.online_output_len, args.random_range_ratio, vocab, sampling, args.client_procs)
            r = res["online"] = http_section(server, pool, *shares)
            r |= {"request_rate": args.request_rate, "num_requests": args.num_online}
            say(f"online: {r['ok']}/{r['requests']} ok, {r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.0f} tok/s, "
                f"TTFT p50 {r['ttft_ms']['p50'] or 0:.1f} ms, ITL p50 {r['itl_ms']['p50'] or 0:.1f} ms")
        if not variant and "longtail" not in args.skip and elapsed() <= args.deadline_s:
            shares, shape = longtail_specs(args.longtail, args.seed, vocab, sampling, args.client_procs)
            r = res["longtail"] = summarize_longtail(http_section(server, pool, *shares), shape)
            say(f"longtail {args.longtail}: {r['ok']}/{r['requests']} ok, {r['tokens_per_s_per_sequence']:.1f} tok/s "
                f"per sequence, {r['mean_step_ms'] or 0:.2f} ms a step over {r['engine_steps']} steps")
    finally:
        if pool is not None:
            pool.close()
        server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file (the server's log goes beside it)")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU, tiny workloads: a smoke test")
    p.add_argument("--shape", help="0.6b | 8b | 30b-a3b | DIR, as bench_engine.py takes it (default 0.6b; "
                   "with --tiny: tiny | tiny-moe)")
    p.add_argument("--model-dir", help="where a built checkpoint goes (default /tmp/siesta-bench-qwen3-<shape>)")
    p.add_argument("--server-args", help="engine and server flags of `siesta serve`, one string (also the Engine's knobs)")
    p.add_argument("--num-prompts", help="comma-separated N of the RL shape (default 64,256,1024)")
    p.add_argument("--input-len", type=int, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, help="new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (RL rollouts sample)")
    p.add_argument("--num-online", type=int, help="requests of the online shape (default 256)")
    p.add_argument("--online-output-len", type=int, help="the online shape's longest output (default 256)")
    p.add_argument("--request-rate", type=float, help="online arrivals per second, Poisson; inf: all at once (default 16)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="online lengths uniform in [ratio*len, len]")
    p.add_argument("--client-procs", type=int, help="client processes (default 8)")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--startup-timeout-s", type=float)
    p.add_argument("--deadline-s", type=float, help="no section starts after this, seconds from the start (default 480)")
    p.add_argument("--rounds", type=int, default=1, help="run each section this many times, modes interleaved "
                   "(batched, singles, ..., batched, ...); report the median round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--py-spy", help="py-spy binary: sample the server and the engine during each RL section "
                   "(files beside --out: <out>.<mode>.<N>.<server|engine>.txt, collapsed stacks)")
    p.add_argument("--routed-experts", action="store_true", help="MoE: the server sections again with "
                   "--enable-return-routed-experts and return_routed_experts in every request; on / off tok/s")
    p.add_argument("--compare-server-args", help="more server flags: batched, singles and n8 again on a second server "
                   "started with them, each mode's tok/s over the same mode's without (e.g. --deterministic)")
    p.add_argument("--compare-target", type=float, default=0.90, help="the least ratio of --compare-server-args' rows")
    p.add_argument("--longtail", help="the long-tail section: SEQUENCESxPROMPTxOUTPUT tokens (default 8x16384x4096)")
    p.add_argument("--skip", default="", help="comma-separated: engine,serve (all server sections),batched,singles,streams,"
                   "n8,online,longtail")
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tiny and args.model_dir is None:  # one directory per tiny shape: tiny and tiny-moe never rebuild each other
        args.model_dir = f"/tmp/siesta-bench-serving-{os.path.basename(args.shape.rstrip('/'))}"
    args.skip = {s for s in args.skip.split(",") if s}
    args.num_prompts = sorted({int(x) for x in args.num_prompts.split(",")})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    def stop(*_: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    if args.tiny:  # 2 CPU cores shared by engine, server and clients: torch's spinning threads would thrash
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    res: dict[str, Any] = {"meta": {"out": args.out, "tiny": args.tiny, "python": platform.python_version(),
                                    "args": vars(args) | {"skip": sorted(args.skip)}}, "rl": {}, "rl_routed": {}, "rl_compare": {},
                           "errors": {}}
    try:
        try:
            with mp.get_context("spawn").Pool(1) as child:  # bounded: an hour covers writing 16 GB
                job = child.apply_async(build_checkpoint, (args.shape, args.model_dir, args.seed, args.tiny))
                ckpt = res["checkpoint"] = job.get(timeout=3600)
        except Exception:
            res["errors"]["checkpoint"] = traceback.format_exc()
            say(f"checkpoint: FAILED\n{res['errors']['checkpoint']}")
            args.skip |= {"engine", "serve"}
            ckpt = {"path": "", "shape": {"vocab_size": 1}, "tokenizer": None}
        model, vocab = ckpt["path"], ckpt["shape"]["vocab_size"]
        flags = shlex.split(args.server_args) + (["--tokenizer", ckpt["tokenizer"]] if ckpt["tokenizer"] else [])
        flags += dummy_flags(ckpt.get("load_format", "auto"), flags)
        work = {n: random_prompts(random.Random(args.seed * 7919 + n), n, args.input_len, vocab) for n in args.num_prompts}
        second = (("serve_routed", lambda: serve_runs(args, model, flags, work, vocab, res, route_ids(ckpt["shape"])),
                   ()),) if args.routed_experts and "serve" not in args.skip else ()
        extra = shlex.split(args.compare_server_args or "")
        second += (("serve_compare", lambda: serve_runs(args, model, flags, work, vocab, res, extra=extra), ()),) if (
            extra and "serve" not in args.skip) else ()
        for name, fn, a in (("engine", engine_runs, (args, model, flags, work, res)),
                            ("serve", serve_runs, (args, model, flags, work, vocab, res)), *second):
            if name in args.skip:
                continue
            try:
                fn(*a)
            except Exception:
                res["errors"][name] = traceback.format_exc()
                say(f"{name}: FAILED\n{res['errors'][name]}")
            write_json(args.out, res)
    except KeyboardInterrupt:
        res["errors"]["interrupted"] = "KeyboardInterrupt"
        say("interrupted")
    res["table"] = table_rows(res)
    res["meta"]["total_s"] = elapsed()
    write_json(args.out, res)
    print_table(res)
    failed = any(r.get("failed") for rl in ("rl", "rl_routed", "rl_compare") for sec in res[rl].values()
                 for r in sec.values()) or any(
        (res.get(k) or {}).get("failed") for k in ("online", "longtail"))
    return 1 if res["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
