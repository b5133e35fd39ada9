"""The control plane fuzzed with an oracle (tests/control_fuzz.py): random walks of release,
resume, pause, weight updates, flushes, aborts and bursts of them, with traffic, against a real
server; every judged output equals transformers on the checkpoint of its weight version.

On a CPU (CI) four walks run: a fixed seed and a fresh one, and a fresh one against a server
with speculative decoding (`--speculative-algorithm ngram`: the prompts repeat, so earlier
rollouts draft later ones while calls release, pause, retract, abort and update), and one with
a draft model (`--speculative-algorithm draft`, the "old" checkpoint drafting), printed on failure. A failure replays
with SIESTA_FUZZ_SEED=<seed> (the same calls; the interleaving with traffic may differ).
SIESTA_FUZZ_STEPS sets a walk's length. The GPU soak (`pytest -m gpu`) walks for
SIESTA_SOAK_S seconds (300) with graphs, overlap and `--debug-poison-on-resume` on.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
import torch
from control_fuzz import MAX_NEW, ControlWalk, FuzzSetup
from oracle import hf_greedy, hf_named_parameters
from server_util import ServerProcess, logged_server

FIXED_SEED = 72
STEPS = int(os.environ.get("SIESTA_FUZZ_STEPS", "150"))


def _prompts() -> list[list[int]]:
    """Ten prompts over three shared prefixes of 20 tokens (a full KV block and some)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(3)]
    return [prefixes[i % 3] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for i in range(10)]


@pytest.fixture(scope="module")
def setup(qwen3_dir: str, qwen3_next_dir: str) -> FuzzSetup:
    prompts = _prompts()
    dirs = {"old": qwen3_dir, "new": qwen3_next_dir}
    refs = {name: hf_greedy(d, prompts, MAX_NEW) for name, d in dirs.items()}
    assert refs["old"] != refs["new"]
    tensors = {name: hf_named_parameters(d) for name, d in dirs.items()}
    return FuzzSetup(prompts=prompts, refs=refs, dirs=dirs, tensors=tensors)


def _walk(server: ServerProcess, setup: FuzzSetup, seed: int, steps: int) -> ControlWalk:
    """One walk from the "old" checkpoint; the server is left on it again."""
    walk = ControlWalk(server.url, setup, seed, "old")
    started = time.monotonic()
    try:
        asyncio.run(walk.run(steps))
    except Exception as e:  # a call that got no answer: reported with the seed like any failure
        walk.failures.append(f"{type(e).__name__}: {e}")
    seconds = time.monotonic() - started
    print(f"control walk seed {seed}: {steps} steps in {seconds:.0f} s, {walk.judged} requests judged")
    assert not walk.failures, (
        f"control walk seed {seed} failed after {seconds:.0f} s (replay: SIESTA_FUZZ_SEED={seed}):\n"
        + "\n".join(walk.failures[:5]) + "\nlast calls:\n" + "\n".join(walk.log[-15:])
    )
    assert walk.judged > 0, f"seed {seed}: no request was judged against a reference"
    if walk.version != "old":
        with server.client() as http:
            assert http.post("/update_weights_from_disk", json={"model_path": setup.dirs["old"]}).status_code == 200
    return walk


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    proc = logged_server(qwen3_dir, str(tmp_path_factory.mktemp("logs")), "control_fuzz", "--num-kv-blocks", "64")
    yield proc
    proc.stop()


def test_control_walk_with_a_fixed_seed(server: ServerProcess, setup: FuzzSetup) -> None:
    seed = int(os.environ.get("SIESTA_FUZZ_SEED", FIXED_SEED))
    _walk(server, setup, seed, STEPS)


def test_control_walk_with_a_fresh_seed(server: ServerProcess, setup: FuzzSetup) -> None:
    seed = random.SystemRandom().randrange(1 << 31)
    print(f"control walk seed {seed}")
    _walk(server, setup, seed, STEPS)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def draft_server(request: pytest.FixtureRequest, qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A server that drafts: n-grams, or a draft model (the "old" checkpoint, which keeps
    drafting while updates move the target: its drafts then often fall)."""
    args = ["--speculative-algorithm", request.param]
    if request.param == "draft":
        args += ["--speculative-draft-model-path", qwen3_dir]
    proc = logged_server(qwen3_dir, str(tmp_path_factory.mktemp("logs")), f"control_fuzz_{request.param}", "--num-kv-blocks",
                         "64", *args)  # fmt: skip
    yield proc
    proc.stop()


def test_control_walk_with_drafts(draft_server: ServerProcess, setup: FuzzSetup) -> None:
    seed = int(os.environ.get("SIESTA_FUZZ_SEED", random.SystemRandom().randrange(1 << 31)))
    print(f"control walk with drafts, seed {seed}")
    walk = _walk(draft_server, setup, seed, STEPS)
    with draft_server.client() as http:
        info = http.get("/get_server_info").json()
    assert info["spec_accepted_tokens"] > 0, (seed, walk.judged)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_control_soak_on_a_gpu(qwen3_dir: str, setup: FuzzSetup, tmp_path) -> None:
    """Walks of fresh seeds until SIESTA_SOAK_S seconds have passed, float32 on the GPU (greedy
    ties far apart, so transformers on the CPU stays the reference) with decode and piecewise
    graphs, overlap and poisoned resumes."""
    proc = ServerProcess(qwen3_dir, "--max-model-len", "512", "--device", "cuda", "--num-kv-blocks", "256",
                         "--debug-poison-on-resume", log_path=str(tmp_path / "soak.log"))
    deadline = time.monotonic() + float(os.environ.get("SIESTA_SOAK_S", "300"))
    walks = judged = 0
    try:
        while time.monotonic() < deadline:
            seed = random.SystemRandom().randrange(1 << 31)
            print(f"control walk seed {seed}")
            walks, judged = walks + 1, judged + _walk(proc, setup, seed, STEPS).judged
    finally:
        proc.stop()
    print(f"control soak: {walks} walks, {judged} requests judged, 0 mismatches")
