"""Weight-update process groups: SGLang's `init_weights_update_group`,
`update_weights_from_distributed` and `destroy_weights_update_group`.

Rules:
- A group is a NEW process group of `world_size` ranks whose rank 0 is the trainer; this engine
  (tensor parallel size 1) is rank `rank_offset`. The default process group is never touched, so
  several groups, by name, coexist.
- Rendezvous: the trainer hosts a TCPStore at (master_address, master_port); every rank reaches
  the backend through PrefixStore(group_name) / PrefixStore(f"{group_name}/") /
  PrefixStore("cpu/" for gloo, "cuda/" for nccl). That is the key layout of
  `init_custom_process_group` (torch's `_new_process_group_helper`), which SGLang, verl, slime and
  OpenRLHF use on both sides, so a real trainer and this engine find each other; here it is built
  from public constructors (TCPStore, PrefixStore, ProcessGroupGloo / ProcessGroupNCCL).
- Every wait (store connection, backend rendezvous, each broadcast) is bounded by `timeout_s`: a
  trainer that never joins costs the engine at most that long, then an error.
- update: the trainer broadcasts each tensor from rank 0 in the order of (names, dtypes, shapes),
  which arrive over HTTP first, and every receiver joins each broadcast; or, with load_format
  "flattened_bucket" (SGLang's), one uint8 tensor holding their bytes back to back. Everything
  is validated before the first broadcast is joined.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "vllm_nccl")  # vllm_nccl: vLLM's wire (engine/weights/vllm_nccl.py)
POLL_S = 5e-5  # how often the host looks whether a broadcast has arrived


@dataclass
class _Group:
    backend: Any  # ProcessGroupGloo or ProcessGroupNCCL (a c10d Backend)
    store: dist.Store  # kept alive with the group
    rank: int
    world_size: int
    device: torch.device
    timeout: timedelta


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """ "bfloat16", "torch.bfloat16" or a torch.dtype -> torch.dtype; anything else: ValueError."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"unknown dtype {dtype!r}; expected a torch dtype name such as 'bfloat16'")


def check_meta(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[torch.dtype]:
    """The parsed dtypes of an update's (names, dtypes, shapes), after checking that the three
    lists agree in length and every shape is a list of non-negative ints; else ValueError."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    parsed = [parse_dtype(d) for d in dtypes]
    for name, shape in zip(names, shapes, strict=True):
        if not (isinstance(shape, (list, tuple)) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise ValueError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
    return parsed


def _connect(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    backend: str, device: torch.device, timeout: timedelta,
) -> _Group:
    """Join (rank 0: host) the store, then build the backend under the shared key layout; or
    join a vLLM trainer's communicator (engine/weights/vllm_nccl.py)."""
    if backend == "vllm_nccl":
        from engine.weights import vllm_nccl

        comm, store = vllm_nccl.connect(master_address, master_port, rank, world_size, device, timeout)
        return _Group(comm, store, rank, world_size, device, timeout)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
        multi_tenant=rank == 0,  # every rank counts itself in; rank 0 waits for all
    )
    prefix = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefix), rank, world_size, options)
    return _Group(pg, store, rank, world_size, device, timeout)


def _check_common(world_size: int, backend: str, device: torch.device) -> None:
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be at least 2 (the trainer and this engine), got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend != "gloo" and torch.device(device).type != "cuda":
        raise ValueError(f"backend {backend!r} needs a CUDA device, got {device}")


def _broadcast(
    group: _Group, tensors: list[torch.Tensor], landed: dict[int, Callable[[], None]] | None = None
) -> list[Any]:
    """Rank 0 sends, the others receive, each tensor in order; returns once all have arrived (with
    the finished works: see `WeightUpdateGroups.drop_finished`), or raises once the timeout has
    passed. `landed[i]`, where given, runs once tensor i is there for the current stream: it is
    called after broadcast i + 1 is launched (so its work on the current stream overlaps that
    broadcast), and a later broadcast into tensor i's buffer waits for it (a collective's stream
    waits for the current stream at its launch).

    NCCL: one communicator runs its collectives in order on one stream, so the current stream
    waits for the last, and an event after it is polled every POLL_S (a `wait(timeout)` per
    work sleeps in 1 ms steps: up to 1 ms late at the end). The last work's own bounded wait then
    raises what NCCL reported (an aborted or timed-out communicator). Gloo: each work's wait."""
    cuda = group.device.type == "cuda"
    landed = landed or {}
    works: list[Any] = []
    pending: int | None = None

    def land(i: int) -> None:
        works[i].wait() if cuda else works[i].wait(group.timeout)  # CUDA: the current stream waits
        landed[i]()

    for i, t in enumerate(tensors):
        works.append(group.backend.broadcast([t], dist.BroadcastOptions()))  # root 0
        if pending is not None:
            land(pending)
        pending = i if i in landed else None
    if pending is not None:
        land(pending)
    if not works:
        return works
    if cuda:
        works[-1].wait()  # the current stream waits; the host does not
        arrived = torch.cuda.Event()
        arrived.record(torch.cuda.current_stream(group.device))
        deadline = time.monotonic() + group.timeout.total_seconds()
        while not arrived.query() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        works[-1].wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))  # what is left of it
        return works
    for work in works:
        work.wait(group.timeout)
    return works


