"""The one-kernel-per-layer decode (engine/decode/fused_decode.py, layer_kernel.py) on a GPU
(`pytest -m gpu` on the device machine), on tiny checkpoints of the shapes it serves (hidden a
multiple of 128, head_dim 64), bf16, Triton attention, a random KV cache:

- for Qwen3 (q/k norm, tied embeddings), Llama (llama3 rope scaling) and Qwen2 (q/k/v bias),
  decode steps of 1, 3, 8 and 16 rows with contexts across blocks and splits: the hidden states
  and the new K/V rows equal the layer-by-layer forward's within bf16 rounding (layer 0's K/V
  rows bit for bit), and no other cache row changes;
- graph padding (rows of seq_len 0, slot -1) writes nothing and leaves the real rows' results;
- the per-(row, KV head) split counters (the last split merges): 0 after every step, and zeroed
  after a resume;
- the Lamport buffers act and o_part (no barrier between gate_up and down_proj, o_proj and the
  norm after it): back to their sentinel after a resume, and a gate_up output of -0.0 stored as
  +0.0 (else down_proj would wait forever);
- captured in a CUDA graph, replays equal the eager call for new inputs;
- through the engine: greedy decoding with it gives the tokens and logprobs of the engine
  without it (`--no-fused-decode`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace

import pytest
import torch
from conftest import TINY, _randomized, _save
from test_piecewise_graph import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    load_model,
    make_step,
    random_cache,
    written,
)
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.attention import ForwardContext
from engine.core.engine_core import EngineCore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# intermediate 512: every K a multiple of 256, the GEMVs' 256-wide K steps (Qwen2's 384: 128-wide)
SHAPE = TINY | dict(hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=1024)
# bf16 hidden states after a few layers: split-K and half-dim dot orders move some elements an ULP.
TOLERANCE = 3e-2


def _checkpoint(arch: str, path: str, **shape: object) -> str:
    if arch == "qwen3":
        config = Qwen3Config(**(SHAPE | dict(num_attention_heads=4, num_key_value_heads=2) | shape), num_hidden_layers=3, tie_word_embeddings=True)
        return _save(_randomized(Qwen3ForCausalLM, config, seed=11), path)
    if arch == "qwen2":
        config = Qwen2Config(**(SHAPE | dict(intermediate_size=384)), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)
        return _save(_randomized(Qwen2ForCausalLM, config, seed=12), path)
    config = LlamaConfig(
        **(SHAPE | dict(num_attention_heads=8, num_key_value_heads=2) | shape), num_hidden_layers=2,
        rope_scaling={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )  # fmt: skip
    return _save(_randomized(LlamaForCausalLM, config, seed=13), path)


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from engine.decode.fused_decode import FusedDecode, unsupported

    model, backend = tiny_model(request.param, tmp_path_factory)
    assert unsupported(model, backend) is None
    return model, backend, FusedDecode(model, backend, 16)


def tiny_model(arch: str, tmp_path_factory: pytest.TempPathFactory, max_num_seqs: int = MAX_NUM_SEQS,
               backend_cls: type | None = None, **shape: object):  # fmt: skip
    """(bf16 model of `_checkpoint(arch, **shape)` on CUDA, a `backend_cls` (default: the Triton
    backend) over a random KV cache)."""
    from engine.attention.triton import TritonBackend

    model = load_model(_checkpoint(arch, str(tmp_path_factory.mktemp(arch)), **shape), torch.bfloat16, "cuda")
    c = model.config
    backend = (backend_cls or TritonBackend)(random_cache(model, torch.bfloat16, "cuda"), scale=c.head_dim**-0.5,
                                             num_heads=c.num_heads, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)  # fmt: skip
    return model, backend


@contextmanager
def model_path(model, path) -> Iterator[None]:
    """The decoder model's whole-step decode path set to `path` inside (engine/models/hooks.py)."""
    model.model.use_decode_paths([path], None)
    try:
        yield
    finally:
        model.model.use_decode_paths([], None)


def has_path(cls: type) -> Callable[[EngineCore], bool]:
    """Whether an engine attached a decode path of class `cls`."""
    return lambda core: any(isinstance(p, cls) for p in core.runner.decode_paths)


