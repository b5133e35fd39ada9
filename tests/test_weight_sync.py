"""Weight-update wire formats and process groups, with real processes on a CPU.

- update_weights_from_tensor: a trainer process (spawned, or started with no multiprocessing
  relation at all) serializes CPU tensors into shared memory; this process decodes them.
- flattened buckets: ours (aligned, mixed dtypes), SGLang's packing (back to back, so offsets can
  be misaligned), and the old one-dtype format with element offsets.
- weight-update groups: a spawned trainer is rank 0 of a gloo group, this process rank 1.
"""

from __future__ import annotations

import base64
import contextlib
import multiprocessing as mp
import pickle
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine.weights.groups import WeightUpdateGroups, broadcast_from_trainer, trainer_group
from engine.weights.payload import (
    FlattenedTensorMetadata,
    decode_update,
    deserialize_named_tensors,
    flatten_bucket,
    serialize_payload,
    unflatten_bucket,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    """Deterministic tensors of several dtypes and shapes (odd byte counts included)."""
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(7, generator=g)),
        ("lm_head.weight", torch.randn(3, 4, generator=g).to(torch.float16)),
        ("step", torch.arange(3, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
    ]


def _assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def _join(proc: mp.Process, timeout_s: float) -> None:
    """Poll waitpid rather than `proc.join(timeout)`: that waits on the process sentinel, which a
    torch_shm_manager daemon started by the child inherits and keeps open for seconds."""
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- update_weights_from_tensor ------------------------------------------------------------


def _sender(queue: mp.Queue, stop: mp.Event, bucket: bool) -> None:
    pairs = _tensors()
    payload = serialize_payload(flatten_bucket(pairs)) if bucket else serialize_payload(pairs)
    queue.put(payload)
    stop.wait(180)  # the tensors must outlive the receiver's rebuild


@pytest.mark.parametrize("load_format", [None, "direct", "flattened_bucket"])
def test_tensors_cross_processes_through_shared_memory(load_format: str | None) -> None:
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_sender, args=(queue, stop, load_format == "flattened_bucket"))
    proc.start()
    try:
        payload = queue.get(timeout=120)  # a spawned child imports torch: slow on a loaded machine
        assert isinstance(payload, str) and len(payload) < 4096  # handles, not data
        pairs = decode_update([payload], load_format)
        _assert_same(pairs, _tensors())
        assert all(t.is_shared() for _, t in pairs)
    finally:
        stop.set()
        _join(proc, 60)
    assert proc.exitcode == 0


_UNRELATED_SENDER = """
import sys, torch
sys.path.insert(0, {root!r})
from engine.weights.payload import serialize_named_tensors
pairs = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
print(serialize_named_tensors(pairs), flush=True)
sys.stdin.readline()
"""


