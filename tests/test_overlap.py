"""Overlap scheduling changes no output: the same workload through `EngineCore.step()` with the
overlapped loop (step k+1 scheduled and launched before step k's tokens are read) and with the
plain loop (`disable_overlap_schedule`) gives every request the same tokens, logprobs, top
logprobs, prompt logprobs and finish reason, and stops it at the same token: on EOS, on a stop
token (also under min_new_tokens), on max_new_tokens, on an abort that lands while a step is in
flight; with seeded sampling, penalties (which read the previous tokens on the host), n > 1
samples sharing a prompt, chunked prefill and preemption. On a GPU the same runs in bf16 with
CUDA graphs (`pytest -m gpu`)."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import SamplingParams


@dataclass
class Outcome:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish: str | None = None


def run(core: EngineCore, work: dict[str, tuple[list[int], SamplingParams]], abort_at: dict[str, int]) -> dict[str, Outcome]:
    """Add every request, step until all finish; abort request r once it has received
    abort_at[r] tokens (the client's view: deltas, whatever is in flight)."""
    for rid, (prompt, params) in work.items():
        assert core.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)) is None
    out = {rid: Outcome() for rid in work}
    for _ in range(10_000):
        if not core.has_work():
            break
        deltas = core.step()
        for d in deltas:
            o = out[d.request_id]
            o.ids += d.new_token_ids
            o.logprobs += d.new_logprobs or []
            o.top += [[tuple(p) for p in t] for t in d.new_top_logprobs or []]
            if d.input_logprobs is not None:
                o.input_logprobs = d.input_logprobs
            if d.finished:
                o.finish = d.finish_reason
        late = [rid for rid, k in abort_at.items() if len(out[rid].ids) >= k and out[rid].finish is None]
        for d in core.abort(late):
            out[d.request_id].finish = d.finish_reason
    else:
        raise AssertionError("the engine did not finish the workload")
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return out


