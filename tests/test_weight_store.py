"""The weights region as one allocation (engine/weights/store.py), on a CPU: every parameter and
buffer is a view into it, and after a release (simulated: the bytes are wiped, as lost pages
are) nothing stale is ever read: what an update wrote stays, the rest comes back from the host
copy, and with no host copy the store counts what is missing. The GPU tests run the same rules
through real releases (tests/test_gpu_memory.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from engine.config import ModelConfig
from engine.models import get_model_class
from engine.weights.loader import (
    iterate_checkpoint,
    load_checkpoint,
    load_named_tensors,
)
from engine.weights.store import ALIGN, WeightStore, merge_spans
from engine.weights.targets import checkpoint_targets


def cpu_store(path: str, host_copy: bool = True) -> WeightStore:
    """The checkpoint at `path` loaded into a WeightStore on the CPU (with its host copy, unless not)."""
    config = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    store = WeightStore(model.eval(), torch.device("cpu"))
    store.written(load_checkpoint(model, path))
    if host_copy:
        store.keep_host_copy()
    return store


def _state(store: WeightStore) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (the rotary cache too), copied."""
    model = store.model
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _release(store: WeightStore) -> None:
    """What a real release does to the bytes: the store is told, then the pages' content is lost."""
    store.released()
    store.flat.fill_(0xFF)  # NaN in every float dtype