class WeightUpdateGroups:
    """The engine's weight-update groups, by name."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._finished: list[Any] = []  # the last receive's works, freed after its answer

    def drop_finished(self) -> None:
        """Free the last receive's finished works. Freeing 399 NCCL works (their CUDA events)
        took ~1.8 ms of a per-tensor update's answer on an H200, so it waits for the answer."""
        self._finished = []

    def names(self) -> list[str]:
        return list(self._groups)

    def init(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str, device: torch.device, timeout_s: float = 60,
    ) -> None:
        """Join group `group_name` as rank `rank_offset`; returns once every rank has joined."""
        _check_common(world_size, backend, device)
        if not isinstance(rank_offset, int) or not 0 < rank_offset < world_size:
            raise ValueError(
                f"rank_offset must be in [1, {world_size - 1}] (rank 0 is the trainer), got {rank_offset}"
            )
        if not isinstance(group_name, str) or not group_name:
            raise ValueError("group_name must be a non-empty string")
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} already exists; destroy it first")
        if not 0 < master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {master_port}")
        timeout = timedelta(seconds=timeout_s)
        try:
            group = _connect(master_address, master_port, rank_offset, world_size, group_name,
                             backend, torch.device(device), timeout)
        except Exception as e:  # DistStoreError, gloo/nccl rendezvous errors: all mean "not joined"
            raise TimeoutError(
                f"weight update group {group_name!r}: could not join {master_address}:{master_port} "
                f"as rank {rank_offset} of {world_size} within {timeout_s} s: {e}"
            ) from e
        self._groups[group_name] = group

    def _get(self, group_name: str) -> _Group:
        if group_name not in self._groups:
            known = ", ".join(map(repr, self._groups)) or "none"
            raise ValueError(f"unknown weight update group {group_name!r} (known: {known})")
        return self._groups[group_name]

    def receive(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
        device: torch.device | None = None, into: list[torch.Tensor | None] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive len(names) tensors broadcast by the trainer (rank 0), in order: into
        `into[i]` where given (contiguous, of that shape and dtype), else a new tensor."""
        group = self._get(group_name)
        parsed = check_meta(names, dtypes, shapes)
        device = group.device if device is None else torch.device(device)
        into = into if into is not None else [None] * len(names)
        tensors = [
            dst if dst is not None else torch.empty(list(s), dtype=d, device=device)
            for s, d, dst in zip(shapes, parsed, into, strict=True)
        ]
        for name, t, s, d in zip(names, tensors, shapes, parsed, strict=True):
            if list(t.shape) != list(s) or t.dtype != d or not t.is_contiguous():
                raise ValueError(f"tensor {name!r}: the receive buffer is not a contiguous {d}{list(s)}")
        self.receive_into(group_name, tensors)
        return list(zip(names, tensors, strict=True))

    def receive_into(
        self, group_name: str, buffers: list[torch.Tensor], landed: dict[int, Callable[[], None]] | None = None
    ) -> None:
        """Join the trainer's broadcasts into `buffers`, which the caller has checked against
        what the trainer sends (contiguous, its shapes and dtypes, in its order); `landed` as
        `_broadcast`'s."""
        self._finished = _broadcast(self._get(group_name), buffers, landed)

    def destroy(self, group_name: str) -> None:
        """Leave the group; its name may then be reused."""
        group = self._get(group_name)
        del self._groups[group_name]
        abort = getattr(group.backend, "abort", None)  # NCCL: free communicators now
        if group.backend.__class__.__name__ in ("ProcessGroupNCCL", "VllmNcclComm") and callable(abort):
            abort()


# ---- the trainer side (tests, examples/rl_colocate.py) -------------------------------------


@dataclass
class TrainerGroup:
    """Rank 0 of a weight-update group: what a trainer holds."""

    group: _Group


def trainer_group(
    master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
    device: torch.device | str = "cpu", timeout_s: float = 60,
) -> TrainerGroup:
    """Host the store and join as rank 0. Blocks until every engine has joined: call it while the
    engines' `init_weights_update_group` requests are in flight."""
    _check_common(world_size, backend, torch.device(device))
    timeout = timedelta(seconds=timeout_s)
    return TrainerGroup(_connect(master_address, master_port, 0, world_size, group_name, backend,
                                 torch.device(device), timeout))


def pack_bucket(pairs: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bytes of `pairs`, back to back in order, as one uint8 tensor: what a trainer
    broadcasts for load_format "flattened_bucket"."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in pairs])


def broadcast_from_trainer(
    handle: TrainerGroup, pairs: list[tuple[str, torch.Tensor]], load_format: str | None = None
) -> None:
    """Broadcast the tensors to the engines, which must be receiving the same (names, dtypes,
    shapes), sent them over HTTP: each in order, or for "flattened_bucket" their bytes back to
    back as one uint8 tensor (SGLang's FlattenedTensorBucket)."""
    if load_format == "flattened_bucket":
        _broadcast(handle.group, [pack_bucket(pairs)])
    else:
        _broadcast(handle.group, [t.contiguous() for _, t in pairs])
