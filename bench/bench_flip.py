"""Flip benchmark: what an RL framework pays between two rollout phases, over HTTP against the real
server (`python -m server.cli serve`, i.e. `siesta serve`): release kv_cache + weights -> (the
trainer trains in the freed memory) -> resume weights -> push the new weights -> resume kv_cache
(and cuda_graph if released) -> generate, in SGLang's dialect (release/resume_memory_occupation,
update_weights_*) and in vLLM's (`--push vllm_ipc`: /sleep, /wake_up, /update_weights) against the
same server. Each phase against a reference measured in the same run; one table of ratios; every
number also goes to the JSON file named by `--out`, rewritten after each section, so a run cut
short still leaves what it measured. See bench/README.md.

    python3 bench/bench_flip.py --shape 8b --out $OUT/flip.json                    # one GPU: bucket, tensor
    python3 bench/bench_flip.py --shape 8b --push distributed --out $OUT/flip.json # two GPUs: NCCL group
    python3 bench/bench_flip.py --shape 8b --tp-size 2 --out $OUT/flip_tp2.json    # server on two GPUs
    python3 bench/bench_flip.py --shape 30b-a3b --out $OUT/flip.json               # MoE, config.json only
    python3 bench/bench_flip.py --shape 8b --push tensor,vllm_ipc --flips 5 --out $OUT/flip.json  # both dialects
    python bench/bench_flip.py --tiny --out /tmp/flip.json                         # CPU smoke test

This process is the trainer (as examples/rl_colocate.py): its new weights have the checkpoint's
names, shapes and dtypes (safetensors headers; without weights on disk, its config.json's model's
with packed experts: flip_trainer.py), random values seeded per flip, made only after the
release, on `--trainer-gpu` (default: the server's GPU, colocated), and freed (empty_cache) after
the push, before kv_cache resumes. The server runs on `--server-gpu` (CUDA_VISIBLE_DEVICES);
`distributed` puts the trainer on `--dist-gpu` (default: another GPU). Push modes (`--push`):
  - bucket: update_weights_from_tensor, load_format "flattened_bucket", the whole model in ONE
    bucket (flatten_bucket + serialize_payload), as slime sends it; packed before the push.
  - tensor: update_weights_from_tensor, one (name, tensor) pair per tensor, load_format null, as
    verl sends it. CUDA IPC handles on a GPU, shared memory on a CPU.
  - distributed: init_weights_update_group once, then per flip update_weights_from_distributed
    while this process broadcasts each tensor as rank 0 (NCCL; gloo on a CPU). The HTTP call
    goes out from a child process (`--post-from`), as slime's engine actors post it.
  - distributed_bucket: the same with load_format "flattened_bucket": the tensors' bytes back to
    back in ONE broadcast (SGLang's FlattenedTensorBucket).
  - vllm_ipc: vLLM's dialect, as SkyRL drives a colocated vLLM server (flip_vllm.py cites it):
    /sleep?level=1&tags=kv_cache&tags=weights -> new weights -> /wake_up?tags=weights ->
    /update_weights {update_info: names, dtype_names, shapes, ipc_handles_pickled} (vLLM's CUDA-IPC
    backend: one handle per tensor, as `tensor`) -> /wake_up?tags=kv_cache. `--vllm-sleep-level 2`
    sleeps as SkyRL does. On a CPU (no CUDA IPC) the update is vLLM's broadcast backend over gloo
    (/init_weight_transfer_engine once, then /update_weights {names, dtype_names, shapes}).
    The table holds its flip total against `tensor`'s (the same per-tensor CUDA IPC): <= 1.05.
  A mode named again runs another round where it stands in the list (`tensor,vllm_ipc,tensor,
  vllm_ipc` interleaves two rounds); each round's flips join the earlier rounds' (pooled medians).

Sections, in this order:
  1. checkpoint: serving_checkpoint.py's `build_checkpoint` (a random bf16 checkpoint of
     `--shape 0.6b|8b|DIR` into `--model-dir`, plus the demo tokenizer), in a child process.
  2. refs.d2d: `dst.copy_(src)` of one flat tensor of the model's bytes on the trainer GPU, CUDA
     events, median: the floor of a CUDA IPC push.
  3. refs.h2d: a child on the server's GPU times a pinned host -> device copy (memory_children.py):
     the floor of a weights restore from the host copy.
  4. refs.broadcast (with a distributed mode): before the server starts, this process (rank 0, trainer
     GPU) and a child (rank 1, the server's GPU and CUDA_VISIBLE_DEVICES) broadcast (a) one flat
     uint8 tensor of the model's bytes and (b) the model's tensors one by one; warm-up, median.
  5. server: start it; `--mem-fraction`, `--max-model-len`, `--weights-backup`, `--server-args`.
  6. verify.initial: `/weights_checker` checksum of the loaded weights (per tensor).
  7. refs.driver: with kv_cache + weights released, children on the server's GPU time the CUDA
     driver's unmap + release and create + map of one handle of each region's bytes (from
     `/memory_occupation`; memory_driver.py through memory_children.py), then resume.
  8. push.<mode>, per mode: `--warmup-flips` untimed flips, then `--flips` timed ones. Each: the
     wall time around every call from this client and the server's `seconds`; flip total =
     release + resume weights + push + resume kv (wall; vllm_ipc: sleep + wake weights +
     update_weights + wake kv); then one greedy `/generate` (4 prompts,
     8 tokens), timed apart; every answer kept verbatim. `--verify every|last` checksums the
     server's weights after every flip (or each mode's last): every tensor must have changed.
  9. verify.restore: the checkpoint's own tensors pushed back (tensor mode); the checksum must
     equal the initial one (without weights on disk: the last flip's, after a random refill). `pushed_weights_taken` = every checked flip changed every tensor,
     generate answered with the pushed weight_version (vllm_ipc: the engine's own, which vLLM's
     update keeps), and the restore matched bit for bit.
The server is stopped in `finally` (and on Ctrl-C / SIGTERM). No section starts after
`--deadline-s`; the exit status is 1 when a section crashed (traceback in the JSON under `errors`).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import traceback
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [p for p in (ROOT, BENCH) if p not in sys.path]

from bench_runtime import elapsed, say, write_json  # noqa: E402
from flip_gpus import plan_gpus  # noqa: E402
from flip_table import print_table, summarize, table_rows  # noqa: E402

MODES = ("bucket", "tensor", "distributed", "distributed_bucket", "vllm_ipc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", required=True, help="JSON results file (the server's log goes beside it)"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny Qwen3 on the CPU: a smoke test (numbers mean nothing)",
    )
    p.add_argument("--shape", default=None, help="0.6b | 8b | DIR (default 8b; tiny with --tiny)")
    p.add_argument(
        "--model-dir",
        help="where a built checkpoint goes (default /tmp/siesta-bench-qwen3-<shape>)",
    )
    p.add_argument(
        "--push",
        help="comma list of bucket,tensor,distributed,distributed_bucket,vllm_ipc (default bucket,tensor; "
        "+distributed,distributed_bucket on CUDA with >= 2 GPUs)",
    )
    p.add_argument(
        "--vllm-sleep-level", type=int, choices=(1, 2), default=1,
        help="vllm_ipc's /sleep level: 1 keeps the host copy, as SGLang's release (default); 2 drops it, as SkyRL",
    )
    p.add_argument("--flips", type=int, default=3, help="timed flips per push mode")
    p.add_argument("--warmup-flips", type=int, default=1, help="untimed flips first, per push mode")
    p.add_argument(
        "--rollout-s", type=float, default=None,
        help="seconds between a flip's generate and the next release: the rollout phase, in which the "
        "pinned host copy of the pushed weights refreshes (~0.3 s at 8B; a release sooner waits for it, "
        "and says so in host_copy_wait_seconds). Default 1.0 (0 with --tiny)",
    )
    p.add_argument(
        "--release-graphs", action="store_true", help="release and resume cuda_graph too"
    )
    p.add_argument(
        "--post-from", choices=("process", "thread"), default="process",
        help="where the distributed push's HTTP call goes out from while this process broadcasts: "
        "a child process (as slime's engine actors post; default) or a thread of this process",
    )
    p.add_argument(
        "--verify",
        choices=("every", "last", "none"),
        help="checksum the server's weights after "
        "every flip, after each mode's last, or never (default: every with --tiny, else last; none for a "
        "checkpoint without weights, whose checksums take minutes)",
    )
    p.add_argument(
        "--server-gpu", type=int, default=0,
        help="the server's GPU (CUDA_VISIBLE_DEVICES), its first with --tp-size > 1",
    )
    p.add_argument(
        "--tp-size", type=int, default=1,
        help="the server's --tp-size: it runs on --server-gpu and the next tp_size - 1 GPUs",
    )
    p.add_argument(
        "--trainer-gpu",
        type=int,
        help="the trainer's GPU for bucket and tensor (default: the server's)",
    )
    p.add_argument(
        "--dist-gpu",
        type=int,
        help="the trainer's GPU for distributed (default: the first other GPU)",
    )
    p.add_argument("--mem-fraction", type=float, default=0.7)
    p.add_argument("--max-model-len", type=int, help="default 1024 (256 with --tiny)")
    p.add_argument(
        "--weights-backup", help="the server's --weights-backup (default: the server's own)"
    )
    p.add_argument("--server-args", default="", help="more `siesta serve` flags, one string")
    p.add_argument("--h2d-mib", type=int, default=1024)
    p.add_argument("--ref-iters", type=int, default=5, help="timed iterations of each reference")
    p.add_argument(
        "--driver-wait-s",
        type=float,
        default=0.5,
        help="the driver child's wait (after_wait numbers)",
    )
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--deadline-s", type=float, default=540.0, help="no section or flip starts after this (s)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.tiny else "8b")
    args.max_model_len = args.max_model_len or (256 if args.tiny else 1024)
    args.verify = args.verify or ("every" if args.tiny else None)  # None: flip_sections.run_all decides
    args.rollout_s = (0.0 if args.tiny else 1.0) if args.rollout_s is None else args.rollout_s
    return args


class Run:
    """The results, the sections' bookkeeping and the device plan of one run."""

    def __init__(self, args: argparse.Namespace, gpus: dict[str, Any]) -> None:
        self.args, self.gpus = args, gpus
        self.res: dict[str, Any] = {
            "meta": {
                "out": args.out,
                "tiny": args.tiny,
                "python": platform.python_version(),
                "args": vars(args),
                "gpus": gpus,
            },
            "refs": {},
            "push": {},
            "verify": {},
            "errors": {},
            "skipped": [],
        }

    def section(self, name: str, fn: Any, *a: Any) -> Any:
        if self.late():
            self.res["skipped"].append(name)
            say(f"{name}: skipped (past --deadline-s)")
            return None
        try:
            return fn(*a)
        except Exception:
            self.res["errors"][name] = traceback.format_exc()
            say(f"{name}: FAILED\n{self.res['errors'][name]}")
            return None
        finally:
            write_json(self.args.out, self.res)

    def late(self) -> bool:
        return elapsed() > self.args.deadline_s

    def env(self, visible: str | None) -> dict[str, str]:
        """The environment of a child on the server's GPU (`visible`); the repository root on its
        PYTHONPATH (the driver child imports engine.memory.vmm)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    if args.tiny:  # 2 CPU cores shared by the server, its engine and this process
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        gpus = plan_gpus(args)
    except ValueError as e:
        gpus = {"cuda": False, "error": str(e)}
    run = Run(args, gpus)
    res = run.res
    if not args.tiny and not gpus["cuda"]:
        res["errors"]["gpu"] = (
            gpus.get("error") or "no NVIDIA GPU (nvidia-smi lists none); use --tiny on a CPU"
        )
        write_json(args.out, res)
        say(f"bench_flip needs an NVIDIA GPU without --tiny: {res['errors']['gpu']}")
        return 2
    # The distributed modes need a GPU the server does not use (NCCL allows one rank per GPU).
    default = "bucket,tensor" + (",distributed,distributed_bucket" if gpus.get("dist_local") is not None else "")
    modes = [m for m in (args.push or default).split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--push: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    res["meta"]["push_modes"] = modes
    try:
        from flip_sections import run_all

        run_all(run, modes)
    except KeyboardInterrupt:
        res["errors"]["interrupted"] = "KeyboardInterrupt"
        say("interrupted")
    except Exception:  # outside any section (each section records its own)
        res["errors"]["run"] = traceback.format_exc()
        say(f"run: FAILED\n{res['errors']['run']}")
    for sec in res["push"].values():
        if sec.get("flips"):
            sec["summary"] = summarize(sec["flips"], res["meta"].get("model_bytes", 0))
    res["table"] = table_rows(res)
    res["meta"]["total_s"] = elapsed()
    write_json(args.out, res)
    print_table(res, elapsed())
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
