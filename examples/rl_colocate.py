"""A real colocated RL loop: a trainer and a Siesta server on the same device.

Each step: generate with logprobs -> release all memory -> the trainer takes the freed memory and
runs a few optimizer steps on its own copy of the model (raising the likelihood of a target token)
-> resume weights -> push the new weights with update_weights_from_tensor -> resume kv_cache and
cuda_graph -> generate again. Checked every step: the server's greedy outputs equal transformers'
on the trainer's updated weights, and the logprobs the server returns equal the trainer's own
log-softmax of those tokens (1e-4 in float32). Prints the time of each phase of the flip.

    python examples/rl_colocate.py --model DIR [--device cpu|cuda] [--steps 3] [--push tensor|distributed]

`--push tensor` (default) sends update_weights_from_tensor: shared memory on CPU, CUDA IPC handles
on CUDA. `--push distributed` joins a weight-update group (gloo on CPU, NCCL on CUDA) once and
broadcasts the weights with update_weights_from_distributed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM

from engine.weights.payload import serialize_named_tensors

PROMPTS = [[5, 9, 13, 200, 7], [7] * 12, [100, 200, 300]]
NEW_TOKENS = 8
TARGET = 42  # the token the trainer teaches the model to say


def start_server(model: str, device: str, port: int, dtype: str, gpu: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--device", device,
           "--dtype", dtype, "--port", str(port), "--max-model-len", "256", "--log-level", "WARNING"]
    if device == "cpu":
        cmd += ["--num-kv-blocks", "256"]
    env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


@contextmanager
def phase(times: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0


def post(http: httpx.Client, path: str, body: dict[str, Any] | None = None) -> Any:
    r = http.post(path, json=body or {})
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text}")
    return r.json()


def generate(http: httpx.Client) -> list[dict[str, Any]]:
    body = {"input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    return post(http, "/generate", body)


def train(model: torch.nn.Module, steps: int, device: str, lr: float) -> float:
    """A few Adam steps raising log p(TARGET | prompt) at every prompt's last position."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(
            -torch.log_softmax(model(torch.tensor([p], device=device)).logits[0, -1], -1)[TARGET] for p in PROMPTS
        )
        loss.backward()
        opt.step()
    model.eval()
    return float(loss)


@torch.no_grad()
def check(model: torch.nn.Module, outs: list[dict[str, Any]], device: str) -> float:
    """Server greedy tokens == transformers' on the trainer's weights; server logprobs == the
    trainer's log-softmax of those tokens. Returns the largest logprob difference."""
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt], device=device)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = want[0, len(prompt):].tolist()
        if out["output_ids"] != want:
            raise AssertionError(f"server {out['output_ids']} != transformers {want}")
        full = torch.tensor([prompt + want], device=device)
        logp = torch.log_softmax(model(full).logits[0].float(), -1)
        for i, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            worst = max(worst, abs(lp - logp[len(prompt) - 1 + i, tok].item()))
    if worst > 1e-4:
        raise AssertionError(f"server logprobs differ from the trainer's by {worst}")
    return worst


def join_group(http: httpx.Client, args: argparse.Namespace) -> Any:
    """Rank 0 of a weight-update group with the server as rank 1."""
    import threading

    from engine.weights.groups import trainer_group

    with socket.socket() as sock:  # a free port for the group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "rl", "backend": "nccl" if args.device == "cuda" else "gloo"}
    joined: list[Any] = []
    thread = threading.Thread(target=lambda: joined.append(post(http, "/init_weights_update_group", body)))
    thread.start()
    group = trainer_group("127.0.0.1", port, 2, "rl", body["backend"], device=args.device)
    thread.join()
    if not joined:
        raise RuntimeError("the server did not join the weight-update group")
    return group


def push(http: httpx.Client, pairs: list[tuple[str, torch.Tensor]], group: Any, version: str) -> dict[str, Any]:
    """New weights to the server: CUDA IPC / shared memory, or a broadcast over the group."""
    if group is None:
        return post(http, "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_named_tensors(pairs)], "flush_cache": True, "weight_version": version,
        })
    import threading

    from engine.weights.groups import broadcast_from_trainer

    meta = {"names": [n for n, _ in pairs], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs], "group_name": "rl", "weight_version": version}
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(post(http, "/update_weights_from_distributed", meta)))
    thread.start()
    broadcast_from_trainer(group, pairs)
    thread.join()
    if not answers:
        raise RuntimeError("update_weights_from_distributed failed")
    return answers[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--port", type=int, default=30555)
    ap.add_argument("--push", choices=["tensor", "distributed"], default="tensor")
    ap.add_argument("--dtype", default="float32", help="server and trainer dtype")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--server-gpu", type=int, default=None,
                    help="GPU of the server (CUDA_VISIBLE_DEVICES); NCCL refuses two ranks on one GPU, so "
                         "--push distributed on CUDA needs the server on another GPU than the trainer")
    args = ap.parse_args(argv)

    server = start_server(args.model, args.device, args.port, args.dtype, args.server_gpu)
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120) as http:
            check(trainer, generate(http), args.device)
            group = join_group(http, args) if args.push == "distributed" else None
            for step in range(args.steps):
                times: dict[str, float] = {}
                with phase(times, "generate"):
                    generate(http)
                with phase(times, "release"):
                    released = post(http, "/release_memory_occupation", {"tags": None})
                with phase(times, "train"):
                    scratch = None
                    if args.device == "cuda" and released["bytes_freed"] > 0:  # use the freed memory
                        scratch = torch.empty(int(released["bytes_freed"] * 0.9), dtype=torch.uint8, device="cuda")
                        scratch.fill_(1)
                        del scratch
                        torch.cuda.empty_cache()
                    loss = train(trainer, args.train_steps, args.device, args.lr)
                with phase(times, "resume_weights"):
                    post(http, "/resume_memory_occupation", {"tags": ["weights"]})
                with phase(times, "push_weights"):
                    pairs = [(n, p.detach()) for n, p in trainer.named_parameters()]
                    answer = push(http, pairs, group, f"step-{step + 1}")
                with phase(times, "resume_kv_graph"):
                    post(http, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
                outs = generate(http)
                worst = check(trainer, outs, args.device)
                assert outs[0]["meta_info"]["weight_version"] == answer["weight_version"] == f"step-{step + 1}"
                flip = sum(v for k, v in times.items() if k not in ("generate", "train"))
                print(f"step {step + 1}: loss {loss:.3f}, logprob diff {worst:.1e}; "
                      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
                      + f"; flip (all but generate and train) {flip * 1e3:.1f} ms", flush=True)
        print("rl_colocate: OK")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