def _assert_state(store: WeightStore, want: dict[str, torch.Tensor]) -> None:
    got = _state(store)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def _new_values(store: WeightStore, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    targets = checkpoint_targets(store.model)
    gen = torch.Generator().manual_seed(7)
    return [(n, torch.randn(targets[n].shape, generator=gen).to(targets[n].view.dtype)) for n in names]


def test_every_parameter_and_buffer_is_a_view_of_one_allocation(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir)
    base, end = store.flat.data_ptr(), store.flat.data_ptr() + store.flat.numel()
    tensors = [*store.model.parameters(), *store.model.buffers()]
    assert len(tensors) > 10
    for t in tensors:
        assert base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
        assert (t.data_ptr() - base) % ALIGN == 0
    # The pieces tile every byte the model holds: q/k/v rows of one packed parameter are three.
    assert sum(p.nbytes for p in store.pieces) == sum(t.numel() * t.element_size() for t in tensors)
    names = {p.name for p in store.pieces}
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.rotary_emb.cos_sin_cache" in names
    assert merge_spans(store.pieces) == [(0, store.nbytes)]


def test_resume_restores_everything_from_the_host_copy_at_first_use(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir)
    want = _state(store)
    _release(store)
    assert store.stale_bytes == store.nbytes - _padding(store) and store.missing() == 0
    store.ensure_current()
    _assert_state(store, want)
    assert store.last_restore["bytes"] == store.nbytes - _padding(store)
    store.ensure_current()  # nothing stale: a no-op
    assert store.stale_bytes == 0


def test_a_full_update_after_resume_restores_only_the_computed_buffers(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir)
    rotary = dict(store.model.named_buffers())["model.rotary_emb.cos_sin_cache"].clone()
    _release(store)
    pairs = _new_values(store, list(checkpoint_targets(store.model)))
    store.written(load_named_tensors(store.model, pairs, require_all=True))
    assert store.stale_bytes == rotary.numel() * rotary.element_size()
    store.ensure_current()
    assert store.last_restore["bytes"] == rotary.numel() * rotary.element_size()
    want = dict(pairs)
    for name, target in checkpoint_targets(store.model).items():
        assert torch.equal(target.view, want[name]), name
    assert torch.equal(dict(store.model.named_buffers())["model.rotary_emb.cos_sin_cache"], rotary)


def test_a_partial_update_keeps_its_tensors_and_restores_the_others(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir)
    before = _state(store)
    _release(store)
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    pairs = _new_values(store, names)
    store.written(load_named_tensors(store.model, pairs))
    store.ensure_current()
    targets = checkpoint_targets(store.model)
    for name, tensor in pairs:
        assert torch.equal(targets[name].view, tensor)
    # Everything else, the q and v rows packed beside k included, is the old weights.
    q_rows = targets["model.layers.0.self_attn.q_proj.weight"].rows
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(store.model.model.layers[0].self_attn.qkv_proj.weight[q_rows], before[qkv][q_rows])
    assert torch.equal(store.model.model.layers[0].mlp.down_proj.weight, before["model.layers.0.mlp.down_proj.weight"])

    # The host copy took the update: another release brings the new k back, not the old one.
    want = _state(store)
    _release(store)
    store.ensure_current()
    _assert_state(store, want)


def test_without_a_host_copy_stale_tensors_are_missing_until_updated(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir, host_copy=False)
    want = _state(store)
    _release(store)
    total = len(checkpoint_targets(store.model))
    assert store.missing() == total
    with pytest.raises(RuntimeError, match="without a host copy"):
        store.ensure_current()
    names = list(checkpoint_targets(store.model))
    store.written(load_named_tensors(store.model, list(iterate_checkpoint(qwen3_dir))[:3]))
    assert store.missing() == total - 3
    store.written(load_checkpoint(store.model, qwen3_dir))
    assert store.missing() == 0 and len(names) == total
    store.ensure_current()  # the rotary cache is recomputed
    _assert_state(store, want)


def test_a_write_that_failed_half_way_comes_back_as_the_old_weights(qwen3_dir: str) -> None:
    store = cpu_store(qwen3_dir)
    want = _state(store)
    name = "model.layers.1.self_attn.o_proj.weight"
    checkpoint_targets(store.model)[name].view.fill_(3.0)  # a broadcast cut off after these bytes
    store.invalidate([name])
    store.ensure_current()
    _assert_state(store, want)


def _padding(store: WeightStore) -> int:
    return store.nbytes - sum(p.nbytes for p in store.pieces)


def _cut_off_trainer(port: int, path: str, sent: int) -> None:
    """Rank 0 of a gloo weight-update group that broadcasts only the first `sent` tensors of a
    full update of `path` (each doubled), then dies with the rest still expected."""
    from engine.weights.groups import broadcast_from_trainer, trainer_group

    handle = trainer_group("127.0.0.1", port, 2, "cut", "gloo", timeout_s=120)
    pairs = [(n, t * 2) for n, t in iterate_checkpoint(path)]
    broadcast_from_trainer(handle, pairs[:sent])
    os._exit(0)  # no goodbye: the engine's next receive finds the peer gone


def test_a_broadcast_cut_off_half_way_leaves_the_old_weights(qwen3_dir: str) -> None:
    from engine.config import EngineConfig
    from engine.weights.updater import WeightUpdater

    store = cpu_store(qwen3_dir)
    want = _state(store)
    updater = WeightUpdater(store, EngineConfig(model=qwen3_dir, device="cpu"))
    port = _free_port()
    proc = mp.get_context("spawn").Process(target=_cut_off_trainer, args=(port, qwen3_dir, 3))
    proc.start()
    try:
        # The trainer is a spawned interpreter importing torch: on a loaded machine it listens
        # tens of seconds later. The bound only caps a hang; the cut itself fails at once.
        updater.groups.init("127.0.0.1", port, 1, 2, "cut", "gloo", torch.device("cpu"), timeout_s=120)
        entries = list(iterate_checkpoint(qwen3_dir))
        names = [n for n, _ in entries]
        with pytest.raises(Exception):  # noqa: B017 - gloo's error type for a vanished peer varies
            updater.from_distributed("cut", names, ["float32"] * len(names), [list(t.shape) for _, t in entries])
        # The first three tensors landed in the parameters before the cut: stale now, restored.
        assert store.stale and store.missing() == 0
        store.ensure_current()
        _assert_state(store, want)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_host_copy_refreshes_when_asked_or_at_the_latest_before_a_release(qwen3_dir: str) -> None:
    """An update's answer does not wait for the host copy: `written` only marks, the engine calls
    `refresh_host` after the reply, and a release refreshes whatever is still pending first."""
    store = cpu_store(qwen3_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    piece = store.pieces[store.index[name]]
    old = store.host[piece.offset : piece.offset + piece.nbytes].clone()
    store.written(load_named_tensors(store.model, _new_values(store, [name])))
    assert torch.equal(store.host[piece.offset : piece.offset + piece.nbytes], old)  # not yet
    store.refresh_host()
    new = store.flat[piece.offset : piece.offset + piece.nbytes]
    assert torch.equal(store.host[piece.offset : piece.offset + piece.nbytes], new) and not torch.equal(new, old)

    other = "model.layers.1.self_attn.o_proj.weight"
    store.written(load_named_tensors(store.model, _new_values(store, [other])))
    want = _state(store)
    _release(store)  # no refresh_host in between: the release does it before the bytes go
    store.ensure_current()
    _assert_state(store, want)


def test_a_checkpoint_in_model_order_lies_back_to_back(qwen3_aligned_dir: str, qwen3_dir: str) -> None:
    """The weights are laid out in Hugging Face's parameter order, computed buffers after them:
    a trainer's flattened bucket in that order is one span of the allocation (received in place);
    in any other order, or with tensors not a multiple of 256 bytes (padding between), it is not."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3_aligned_dir, dtype=torch.float32)
    names = [n for n, _ in hf.named_parameters()]
    store = cpu_store(qwen3_aligned_dir)
    views = [store.targets[n].view for n in names]
    total = sum(v.numel() * v.element_size() for v in views)
    assert store.span(views) == slice(0, total)
    assert store.span(views[1:3]) == slice(views[1].data_ptr() - store.flat.data_ptr(), views[3].data_ptr() - store.flat.data_ptr())
    assert store.span(views[::-1]) is None and store.span([views[0], views[2]]) is None
    unaligned = cpu_store(qwen3_dir)
    hf3 = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    assert unaligned.span([unaligned.targets[n].view for n, _ in hf3.named_parameters() if n in unaligned.targets]) is None
