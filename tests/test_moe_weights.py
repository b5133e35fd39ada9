"""Qwen3-MoE's weights on the CPU: every expert's slice per tensor-parallel rank, from Hugging
Face's per-expert names and from transformers 5's packed ones; bad expert tensors refused before
any byte lands; a piece of the weights region per expert; validation and a whole update at
Qwen3-30B-A3B's tensor count in about the time of their bytes."""

from __future__ import annotations

import time

import pytest
import torch
from oracle import hf_named_parameters
from test_models import build

from engine.config import ModelConfig
from engine.models import get_model_class
from engine.parallel import TensorParallel
from engine.weights.loader import (
    WeightLoadError,
    iterate_checkpoint,
    load_checkpoint,
    load_named_tensors,
    validate_entries,
)
from engine.weights.store import WeightStore
from engine.weights.targets import checkpoint_targets

EXPERTS = "model.layers.0.mlp.experts"


def _build_on(config: ModelConfig, tp: TensorParallel, device: str) -> torch.nn.Module:
    with torch.device(device):
        return get_model_class(config.architecture)(config, tp=tp)


def test_each_rank_holds_a_slice_of_every_expert(qwen3_moe_dir: str) -> None:
    """At TP=2 each rank keeps 16 of every expert's 32 intermediate rows (gate and up rows each,
    down's columns), read as slices of the file, and the same from transformers 5's packed names."""
    config = ModelConfig.from_hf(qwen3_moe_dir)
    full = dict(iterate_checkpoint(qwen3_moe_dir))
    packed = hf_named_parameters(qwen3_moe_dir)
    assert f"{EXPERTS}.gate_up_proj" in dict(packed)
    for rank in (0, 1):
        sl = slice(rank * 16, (rank + 1) * 16)
        tp = TensorParallel(rank, 2)
        got = dict(iterate_checkpoint(qwen3_moe_dir, checkpoint_targets(_build_on(config, tp, "meta"))))
        assert torch.equal(got[f"{EXPERTS}.3.gate_proj.weight"], full[f"{EXPERTS}.3.gate_proj.weight"][sl])
        assert torch.equal(got[f"{EXPERTS}.3.down_proj.weight"], full[f"{EXPERTS}.3.down_proj.weight"][:, sl])
        model = _build_on(config, tp, "cpu")
        load_checkpoint(model, qwen3_moe_dir)
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (8, 32, 64) and experts.down_proj.shape == (8, 64, 16)
        for e in range(8):
            assert torch.equal(experts.gate_up_proj[e, :16], full[f"{EXPERTS}.{e}.gate_proj.weight"][sl])
            assert torch.equal(experts.gate_up_proj[e, 16:], full[f"{EXPERTS}.{e}.up_proj.weight"][sl])
            assert torch.equal(experts.down_proj[e], full[f"{EXPERTS}.{e}.down_proj.weight"][:, sl])
        assert torch.equal(model.model.layers[0].mlp.gate.weight, full["model.layers.0.mlp.gate.weight"])
        loaded = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.data.zero_()
        load_named_tensors(model, packed, require_all=True)  # the packed names cover every expert
        for k, v in model.state_dict().items():
            assert torch.equal(v, loaded[k]), k