def test_tensors_cross_unrelated_processes() -> None:
    """file_system sharing needs no multiprocessing kinship (file_descriptor would need its
    authkey): the sender here is a plain subprocess."""
    import engine

    root = str(__import__("pathlib").Path(engine.__file__).parents[1])
    proc = subprocess.Popen([sys.executable, "-c", _UNRELATED_SENDER.format(root=root)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        payload = proc.stdout.readline().strip()
        (name, tensor), = deserialize_named_tensors(payload)
        assert name == "w" and torch.equal(tensor, torch.arange(6.0).reshape(2, 3))
        assert tensor.is_shared()
    finally:
        proc.communicate("done\n", timeout=10)
    assert proc.returncode == 0


def test_flattened_bucket_mixed_dtypes_round_trip() -> None:
    pairs = _tensors()
    bucket = flatten_bucket(pairs)
    flat = bucket["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert all(m.start_idx % 16 == 0 and m.numel == m.end_idx - m.start_idx for m in bucket["metadata"])
    got = unflatten_bucket(bucket)
    _assert_same(got, pairs)
    for _, t in got:  # views into the flat tensor, not copies
        assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    _assert_same(decode_update([serialize_payload(bucket)], "flattened_bucket"), pairs)


def test_sglang_packed_and_old_one_dtype_buckets() -> None:
    pairs = _tensors()
    # SGLang: bytes back to back (bf16 of 10 bytes, then float32 at offset 10: misaligned).
    parts, metadata, offset = [], [], 0
    for name, t in pairs:
        b = t.reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + b.numel(), b.numel()))
        parts.append(b)
        offset += b.numel()
    _assert_same(unflatten_bucket({"flattened_tensor": torch.cat(parts), "metadata": metadata}), pairs)
    # Old SGLang: one dtype per bucket, offsets in elements.
    a, b = torch.randn(2, 3), torch.randn(4)
    old = {"flattened_tensor": torch.cat([a.reshape(-1), b]), "metadata": [
        FlattenedTensorMetadata("a", a.shape, a.dtype, 0, 6, 6),
        FlattenedTensorMetadata("b", b.shape, b.dtype, 6, 10, 4),
    ]}
    _assert_same(unflatten_bucket(old), [("a", a), ("b", b)])


def test_metadata_pickled_under_sglang_module_path() -> None:
    """slime's payload names sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata."""
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket"]
    module = types.ModuleType(names[-1])
    cls = type("FlattenedTensorMetadata", (), {"__module__": module.__name__})
    module.FlattenedTensorMetadata = cls
    sys.modules.update({n: types.ModuleType(n) for n in names[:-1]} | {names[-1]: module})
    try:
        meta = cls()
        meta.__dict__.update(name="x", shape=torch.Size([2]), dtype=torch.float32, start_idx=0, end_idx=8, numel=8)
        payload = serialize_payload({"flattened_tensor": torch.ones(2).view(torch.uint8), "metadata": [meta]})
    finally:
        for n in names:
            del sys.modules[n]
    (name, tensor), = decode_update([payload], "flattened_bucket")
    assert name == "x" and torch.equal(tensor, torch.ones(2))


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


@pytest.mark.parametrize(
    "payload",
    [
        "not base64 !!",
        base64.b64encode(b"definitely not a pickle").decode(),
        serialize_payload({"a": torch.ones(1)}),  # not a list
        serialize_payload([("a", 3)]),  # not a tensor
        serialize_payload([(1, torch.ones(1))]),  # name not a str
        base64.b64encode(pickle.dumps([("a", _Evil())])).decode(),  # a global outside the allow list
        12,
    ],
)
def test_malformed_payloads_are_value_errors(payload: object) -> None:
    with pytest.raises(ValueError):
        decode_update([payload], None)


def test_bad_requests_are_value_errors() -> None:
    good = serialize_payload(_tensors())
    with pytest.raises(ValueError, match="flattened_bucket"):
        decode_update([good], "safetensors")
    with pytest.raises(ValueError, match="tp rank"):  # two payloads name ranks 0 and 1 only
        decode_update([good, good], None, tp_rank=2)
    with pytest.raises(ValueError, match="tp rank"):
        decode_update([], None)
    # One payload serves every rank (each slices the full tensors in it).
    assert [n for n, _ in decode_update([good], None, tp_rank=1)] == [n for n, _ in _tensors()]
    with pytest.raises(ValueError):  # a list of pairs is not a bucket
        decode_update([good], "flattened_bucket")
    bucket = flatten_bucket(_tensors())
    bucket["metadata"][0].end_idx += 2
    with pytest.raises(ValueError, match="does not fit"):
        unflatten_bucket(bucket)
    with pytest.raises(ValueError):
        flatten_bucket([])


# ---- weight-update groups ------------------------------------------------------------------


def _trainer(port: int, stop: mp.Event) -> None:
    handle = trainer_group("127.0.0.1", port, 2, "policy", "gloo", timeout_s=120)
    broadcast_from_trainer(handle, _tensors()[:3])
    stop.wait(120)


@contextlib.contextmanager
def _joined(trainer: Callable[[int, Any], None], group_name: str) -> Iterator[tuple[WeightUpdateGroups, int, Any]]:
    """A spawned trainer process running `trainer(port, stop)` as rank 0 of a gloo group of two,
    this process's groups joined to it as rank 1; the trainer is told to stop and joined after."""
    port = _free_port()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=trainer, args=(port, stop))
    proc.start()
    groups = WeightUpdateGroups()
    try:
        groups.init("127.0.0.1", port, 1, 2, group_name, "gloo", torch.device("cpu"), timeout_s=120)
        yield groups, port, proc
    finally:
        stop.set()
        _join(proc, 60)