def workload(vocab: int, stops: list[int], seed: int = 0) -> dict[str, tuple[list[int], SamplingParams]]:
    """Requests of every kind; `stops` are tokens the plain run produced, to stop on."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    shared = prompt(40)
    greedy = {"temperature": 0.0, "logprobs": True}
    return {
        "greedy-long": (prompt(70), SamplingParams(max_new_tokens=40, ignore_eos=True, top_logprobs_num=3, **greedy)),
        "eos": (prompt(9), SamplingParams(max_new_tokens=40, **greedy)),
        "stop-token": (prompt(23), SamplingParams(max_new_tokens=40, stop_token_ids=tuple(stops[:2]), **greedy)),
        "stop-after-min": (prompt(5), SamplingParams(max_new_tokens=40, min_new_tokens=12, stop_token_ids=tuple(stops), **greedy)),
        "seeded": (prompt(31), SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, top_k=20, seed=7, logprobs=True)),
        "penalties": (prompt(12), SamplingParams(max_new_tokens=25, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=True)),
        "prompt-logprobs": (prompt(18), SamplingParams(max_new_tokens=6, logprob_start_len=0, **greedy)),
        "prefill-only": (prompt(14), SamplingParams(max_new_tokens=0, logprob_start_len=2, logprobs=True)),
        "aborted": (prompt(27), SamplingParams(max_new_tokens=40, ignore_eos=True, **greedy)),
        **{f"n8-{i}": (shared, SamplingParams(max_new_tokens=20, temperature=1.0, seed=100 + i, logprobs=True)) for i in range(8)},
    }


def with_eos(model_dir: str, dest: Path, eos: int) -> str:
    """A copy of the checkpoint whose EOS token is `eos`."""
    shutil.copytree(model_dir, dest)
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    return str(dest)


def compare(model_dir: str, tmp_path: Path, atol: float, **knobs: object) -> int:
    """Run the workload both ways and compare; returns the overlapped run's preemptions."""
    vocab = EngineCore(EngineConfig(model=model_dir, **knobs)).model_config.vocab_size
    probe = workload(vocab, stops=[0])
    plain_probe = run(EngineCore(EngineConfig(model=model_dir, disable_overlap_schedule=True, **knobs)), probe, {})
    # Stop on tokens the greedy runs produce mid-way; EOS is the 5th token of "eos".
    seen = plain_probe["stop-token"].ids
    stops = [seen[7], seen[15], plain_probe["stop-after-min"].ids[3]]
    eos_dir = with_eos(model_dir, tmp_path / "eos", plain_probe["eos"].ids[4])
    work = workload(vocab, stops)
    abort_at = {"aborted": 9}
    plain = run(EngineCore(EngineConfig(model=eos_dir, disable_overlap_schedule=True, **knobs)), work, abort_at)
    overlapped = EngineCore(EngineConfig(model=eos_dir, **knobs))
    overlap = run(overlapped, work, abort_at)
    for rid in work:
        p, o = plain[rid], overlap[rid]
        assert (o.ids, o.finish) == (p.ids, p.finish), rid
        assert o.logprobs == pytest.approx(p.logprobs, abs=atol), rid
        assert [[t for t, _ in row] for row in o.top] == [[t for t, _ in row] for row in p.top], rid
        if p.input_logprobs is not None:
            assert o.input_logprobs is not None
            assert [x is None for x in o.input_logprobs] == [x is None for x in p.input_logprobs]
            assert [x for x in o.input_logprobs if x is not None] == pytest.approx(
                [x for x in p.input_logprobs if x is not None], abs=atol), rid
    # The workload reached every stop it was built for.
    assert plain["eos"].finish == "stop" and len(plain["eos"].ids) == plain_probe["eos"].ids.index(plain_probe["eos"].ids[4]) + 1
    assert plain["stop-token"].finish == "stop" and plain["stop-token"].ids[-1] in stops[:2]
    # min_new_tokens banned the stop token the unconstrained run produced 4th.
    early, late = plain_probe["stop-after-min"].ids, plain["stop-after-min"].ids
    assert late[:3] == early[:3] and late[3] != early[3] and len(late) >= 12
    assert plain["aborted"].finish == "abort" and len(plain["aborted"].ids) == 9
    assert plain["greedy-long"].finish == "length" and len(plain["greedy-long"].ids) == 40
    assert plain["prefill-only"].ids == [] and plain["prefill-only"].input_logprobs
    return overlapped.scheduler.num_preemptions


def test_overlap_changes_no_output_on_cpu(qwen3_dir: str, tmp_path: Path) -> None:
    # A row that finished in step k (EOS, a stop token, an abort) still runs in step k+1 when
    # overlapped, so that step's matmuls have one row more. Whether float32 rounding depends on
    # the row count is the CPU's BLAS kernel's choice: identical on AVX2 machines, ~2e-6 apart on
    # AVX-512 / AMX ones (Sapphire Rapids). Where no row stops early the loops agree bit for bit (the
    # chunked test below groups rows differently for more reasons): logprobs to 1e-5, tokens
    # and top-logprob ids exactly.
    compare(qwen3_dir, tmp_path, atol=1e-5, device="cpu", dtype="float32")


def test_overlap_changes_no_output_with_chunks_and_preemption(qwen3_dir: str, tmp_path: Path) -> None:
    # A 24-token budget chunks every long prompt; 30 blocks of 8 tokens cannot hold the whole
    # workload at once, so requests are preempted (some with a token in flight) and recomputed.
    # Steps then group rows differently in the two loops (a row that finished in step k still
    # runs in step k+1 when overlapped), and a matmul's float32 rounding depends on its rows:
    # logprobs agree to 1e-5, tokens exactly.
    preemptions = compare(qwen3_dir, tmp_path, atol=1e-5, device="cpu", dtype="float32", block_size=8,
                          num_kv_blocks=30, max_num_batched_tokens=24)
    assert preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlap_changes_no_output_on_gpu(qwen3_dir: str, tmp_path: Path, dtype: str) -> None:
    compare(qwen3_dir, tmp_path, atol=1e-5 if dtype == "float32" else 2e-2, device="cuda", dtype=dtype,
            num_kv_blocks=256, max_num_seqs=32, cuda_graph_max_bs=32, max_model_len=256)
