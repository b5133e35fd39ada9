"""What a decode graph reads from and writes to pinned host memory itself (engine/runner/graph_io.py),
on a GPU (`pytest -m gpu`): the gather kernel turns a staged step into the static inputs (pending
tokens, padding rows, block tables longer than one read), the sampler publishes each row's
(token, logprob) into the replay's result slot and advances the replay count, and engines whose
decode steps run from graphs give what eager engines give when requests join, leave, sample,
ask for top logprobs or for penalties between graph steps."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _io(max_bs: int = 8, max_blocks: int = 200, max_rows: int = 12, max_pieces: int = 0):
    from engine.runner.graph_io import GraphIO

    dev = torch.device("cuda")
    inputs = torch.zeros(2, max_bs, dtype=torch.int64, device=dev)
    lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
    tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
    slots = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
    return GraphIO(inputs, lens, tables, slots, max_rows, max_pieces)


def _parts(rng: random.Random, n: int, pending: dict[int, int], block_size: int = 16) -> list[list[int]]:
    lens = [rng.randint(1, 3000) for _ in range(n)]
    tables = [[rng.randrange(1, 10_000) for _ in range(-(-n_tok // block_size))] for n_tok in lens]
    width = max(map(len, tables))
    flat = [b for t in tables for b in t + [0] * (width - len(t))]
    ids = [-1 if i in pending else rng.randrange(0, 1000) for i in range(n)]
    slots = [t[(n_tok - 1) // block_size] * block_size + (n_tok - 1) % block_size for t, n_tok in zip(tables, lens, strict=True)]
    rows = sorted(pending)
    return [ids, [n_tok - 1 for n_tok in lens], list(range(n)), rows, [pending[r] for r in rows], slots,
            list(range(n + 1)), lens, flat]  # fmt: skip


def test_gather_stages_a_step_into_the_static_inputs() -> None:
    io = _io()
    rng = random.Random(0)
    io.tokens[:12] = torch.arange(100, 112, device="cuda")
    # pending rows from other rows, from their own row (the gather's guess), none; both slots twice
    for n, bs, pending in [(5, 8, {1: 7, 4: 0}), (8, 8, {0: 11}), (3, 4, {}), (6, 8, {2: 2, 3: 5, 5: 5})]:
        parts = _parts(rng, n, pending)
        temps = [rng.choice([1.0, 0.7, 1.3]) for _ in range(n)]
        slot = io.stage_step(parts, temps, n, bs)
        io.gather(bs)
        io.replayed(slot)
        torch.cuda.synchronize()
        assert io.counters[1].item() == io.counters[0].item()  # the replay's number, for the sampler
        io.counters[0] += 1  # what the graph's sampler does at its end
        ids, positions, _, rows, sources, slots, _, lens, flat = parts
        want_ids = [100 + pending[i] if i in pending else ids[i] for i in range(n)] + [0] * (bs - n)
        assert io.inputs[0, :bs].tolist() == want_ids
        assert io.inputs[1, :bs].tolist() == positions + [0] * (bs - n)
        assert io.slot_mapping[:bs].tolist() == slots + [-1] * (bs - n)
        assert io.seq_lens[:bs].tolist() == lens + [0] * (bs - n)
        assert io.temps[:bs].tolist() == pytest.approx(temps + [1.0] * (bs - n), rel=1e-7)
        width = len(flat) // n  # every row's table, padded with block 0 to the widest; > 64 entries
        assert io.block_tables[:n, :width].flatten().tolist() == flat


def test_the_sampler_publishes_to_the_replays_slot_and_counts_replays() -> None:
    from engine.kernels.lse_argmax import lse_argmax

    io = _io()
    torch.manual_seed(0)
    for replay in range(3):
        io.counters[1] = replay  # what the graph's gather does at its start
        logits = torch.randn(6, 1000, device="cuda", dtype=torch.bfloat16) * 4
        io.temps[:6] = torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 1.0], device="cuda")
        io.sample(logits)
        torch.cuda.synchronize()
        lse, tokens, pairs = lse_argmax(logits, io.temps[:6].clone())
        assert io.counters[0].item() == replay + 1 and io.counters[1].item() == replay
        assert io.results[replay % 2, :6].tolist() == pairs.cpu().tolist()
        assert io.tokens[:6].tolist() == tokens.tolist()
        assert torch.equal(io.lse[:6], lse)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
def test_the_logits_pieces_merge_to_the_samplers_answer(rows: int) -> None:
    """A decode graph's logits of up to 64 rows also write the sampler's pieces (logits_linear:
    one running piece a row and program, its tiles interleaved across programs) and the sampler
    only merges them (lse_argmax.merge_pieces): the same tokens, lse and published pairs as
    lse_argmax on the logits the same kernel wrote, ties broken toward the first column across
    tiles and programs, the replay count advanced."""
    from engine.kernels.logits_linear import logits_linear, pieces
    from engine.kernels.lse_argmax import lse_argmax

    vocab, hidden = 50000, 256  # 782 tiles of 64 columns: every program of an H100/H200 takes several
    count = pieces(vocab, torch.device("cuda"))
    io = _io(max_bs=64, max_rows=64, max_pieces=rows * count)
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    w[7] = torch.where(x[0] > 0, 0.1, -0.1).to(torch.bfloat16)  # row 0's maximum, in three tiles
    w[vocab // 2] = w[vocab - 1] = w[7]
    w[64 * count + 5] = w[7]  # and in this tile, the next one of program 0 (tile 0's)
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")
    for replay in range(2):
        io.counters[1] = replay  # what the graph's gather does at its start
        temps = torch.rand(rows, device="cuda", generator=g) + 0.25  # replay 0: greedy rows, no division
        temps[0] = 1.0
        temps = temps if replay else torch.ones_like(temps)
        io.temps[:rows] = temps
        logits_linear(x, w, logits, io.lse_pieces(rows, count))
        io.sample(logits, count)
        torch.cuda.synchronize()
        lse, tokens, pairs = lse_argmax(logits, temps.clone())
        assert tokens[0].item() == 7
        assert io.tokens[:rows].tolist() == tokens.tolist() == (logits.float() / temps[:, None]).argmax(-1).tolist()
        torch.testing.assert_close(io.lse[:rows], lse, rtol=1e-6, atol=1e-6)
        assert io.counters[0].item() == replay + 1 and io.counters[1].item() == replay
        published = io.results[replay % 2, :rows]
        assert published[:, 0].tolist() == tokens.double().tolist()
        ulps = 1e-6 * lse.abs().max().item() + 1e-6  # the lse's fp32 sums in another order
        torch.testing.assert_close(published[:, 1], pairs[:, 1].cpu(), rtol=0, atol=ulps)
        torch.testing.assert_close(logits.float(), x.float() @ w.float().T, rtol=1e-2, atol=2e-2)  # the logits still written
    with pytest.raises(ValueError, match="sampler pieces"):
        io.lse_pieces(rows, count + 1)
    temps, *parts = io.lse_pieces(rows, count)
    with pytest.raises(ValueError, match="pieces"):  # a program's pieces short
        logits_linear(x, w, logits, (temps, *(t[:, 1:].contiguous() for t in parts)))


GRAPH_MAX_BS = 16


def _core(model_dir: str, graphs: bool, **knobs: object) -> EngineCore:
    knobs = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 64,
             "cuda_graph_max_bs": GRAPH_MAX_BS, "max_model_len": 512, "disable_cuda_graph": not graphs} | knobs
    return EngineCore(EngineConfig(model=model_dir, **knobs))


def _serve(core: EngineCore, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[str, tuple]:
    """Requests (step of arrival, prompt, params), run to the end: {id: (tokens, logprobs, tops)}."""
    out: dict[str, tuple[list, list, list]] = {}
    step = 0
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    while pending or core.has_work():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            out[str(i)] = ([], [], [])
            assert core.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params)) is None
        for d in core.step():
            ids, lps, tops = out[d.request_id]
            ids += d.new_token_ids
            lps += d.new_logprobs or []
            tops += d.new_top_logprobs or []
        step += 1
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return out


def _arrivals(seed: int, kind: str) -> list[tuple[int, list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(20):
        n = rng.randint(2, 20)
        if kind == "greedy":
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
        elif kind == "sampled":
            params = SamplingParams(max_new_tokens=n, temperature=rng.choice([1.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                                    seed=i if i % 2 else None, ignore_eos=True, logprobs=True)  # fmt: skip
        elif kind == "top":
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True,
                                    top_logprobs_num=3 if i % 3 == 0 else 0)  # fmt: skip
        else:  # penalties
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True,
                                    repetition_penalty=1.3 if i % 2 else 1.0, presence_penalty=0.5 if i % 3 == 0 else 0.0)  # fmt: skip
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(3, 40))]
        out.append((rng.randint(0, 25), prompt, params))
    return out


@pytest.mark.parametrize("kind", ["greedy", "sampled", "top", "penalties"])
def test_graph_steps_equal_eager_steps_as_requests_join_and_leave(qwen3_dir: str, kind: str) -> None:
    """Requests arrive over 25 steps and stop after 2..20 tokens, so graph decode steps alternate
    with eager mixed steps, rows change places (pending tokens from other rows) and graphs pad.
    In float32 the two engines' logits agree to ~1e-6, so every token equals and logprobs agree."""
    graphs = _core(qwen3_dir, graphs=True)
    eager = _core(qwen3_dir, graphs=False)
    replays = [0]
    run = graphs.runner.graphs.run

    def counted(plan):
        replays[0] += 1
        return run(plan)

    graphs.runner.graphs.run = counted
    got, want = _serve(graphs, _arrivals(1, kind)), _serve(eager, _arrivals(1, kind))
    assert replays[0] > 20
    for rid in want:
        assert got[rid][0] == want[rid][0], f"request {rid}"
        assert got[rid][1] == pytest.approx(want[rid][1], abs=1e-4)
        assert len(got[rid][2]) == len(want[rid][2])
        for a, b in zip(got[rid][2], want[rid][2], strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)
