"""vLLM's NCCL weight-transfer rendezvous, the part a CPU can run (engine/weights/vllm_nccl.py):
the engine joins a store built as vLLM's `StatelessProcessGroup.create` builds it and reads the
NCCL unique id that `PyNcclCommunicator` publishes there (tests/vllm_trainer.py mirrors vLLM's
trainer). The communicator itself needs GPUs: tests/test_gpu_vllm_api.py."""

from __future__ import annotations

import os
import pickle
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from server_util import free_port
from vllm_trainer import pickled_unique_id, stateless_store

from engine.weights.groups import WeightUpdateGroups
from engine.weights.vllm_nccl import read_unique_id, unique_id_of

RAW = bytes(range(128))  # an NCCL id's 128 opaque bytes


def test_the_engine_reads_the_trainers_unique_id_from_a_stateless_store() -> None:
    port = free_port()
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(read_unique_id("127.0.0.1", port, 3, timedelta(seconds=60))))
    other = threading.Thread(target=lambda: got.append(read_unique_id("127.0.0.1", port, 3, timedelta(seconds=60))))
    reader.start()
    other.start()  # a second rank (tensor parallel) reads the same key
    store = stateless_store("127.0.0.1", port, 3, timeout_s=60)  # returns once both clients joined
    store.set("broadcast_from/0/0", pickled_unique_id(RAW))
    reader.join(60)
    other.join(60)
    assert [uid for _, uid in got] == [RAW, RAW]


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_naming_anything_but_the_id_struct_is_refused_before_it_runs(tmp_path) -> None:
    evil = _Evil()
    evil.path = tmp_path / "ran"
    for raw in (pickle.dumps(evil), pickle.dumps({"internal": RAW}), b"not a pickle"):
        with pytest.raises(ValueError, match="ncclUniqueId"):
            unique_id_of(raw)
    assert not evil.path.exists()
    # SGLang's PyNccl pickles the same struct under its own module: accepted.
    assert unique_id_of(pickled_unique_id(RAW, "sglang.srt.distributed.device_communicators.pynccl_wrapper")) == RAW
    assert unique_id_of(pickled_unique_id(RAW)) == RAW


def test_the_vllm_wire_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="'vllm_nccl' needs a CUDA device"):
        WeightUpdateGroups().init("127.0.0.1", free_port(), 1, 2, "g", "vllm_nccl", torch.device("cpu"), timeout_s=1)