def _decode_step(rows: int, seed: int, vocab: int):
    rng = random.Random(seed)
    # contexts across blocks and split boundaries, within the cache's 255 free blocks
    return make_step([(rng.randint(1, min(700, 3600 // rows)), 1) for _ in range(rows)], "cuda", vocab, seed)


def with_and_without(model, backend, step, path_on: Callable[[], AbstractContextManager]):
    """(hidden, cache after) of the layer-by-layer forward and of the forward inside `path_on()`
    (a decode path set), from the same cache."""
    cache0 = backend.kv_cache.clone()
    ctx = ForwardContext(backend, step.meta)
    with torch.inference_mode():
        plain = model(step.input_ids, step.positions, ctx)
        plain_cache = backend.kv_cache.clone()
        backend.kv_cache.copy_(cache0)
        with path_on():
            out = model(step.input_ids, step.positions, ctx)
        torch.cuda.synchronize()
    return plain, plain_cache, out, backend.kv_cache.clone(), cache0


def matches_the_layers(model, backend, step, path_on: Callable[[], AbstractContextManager]):
    """The step with the decode path on: hidden states and new K/V rows within TOLERANCE of the
    layer-by-layer forward's, no other cache row written. Returns layer 0's new K/V rows (path's,
    layers'), [2, n, Hkv, D] each, for the caller's own check."""
    plain, plain_cache, out, cache, cache0 = with_and_without(model, backend, step, path_on)
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert rel_err(out, plain) < TOLERANCE
    new_plain, rest_plain = written(plain_cache, step.slots)
    new_path, rest_path = written(cache, step.slots)
    assert rel_err(new_path, new_plain) < TOLERANCE
    assert torch.equal(rest_path, written(cache0, step.slots)[1])
    assert torch.equal(rest_plain, rest_path)
    return new_path[0], new_plain[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_fused_decode_equals_the_layers(setup, rows: int) -> None:
    model, backend, fused = setup
    step = _decode_step(rows, seed=rows, vocab=model.config.vocab_size)
    assert fused.applies(step.input_ids, ForwardContext(backend, step.meta))
    new_fused, new_plain = matches_the_layers(model, backend, step, lambda: model_path(model, fused))
    # Layer 0's new K/V come before any attention: the same bits. Later layers' follow hidden
    # states that the split-KV partition (its own, per row count) moves within rounding.
    assert torch.equal(new_fused, new_plain)


def padding_rows_write_nothing(model, backend, path, rows: int) -> None:
    """A step of `rows` real rows plus as many graph-padding rows (seq_len 0, slot -1) through the
    decode path `path`: padding writes no cache row and the real rows' outputs stay (within
    rounding: the doubled step splits the KV into fewer parts)."""
    step = _decode_step(rows, seed=5, vocab=model.config.vocab_size)
    meta = step.meta

    def pad(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])

    padded = replace(meta, seq_lens=pad(meta.seq_lens, 0), block_tables=pad(meta.block_tables, 0),
                     slot_mapping=pad(meta.slot_mapping, -1), query_start_loc=torch.arange(2 * rows + 1, dtype=torch.int32, device="cuda"),
                     query_start_loc_cpu=list(range(2 * rows + 1)), seq_lens_cpu=meta.seq_lens_cpu + [0] * rows)  # fmt: skip
    cache0 = backend.kv_cache.clone()
    with torch.inference_mode():
        real = path.forward(step.input_ids, step.positions, ForwardContext(backend, meta)).clone()
        backend.kv_cache.copy_(cache0)
        out = path.forward(pad(step.input_ids, 0), pad(step.positions, 0), ForwardContext(backend, padded))
    assert torch.isfinite(out).all()
    assert (out[:rows].float() - real.float()).abs().max().item() <= TOLERANCE * real.float().abs().max().item()
    assert torch.equal(written(backend.kv_cache, step.slots)[1], written(cache0, step.slots)[1])


def test_padding_rows_write_nothing_and_leave_the_real_rows(setup) -> None:
    model, backend, fused = setup
    padding_rows_write_nothing(model, backend, fused, 4)


def garbage_is_cleared_by_after_resume(
    model, backend, path, rows: int, seed: int, plant: Callable[[], object], cleared: Callable[[], bool]
) -> None:
    """State a decode path keeps from one step to the next, reset by `path.after_resume`: three
    steps in a row give the same output; garbage put in by `plant` (a resumed `cuda_graph` region
    comes back with undefined contents) leaves `cleared()` true after `after_resume`, and the
    step then equals the first again. The caller checks the state the last step left."""
    step = _decode_step(rows, seed=seed, vocab=model.config.vocab_size)
    ctx = ForwardContext(backend, step.meta)
    cache0 = backend.kv_cache.clone()
    with torch.inference_mode():
        first = path.forward(step.input_ids, step.positions, ctx).clone()
        for _ in range(2):
            backend.kv_cache.copy_(cache0)
            assert torch.equal(path.forward(step.input_ids, step.positions, ctx), first)
        plant()
        path.after_resume()
        assert cleared()
        backend.kv_cache.copy_(cache0)
        again = path.forward(step.input_ids, step.positions, ctx)
        torch.cuda.synchronize()
    assert torch.equal(again, first)


def barrier_garbage_is_cleared_by_after_resume(model, backend, path, rows: int) -> None:
    """The persistent kernels' grid-barrier counter is not reset between steps (an odd number of
    barriers between them included), and every barrier leaves its low bits 0. A counter handed
    back as garbage would hang the barrier or let programs run ahead (nonzero low bits):
    `after_resume` zeroes it."""
    garbage_is_cleared_by_after_resume(
        model, backend, path, rows, 31, lambda: path.barrier.fill_(0x1234567), lambda: path.barrier.item() == 0
    )
    assert path.barrier.item() & 0x7FFFFFFF == 0


def test_barrier_is_kept_across_steps_and_zeroed_after_a_resume(setup) -> None:
    model, backend, fused = setup
    barrier_garbage_is_cleared_by_after_resume(model, backend, fused, 1)


def test_split_counters_end_each_step_at_zero_and_are_zeroed_after_a_resume(setup) -> None:
    """The last split of each (row, KV head) to end merges the splits and zeroes its counter, so
    after a step every counter is 0. Counters left at garbage would skip merges, and o_proj would
    read a stale attention output (ao, garbage too): `after_resume` zeroes them."""
    model, backend, fused = setup
    for rows in (1, 3):
        garbage_is_cleared_by_after_resume(
            model, backend, fused, rows, 61 + rows, lambda: (fused.counts.fill_(5), fused.ao.normal_()),
            lambda: int(fused.counts.abs().sum()) == 0,
        )  # fmt: skip
        assert int(fused.counts.abs().sum()) == 0


def _minus_zeros(t: torch.Tensor) -> torch.Tensor:
    """Where t holds -0.0, the Lamport sentinel (engine/kernels/lamport.py)."""
    bits = torch.int16 if t.element_size() == 2 else torch.int32
    return t.view(bits) == torch.iinfo(bits).min


@pytest.mark.parametrize("buffer", ["act", "o_part"])
def test_lamport_buffers_get_their_sentinel_back_and_after_a_resume(setup, buffer: str) -> None:
    """act (gate_up -> down_proj) and o_part (o_proj -> the norm after it) are Lamport buffers
    (engine/kernels/lamport.py): their consumer waits until its slice holds no -0.0, with no grid
    barrier after the producer. Garbage in one would be read as data: `after_resume` turns it
    back into sentinels. After a step the buffer holds exactly the last layer's values in the
    step's rows: each layer puts the sentinel back at its start."""
    model, backend, fused = setup
    t = getattr(fused, buffer)
    per_row = t.shape[1] if buffer == "act" else fused.ks_o * t.shape[2]
    for rows in (1, 3):
        garbage_is_cleared_by_after_resume(model, backend, fused, rows, 41 + rows, t.normal_, lambda: bool(_minus_zeros(t).all()))
        assert int((~_minus_zeros(t)).sum()) == rows * per_row


def test_a_zero_product_is_stored_as_plus_zero(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A layer whose first gate rows are zero: silu(0) * up is -0.0 wherever up < 0, the Lamport
    sentinel. The producer stores +0.0 instead, so down_proj's items do not wait for a value that
    was already written (they would spin forever), and the step equals the layers."""
    from engine.decode.fused_decode import FusedDecode

    model, backend = tiny_model("qwen3", tmp_path_factory)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_up_proj.weight[:64].zero_()  # gate rows: up's start at intermediate_size
    fused = FusedDecode(model, backend, 4)
    for rows in (1, 4):
        step = _decode_step(rows, seed=50 + rows, vocab=model.config.vocab_size)
        matches_the_layers(model, backend, step, lambda: model_path(model, fused))
        assert not _minus_zeros(fused.act[:rows]).any()
        assert (fused.act[:rows, :64] == 0).all()


def graph_replays_equal_eager(model, backend, path, rows: int, max_context: int) -> None:
    """The decode path `path` captured in a CUDA graph for `rows` rows: replays on new inputs
    equal the eager call, outputs and cache, bit for bit."""
    vocab = model.config.vocab_size
    static = _decode_step(rows, seed=20, vocab=vocab)
    width = static.meta.block_tables.shape[1]
    max_context = min(max_context, int(static.meta.seq_lens.max()) - 1)  # the new steps' tables fit the captured width
    ctx = ForwardContext(backend, static.meta)
    with torch.inference_mode():
        path.forward(static.input_ids, static.positions, ctx)  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = path.forward(static.input_ids, static.positions, ctx)
        for seed in (21, 22):
            rng = random.Random(seed)
            step = make_step([(rng.randint(1, max_context), 1) for _ in range(rows)], "cuda", vocab, seed)
            cache0 = backend.kv_cache.clone()
            want = path.forward(step.input_ids, step.positions, ForwardContext(backend, step.meta)).clone()
            want_cache = backend.kv_cache.clone()
            backend.kv_cache.copy_(cache0)
            static.input_ids.copy_(step.input_ids)
            static.positions.copy_(step.positions)
            static.meta.seq_lens.copy_(step.meta.seq_lens)
            static.meta.slot_mapping.copy_(step.meta.slot_mapping)
            static.meta.block_tables.zero_()
            cols = min(width, step.meta.block_tables.shape[1])
            static.meta.block_tables[:, :cols] = step.meta.block_tables[:, :cols]
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            assert torch.equal(backend.kv_cache, want_cache)


def test_graph_replays_equal_the_eager_call(setup) -> None:
    model, backend, fused = setup
    graph_replays_equal_eager(model, backend, fused, 2, 60)


def engine_same_with_and_without(path: str, switch: str, attached: Callable[[EngineCore], bool],
                                 prompts: list[list[int]], **knobs: object) -> None:  # fmt: skip
    """Greedy decoding of `prompts` through the engine with the EngineConfig switch `switch` on
    and off gives the same tokens, logprobs within 0.05; `attached(core)` says whether the path
    it switches was attached."""
    from test_gpu_engine import _core, _greedy

    results = {}
    for flag in ("1", "0"):
        core = _core(path, **({"max_model_len": 1024} | knobs), **{switch: flag == "1"})
        assert attached(core) == (flag == "1")
        results[flag] = _greedy(core, prompts, 24)
        del core
        torch.cuda.empty_cache()
    (ids_on, lps_on), (ids_off, lps_off) = results["1"], results["0"]
    assert ids_on == ids_off
    for a, b in zip(lps_on, lps_off, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.05


def test_engine_decodes_the_same_with_and_without_it(tmp_path) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(6)]
    from engine.decode.fused_decode import FusedDecode

    engine_same_with_and_without(_checkpoint("qwen3", str(tmp_path / "qwen3")), "fused_decode", has_path(FusedDecode), prompts)


def test_long_context_steps_leave_it_for_the_split_kv_kernels(tmp_path) -> None:
    """Steps of its few rows whose rows hold >= LONG_KV_TOKENS context tokens run the batch
    decode's kernels instead (engine/decode/rules.py): each size of its rows has a second,
    long-context graph, and greedy decoding of a long prompt beside a short one gives the tokens
    and logprobs of the engine without the fused kernel."""
    from test_gpu_engine import _core, _greedy

    from engine.decode.fused_decode import FusedDecode
    from engine.decode.rules import LONG_KV_TOKENS

    class Counted:  # a graph whose replays are counted
        def __init__(self, graph: torch.cuda.CUDAGraph, counts: dict[str, int], kind: str) -> None:
            self.graph, self.counts, self.kind = graph, counts, kind

        def replay(self) -> None:
            self.counts[self.kind] += 1
            self.graph.replay()

    path = _checkpoint("qwen3", str(tmp_path / "qwen3"), max_position_embeddings=2 * LONG_KV_TOKENS)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(LONG_KV_TOKENS + 40)], [rng.randrange(3, 500) for _ in range(30)]]
    core = _core(path, max_model_len=LONG_KV_TOKENS + 256, num_kv_blocks=2 * LONG_KV_TOKENS // 16)
    fused = next(p for p in core.runner.decode_paths if isinstance(p, FusedDecode))
    graphs = core.runner.graphs
    assert graphs is not None and sorted(graphs.long_graphs) == [bs for bs in graphs.batch_sizes if bs <= fused.max_rows]
    counts = {"short": 0, "long": 0}
    graphs.graphs = {bs: Counted(g, counts, "short") for bs, g in graphs.graphs.items()}
    graphs.long_graphs = {bs: Counted(g, counts, "long") for bs, g in graphs.long_graphs.items()}
    _greedy(core, prompts[1:], 8)
    assert counts["long"] == 0 and counts["short"] > 0, counts
    _greedy(core, prompts, 8)
    assert counts["long"] >= 7, counts
    del core, graphs
    torch.cuda.empty_cache()
    engine_same_with_and_without(path, "fused_decode", has_path(FusedDecode), prompts, max_model_len=LONG_KV_TOKENS + 256,
                                 num_kv_blocks=2 * LONG_KV_TOKENS // 16)