def test_group_receives_what_the_trainer_broadcasts() -> None:
    with _joined(_trainer, "policy") as (groups, port, proc):
        with pytest.raises(ValueError, match="already exists"):
            groups.init("127.0.0.1", port, 1, 2, "policy", "gloo", torch.device("cpu"))
        want = _tensors()[:3]
        with pytest.raises(ValueError, match="differ in length"):
            groups.receive("policy", [n for n, _ in want], ["bfloat16"], [[5, 3]])
        with pytest.raises(ValueError, match="unknown dtype"):
            groups.receive("policy", ["a"], ["bfloat17"], [[1]])
        got = groups.receive(
            "policy",
            [n for n, _ in want],
            ["torch.bfloat16", "float32", "float16"],
            [list(t.shape) for _, t in want],
        )
        _assert_same(got, want)
        groups.destroy("policy")
        assert groups.names() == []
    assert proc.exitcode == 0
    with pytest.raises(ValueError, match="unknown weight update group"):
        groups.receive("policy", [], [], [])
    with pytest.raises(ValueError, match="unknown weight update group"):
        groups.destroy("policy")


def _ring_trainer(port: int, stop: mp.Event) -> None:
    handle = trainer_group("127.0.0.1", port, 2, "ring", "gloo", timeout_s=120)
    broadcast_from_trainer(handle, _ring_tensors())
    stop.wait(120)


def _ring_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(f"t{i}", torch.randn(n, generator=gen)) for i, n in enumerate([5, 64, 3, 40, 64, 1])]


def test_landed_callbacks_let_two_slots_carry_every_tensor() -> None:
    """The updater's scratch slots (engine/weights/group_updates.py): six broadcasts through two
    slots, each tensor copied out by its `landed` callback before a later broadcast reuses its slot."""
    with _joined(_ring_trainer, "ring") as (groups, _, proc):
        want = _ring_tensors()
        slots = [torch.full((64,), float("nan")) for _ in range(2)]
        buffers = [slots[i % 2][: t.numel()] for i, (_, t) in enumerate(want)]
        out = [torch.zeros_like(t) for _, t in want]
        order: list[int] = []

        def land(i: int) -> None:
            order.append(i)
            out[i].copy_(buffers[i])

        groups.receive_into("ring", buffers, {i: (lambda i=i: land(i)) for i in range(len(want))})
        assert order == list(range(len(want)))
        _assert_same(list(zip([n for n, _ in want], out, strict=True)), want)
        groups.destroy("ring")
    assert proc.exitcode == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=1, rank_offset=1), "world_size"),
        (dict(world_size=2, rank_offset=0), "rank_offset"),
        (dict(world_size=2, rank_offset=2), "rank_offset"),
        (dict(backend="mpi"), "backend"),
        (dict(backend="nccl"), "CUDA"),
        (dict(group_name=""), "group_name"),
    ],
)
def test_group_arguments_are_checked(kwargs: dict, match: str) -> None:
    args = dict(master_address="127.0.0.1", master_port=_free_port(), rank_offset=1, world_size=2,
                group_name="g", backend="gloo", device=torch.device("cpu"), timeout_s=1)
    with pytest.raises(ValueError, match=match):
        WeightUpdateGroups().init(**{**args, **kwargs})


def test_trainer_that_never_joins_times_out() -> None:
    groups = WeightUpdateGroups()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="could not join"):
        groups.init("127.0.0.1", _free_port(), 1, 2, "g", "gloo", torch.device("cpu"), timeout_s=3)
    assert time.monotonic() - start < 10
    assert groups.names() == []