def test_bad_expert_tensors_are_refused_atomically(qwen3_moe_dir: str, qwen3_moe_next_dir: str) -> None:
    """Every other tensor of the push is valid and new: a refused push must copy none of them."""
    model = build(qwen3_moe_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = list(iterate_checkpoint(qwen3_moe_next_dir))
    cases = [
        (f"{EXPERTS}.8.up_proj.weight", torch.ones(32, 64), "unexpected"),  # experts 0..7
        (f"{EXPERTS}.2.up_proj.weight", torch.ones(31, 64), "shape"),
        (f"{EXPERTS}.w13_weight", torch.ones(8, 64, 64), "unexpected"),  # vLLM's packed name: not ours
        (f"{EXPERTS}.gate_up_proj", torch.ones(8, 32, 64), "shape"),  # packed, gate rows only
        ("model.layers.1.mlp.experts.0.gate_proj.weight", torch.ones(32, 64), "unexpected"),  # the dense layer
        (f"{EXPERTS}.0.up_proj.weight", torch.ones(32, 64, dtype=torch.int32), "dtype"),
    ]
    for name, bad, message in cases:
        with pytest.raises(WeightLoadError, match=message) as err:
            load_named_tensors(model, [*good, (name, bad)])
        assert name in str(err.value)
    missing = f"{EXPERTS}.5.down_proj.weight"
    with pytest.raises(WeightLoadError, match="missing") as err:
        load_named_tensors(model, [(n, t) for n, t in good if n != missing], require_all=True)
    assert missing in str(err.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def test_weight_store_keeps_a_piece_per_expert(qwen3_moe_dir: str, qwen3_moe_next_dir: str) -> None:
    """The packed experts live in the one allocation, a piece per Hugging Face tensor: after a
    release, an update of one expert is current and every other piece comes back from the host
    copy; a packed name marks every piece it covers."""
    config = ModelConfig.from_hf(qwen3_moe_dir)
    store = WeightStore(_build_on(config, TensorParallel(), "meta"), torch.device("cpu"))
    model = store.model
    load_checkpoint(model, qwen3_moe_dir, store.targets)
    store.keep_host_copy()
    old = {k: v.clone() for k, v in model.state_dict().items()}
    names = [p.name for p in store.pieces if not p.computed]
    assert len(names) == len(set(names)) == len(list(iterate_checkpoint(qwen3_moe_dir)))
    # transformers 5's packed names of a layer lie back to back: their bucket is received in place
    layer = [f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj", "model.layers.0.mlp.gate.weight"]
    assert store.span([store.targets[n].view for n in layer]) is not None

    store.released()
    store.flat.fill_(255)  # what a release loses (NaN)
    name = f"{EXPERTS}.5.up_proj.weight"
    new = dict(iterate_checkpoint(qwen3_moe_next_dir))[name]
    store.written(load_named_tensors(model, [(name, new)], targets=store.targets))
    store.ensure_current()
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[5, 32:], new)
    assert torch.equal(experts.gate_up_proj[5, :32], old[f"{EXPERTS}.gate_up_proj"][5, :32])
    assert torch.equal(experts.gate_up_proj[4], old[f"{EXPERTS}.gate_up_proj"][4])
    assert torch.equal(model.model.norm.weight, old["model.norm.weight"])

    store.released()
    written = load_named_tensors(model, [(f"{EXPERTS}.down_proj", torch.zeros(8, 64, 32))], targets=store.targets)
    assert written == [f"{EXPERTS}.{e}.down_proj.weight" for e in range(8)]
    store.written(written)
    assert not {store.index[n] for n in written} & store.stale and store.stale


def test_validation_scales_with_bytes_not_names() -> None:
    """Qwen3-30B-A3B's 18,867 checkpoint tensors (built on the meta device: no memory) validate in
    well under a second: a few dictionary look-ups per name, nothing quadratic."""
    config = ModelConfig(
        path="/nowhere", architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, max_position_embeddings=40960, tie_word_embeddings=False,
        attention_bias=False, torch_dtype="bfloat16", eos_token_ids=(151645,), num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    )  # fmt: skip
    model = _build_on(config, TensorParallel(), "meta")
    targets = checkpoint_targets(model)
    entries = [(n, t.shape, torch.bfloat16) for n, t in targets.items() if not t.covers]
    assert len(entries) == 18867
    t0 = time.perf_counter()
    validate_entries(model, entries, targets)
    assert time.perf_counter() - t0 < 1.0
    bad = [*entries[:-1], (entries[-1][0], (1, 1), torch.bfloat16)]
    with pytest.raises(WeightLoadError, match="shape"):
        validate_entries(model, bad, targets)


def test_an_update_of_every_expert_scales_with_bytes_not_names() -> None:
    """Qwen3-30B-A3B's tensor count (48 layers of 128 experts) at tiny widths: a push of all 18,867
    per-expert tensors is validated, copied into the weights region and marked current in about
    the time of its bytes (well under a few seconds on two CPU cores)."""
    config = ModelConfig(
        path="/nowhere", architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=32,
        intermediate_size=64, num_layers=48, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False,
        attention_bias=False, torch_dtype="float32", eos_token_ids=(2,), num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=8, norm_topk_prob=True,
    )  # fmt: skip
    store = WeightStore(_build_on(config, TensorParallel(), "meta"), torch.device("cpu"))
    pairs = [(n, torch.full(t.shape, float(i))) for i, (n, t) in enumerate(store.targets.items()) if not t.covers]
    assert len(pairs) == 18867
    store.keep_host_copy()
    store.released()
    t0 = time.perf_counter()
    store.written(load_named_tensors(store.model, pairs, targets=store.targets))
    assert time.perf_counter() - t0 < 3.0
    assert all(store.pieces[i].computed for i in store.stale)  # the rotary table, recomputed
    experts = store.model.model.layers[47].mlp.experts
    last = dict(pairs)
    assert torch.equal(experts.down_proj[127], last["model.layers.47.mlp.experts.127.down_proj.weight"])
