"""Tensor parallelism on two GPUs (`pytest -m gpu` on nvidia-h200-x2): two ranks with CUDA graphs (the
all-reduces captured in them) against one rank, a mixture of experts sliced or whole per rank;
memory released and resumed on both GPUs (reclaim and residual per GPU, measured device-wide from
this process); 20 cycles with traffic and identical outputs; a weight update; a killed rank (a dead
NCCL peer never answers: the watchdog must end the engine); `--deterministic` at two ranks (the
ordered all-reduce inside the graphs). `SIESTA_TP_REPORT=FILE` writes the measured numbers as JSON."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import pytest
import torch
from oracle import hf_greedy

from engine import Engine, EngineDeadError, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

MIB = 1 << 20
PROMPTS = [[5, 9, 13, 200, 7], [7] * 20, list(range(30, 90))]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=True)
# The prompt scored too: its logprobs and top alternatives from the vocabulary-parallel logits.
SCORED = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, logprob_start_len=0, top_logprobs_num=3)
KNOBS: dict[str, Any] = dict(device="cuda", max_model_len=512, max_num_seqs=32, cuda_graph_max_bs=16)
REPORT: dict[str, Any] = {}


def _report(key: str, value: Any) -> None:
    REPORT[key] = value
    path = os.environ.get("SIESTA_TP_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=2)


def _generate(llm: Engine) -> list[tuple[list[int], list[float]]]:
    outs = []
    for p in PROMPTS:  # one at a time after a flush: every run schedules alike
        llm.flush_cache()
        o = llm.generate(input_ids=[p], sampling_params=GREEDY)[0]
        outs.append((o.output_ids, [lp for lp, _ in o.output_token_logprobs]))
    return outs


def _used() -> list[int]:
    """Device-wide used bytes of GPUs 0 and 1."""
    out = []
    for d in (0, 1):
        free, total = torch.cuda.mem_get_info(d)
        out.append(total - free)
    return out


def test_two_ranks_fp32_equal_one_rank_and_transformers_with_graphs(qwen3_dir: str) -> None:
    expected = hf_greedy(qwen3_dir, PROMPTS, GREEDY.max_new_tokens)
    runs, scored = {}, {}
    for tp in (1, 2):
        with Engine(model=qwen3_dir, dtype="float32", tp_size=tp, **KNOBS) as llm:
            assert llm.info["cuda_graph_batch_sizes"], "decode graphs were captured"
            runs[tp] = _generate(llm)
            scored[tp] = llm.generate(input_ids=PROMPTS, sampling_params=SCORED)
    assert [ids for ids, _ in runs[1]] == expected
    assert [ids for ids, _ in runs[2]] == expected
    for (_, a), (_, b) in zip(runs[1], runs[2], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3
    for one, two in zip(scored[1], scored[2], strict=True):
        assert one.input_top_logprobs[0] is None and two.input_top_logprobs[0] is None
        for (lp1, _), (lp2, _), top1, top2 in zip(one.input_token_logprobs[1:], two.input_token_logprobs[1:],
                                                  one.input_top_logprobs[1:], two.input_top_logprobs[1:], strict=True):
            assert abs(lp1 - lp2) < 1e-3 and top1[0][0] == top2[0][0]
            assert max(abs(v1 - v2) for (_, v1), (_, v2) in zip(top1, top2, strict=True)) < 1e-3


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "whole"])
def test_a_mixture_of_experts_on_two_ranks_with_graphs(qwen3_moe_dir: str, expert_parallel: bool) -> None:
    """Qwen3-MoE in fp32 at TP=2 through the fused kernels, every expert sliced or half of them
    whole per rank (another rank's pairs the extra bucket): transformers' greedy tokens, and one
    rank's logprobs within 1e-3."""
    expected = hf_greedy(qwen3_moe_dir, PROMPTS, GREEDY.max_new_tokens)
    runs = {}
    for tp in (1, 2):
        with Engine(model=qwen3_moe_dir, dtype="float32", tp_size=tp, enable_expert_parallel=expert_parallel,
                    **KNOBS) as llm:  # fmt: skip
            assert llm.info["cuda_graph_batch_sizes"], "decode graphs were captured"
            assert llm.info["ep_size"] == (2 if expert_parallel and tp == 2 else 1)
            runs[tp] = _generate(llm)
    assert [ids for ids, _ in runs[1]] == [ids for ids, _ in runs[2]] == expected
    for (_, a), (_, b) in zip(runs[1], runs[2], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3


def test_two_ranks_bf16_within_rounding_of_one_rank(qwen3_bf16_dir: str) -> None:
    runs = {}
    for tp in (1, 2):
        with Engine(model=qwen3_bf16_dir, dtype="bfloat16", tp_size=tp, **KNOBS) as llm:
            runs[tp] = _generate(llm)
    agree = []
    for (ids1, lp1), (ids2, lp2) in zip(runs[1], runs[2], strict=True):
        n = next((i for i, (a, b) in enumerate(zip(ids1, ids2, strict=True)) if a != b), len(ids1))
        agree.append(n)
        # Up to the first token where the two reduction orders pick differently, logprobs agree
        # to bf16 rounding.
        assert n >= 8, (ids1, ids2)
        assert max(abs(x - y) for x, y in zip(lp1[:n], lp2[:n], strict=True)) < 0.15
    _report("bf16_tokens_agreeing", agree)


_NCCL_PROBE = """
import sys, torch, torch.distributed as dist
rank = int(sys.argv[1]); torch.cuda.set_device(rank); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
dist.init_process_group("nccl", init_method=sys.argv[2], rank=rank, world_size=2, device_id=torch.device("cuda", rank))
x = torch.ones(64, 1024, device="cuda", dtype=torch.bfloat16)
dist.all_reduce(x); g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    dist.all_reduce(x)
g.replay(); torch.cuda.synchronize(); del g, x; torch.cuda.empty_cache()
print(free0 - torch.cuda.mem_get_info()[0]); dist.destroy_process_group()
"""


def _nccl_share() -> list[int]:
    """Device bytes NCCL keeps per GPU for a two-rank communicator used in and out of graphs:
    measured in two fresh processes, their CUDA contexts excluded."""
    import subprocess
    import sys

    from server_util import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", _NCCL_PROBE, str(r), init], stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    return [int(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]


_FUSED_PROBE = """
import json, sys, torch, torch.distributed as dist
from engine.kernels.fused_ops import fused_add_rms_norm
from engine.kernels.tp_reduce import TpReduce
from engine.parallel import TensorParallel
rank = int(sys.argv[1]); dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
dist.init_process_group("nccl", init_method=sys.argv[2], rank=rank, world_size=2, device_id=dev)
tp, hidden, found = TensorParallel(rank, 2), 1024, {}
mine, shared = torch.Generator(device=dev).manual_seed(rank), torch.Generator(device=dev).manual_seed(7)
def inputs(rows, dtype):
    x = torch.randn(rows, hidden, device=dev, generator=mine).to(dtype)  # each rank's partial
    res = torch.randn(rows, hidden, device=dev, generator=shared).to(dtype)  # the same on both
    return x, res, (1 + torch.rand(hidden, device=dev, generator=shared)).to(dtype)
def unfused(x, res, w):
    total = x.clone(); dist.all_reduce(total)
    return fused_add_rms_norm(total, res, w, 1e-6)
for dtype in (torch.bfloat16, torch.float32):
    red, bad, other = TpReduce(tp, dev, dtype, hidden, 64), 0, 0
    for rows in [1, 5, 64, 1, 17, 64, 3, 2] * 40:  # eager: row counts vary, so do epochs per row
        x, res, w = inputs(rows, dtype)
        a_res, b_res = res.clone(), res.clone()
        a = red.add_rms_norm(x, a_res, w, 1e-6)[0]
        b = unfused(x, b_res, w)[0]
        bad += not (torch.equal(a, b) and torch.equal(a_res, b_res))
        peer = [torch.empty_like(a) for _ in range(2)]; dist.all_gather(peer, a)
        other += not torch.equal(peer[0], peer[1])
    x, res0, w = inputs(8, dtype); res = res0.clone()
    graph = torch.cuda.CUDAGraph()
    red.add_rms_norm(x, res.clone(), w, 1e-6); torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # 50 chained calls: each one's residual feeds the next
        for _ in range(50):
            out = red.add_rms_norm(x, res, w, 1e-6)[0]
    replays = 0
    for i in range(20):
        fresh, res_new, _ = inputs(8, dtype)
        x.copy_(fresh); res.copy_(res_new); graph.replay()
        want_res = res_new.clone()
        for _ in range(50):
            want = unfused(x, want_res, w)[0]
        replays += torch.equal(out, want) and torch.equal(res, want_res)
    found[str(dtype)] = {"eager_mismatches": bad, "ranks_differ": other, "graph_replays_equal": replays}
print(json.dumps(found)); dist.destroy_process_group()
"""


def test_fused_all_reduce_norm_equals_nccl_then_norm() -> None:
    """engine/kernels/tp_reduce.py against NCCL's all-reduce then the fused add + norm kernel: the
    same bits, on both ranks, for varying row counts (eager) and for 50 chained calls in a CUDA
    graph replayed with new inputs (the slots and epochs of the push protocol stay in step)."""
    import subprocess
    import sys

    from server_util import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", _FUSED_PROBE, str(r), init], stdout=subprocess.PIPE, text=True,
                              cwd=root) for r in (0, 1)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    for found in results:
        for dtype, r in found.items():
            assert r == {"eager_mismatches": 0, "ranks_differ": 0, "graph_replays_equal": 20}, (dtype, results)


def test_release_resume_reclaim_and_residual_per_gpu(qwen3_bf16_dir: str) -> None:
    """Reclaim per GPU: the device bytes a release frees over the bytes of that rank's regions;
    residual: what the engine still holds on a GPU after releasing everything. At TP=2 it may
    exceed TP=1's by NCCL's own buffers (NCCL 2.28 cannot suspend a communicator) and 64 MiB."""
    measured: dict[str, Any] = {"nccl_share_mib": [b / MIB for b in _nccl_share()]}
    for tp in (1, 2):
        base = _used()
        # 8 GiB of KV at TP=1, 4 GiB per rank at TP=2 (each holds one of the two KV heads).
        with Engine(model=qwen3_bf16_dir, dtype="bfloat16", tp_size=tp, num_kv_blocks=1 << 20, **KNOBS) as llm:
            before = _generate(llm)
            occupation = llm.memory_occupation()
            per_rank = occupation.get("ranks") or [occupation]
            regions = [sum(t["bytes"] for t in r["tags"].values()) for r in per_rank]
            loaded = _used()
            llm.release_memory_occupation()
            time.sleep(0.5)
            released = _used()
            llm.resume_memory_occupation()
            assert _generate(llm) == before
            measured[f"tp{tp}"] = [
                {"gpu": d, "regions_mib": regions[d] / MIB, "freed_mib": (loaded[d] - released[d]) / MIB,
                 "reclaim": (loaded[d] - released[d]) / regions[d], "residual_mib": (released[d] - base[d]) / MIB}
                for d in range(tp)
            ]
    _report("reclaim", measured)
    one = measured["tp1"][0]
    for g, nccl in zip(measured["tp2"], measured["nccl_share_mib"], strict=True):
        assert g["reclaim"] >= 0.995, measured
        assert g["residual_mib"] <= one["residual_mib"] + nccl + 64, measured


def test_twenty_cycles_with_traffic_on_two_ranks(qwen3_bf16_dir: str) -> None:
    with Engine(model=qwen3_bf16_dir, dtype="bfloat16", tp_size=2, mem_fraction=0.3, **KNOBS) as llm:
        first = _generate(llm)
        for cycle in range(20):
            tags = [["kv_cache"], ["weights"], None, ["cuda_graph", "kv_cache"]][cycle % 4]
            llm.release_memory_occupation(tags)
            llm.resume_memory_occupation()
            assert _generate(llm) == first, cycle


def test_weight_update_from_disk_on_two_ranks(qwen3_dir: str, qwen3_next_dir: str) -> None:
    expected = hf_greedy(qwen3_next_dir, PROMPTS, GREEDY.max_new_tokens)
    with Engine(model=qwen3_dir, dtype="float32", tp_size=2, **KNOBS) as llm:
        old = _generate(llm)
        llm.update_weights_from_disk(qwen3_next_dir)
        assert [ids for ids, _ in _generate(llm)] == expected  # the graphs replay the new weights
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert [ids for ids, _ in _generate(llm)] == expected
        llm.update_weights_from_disk(qwen3_dir)
        assert _generate(llm) == old


def test_a_killed_rank_ends_the_engine(qwen3_bf16_dir: str) -> None:
    with Engine(model=qwen3_bf16_dir, dtype="bfloat16", tp_size=2, **KNOBS) as llm:
        os.kill(llm.info["tp_worker_pids"][0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(100):
                llm.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        took = time.monotonic() - t0
        _report("killed_rank_seconds_to_error", took)
        assert took < 15


@pytest.mark.parametrize("checkpoint", ["qwen3_dir", "wide_qwen3_dir"])
def test_deterministic_two_ranks_reduce_in_rank_order(checkpoint: str, request: pytest.FixtureRequest) -> None:
    """`--deterministic` at tp_size 2 on CUDA, decode and piecewise graphs on: the ranks' partial
    sums meet in rank order (TensorParallel.ordered: NCCL all-gather, then p0 + p1), so a request
    alone and among companions, before and after it, gives the same tokens and logprobs bit for
    bit (tests/test_deterministic.py's check)."""
    from test_deterministic import KNOBS as DET
    from test_deterministic import _alone_and_among

    path = request.getfixturevalue(checkpoint)
    with Engine(model=path, dtype="bfloat16", device="cuda", max_num_batched_tokens=24, tp_size=2, **DET) as llm:
        _alone_and_among(llm, random.Random("tp2"), 12)
