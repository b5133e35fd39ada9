"""vLLM's NCCL weight-transfer group, from the receiving side: what `/init_weight_transfer_engine`
joins on a GPU, so that a trainer running vLLM's own `NCCLWeightTransferEngine.trainer_init`
(vllm/distributed/weight_transfer/nccl_engine.py) finds this engine.

The wire, as vLLM's trainer builds it (`StatelessProcessGroup.create`, then `PyNcclCommunicator`):
- rank 0 (the trainer) hosts a TCPStore at (master_address, master_port), libuv off; every
  other rank joins it as a client, counted in by world_size;
- rank 0 sets the key "broadcast_from/0/0" to `pickle.dumps(ncclUniqueId)`: a ctypes struct of
  128 bytes from vllm/distributed/device_communicators/pynccl_wrapper.py (SGLang's copy of
  PyNccl has the same struct under its own module);
- every rank calls ncclCommInitRank(world_size, that id, rank), then joins one warm-up
  all-reduce (sum) of a float32 zero;
- an update is a run of ncclBroadcast from rank 0 on that communicator, in the order of the
  update's names (engine/weights/group_updates.py lays them out).

Rules:
- The id is unpickled by an unpickler that knows two globals, ctypes' `_unpickle` and the
  ncclUniqueId struct (vLLM's or SGLang's module): any other global is refused before it runs.
- The communicator is NCCL's own, through engine/weights/nccl_lib.py (the libnccl torch loads).
  Each broadcast runs on the group's stream, which first waits for the current stream (so a
  receive buffer is ready, as with ProcessGroupNCCL); the host then polls its event before the
  current stream may wait on it. A trainer that stops sending costs the engine `timeout`, then
  an error, and never blocks the engine's stream: the communicator is aborted, and the buffers
  it was writing are kept (`_STUCK`), never reused.
"""

from __future__ import annotations

import _ctypes
import io
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.weights import nccl_lib

POLL_S = 5e-5  # how often the host looks whether a broadcast has arrived (groups.py: the same, for c10d groups)
UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first key from rank 0
UNIQUE_ID_MODULES = (
    "vllm.distributed.device_communicators.pynccl_wrapper",
    "sglang.srt.distributed.device_communicators.pynccl_wrapper",
)
_STUCK: list[list[torch.Tensor]] = []  # receive buffers of aborted broadcasts


class _UniqueIdUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_ctypes", "_unpickle"):
            return _ctypes._unpickle
        if module in UNIQUE_ID_MODULES and name == "ncclUniqueId":
            return nccl_lib.UniqueId  # pynccl_wrapper.ncclUniqueId's layout: 128 opaque bytes
        raise pickle.UnpicklingError(f"the NCCL unique id names {module}.{name}; only a pynccl ncclUniqueId is accepted")


def unique_id_of(raw: bytes) -> bytes:
    """The 128 bytes of a pickled ncclUniqueId, as vLLM's trainer stores it; else ValueError."""
    try:
        uid = _UniqueIdUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # UnpicklingError, EOFError, a struct of the wrong size, ...
        raise ValueError(f"the trainer's NCCL unique id ({UNIQUE_ID_KEY}) is not a pickled ncclUniqueId: {e}") from None
    if not isinstance(uid, nccl_lib.UniqueId):
        raise ValueError(f"the trainer's NCCL unique id ({UNIQUE_ID_KEY}) is a {type(uid).__name__}, not an ncclUniqueId")
    return bytes(uid)


def read_unique_id(master_address: str, master_port: int, world_size: int, timeout: timedelta) -> tuple[dist.Store, bytes]:
    """Join the trainer's store as StatelessProcessGroup's clients do, and read its NCCL id."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout, use_libuv=False)
    return store, unique_id_of(store.get(UNIQUE_ID_KEY))


class _Work:
    """One broadcast in flight: `wait` is the host's bounded wait, then the current stream's."""

    def __init__(self, comm: VllmNcclComm, event: torch.cuda.Event) -> None:
        self._comm, self._event = comm, event

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = time.monotonic() + (timeout or self._comm.timeout).total_seconds()
        while not self._event.query():
            if time.monotonic() > deadline:
                self._comm.stuck()
                raise TimeoutError(f"vLLM weight transfer: a broadcast from the trainer did not arrive within "
                                   f"{self._comm.timeout.total_seconds():g} s; the group is unusable, init it again")
            time.sleep(POLL_S)
        torch.cuda.current_stream(self._comm.device).wait_event(self._event)
        self._comm.arrived()
        return True


class VllmNcclComm:
    """This rank of a vLLM weight-transfer communicator; `broadcast` as a c10d backend's."""

    def __init__(self, uid: bytes, rank: int, world_size: int, device: torch.device, timeout: timedelta) -> None:
        self.rank, self.world_size, self.device, self.timeout = rank, world_size, device, timeout
        self._in_flight: list[torch.Tensor] = []  # receive buffers of broadcasts not yet seen to arrive
        self._comm: nccl_lib.Comm | None = nccl_lib.init_rank(world_size, uid, rank, device)
        self._stream = torch.cuda.Stream(device)
        warm = torch.zeros(1, dtype=torch.float32, device=device)  # PyNcclCommunicator's warm-up all-reduce
        self._stream.wait_stream(torch.cuda.current_stream(device))
        nccl_lib.all_reduce(self._comm, warm, self._stream)
        self._in_flight.append(warm)
        self._launched().wait()

    def broadcast(self, tensors: list[torch.Tensor], _options: Any = None) -> _Work:
        """Receive tensors[0] from rank 0 (the trainer) on the group's stream."""
        (t,) = tensors
        if self._comm is None:
            raise RuntimeError("vLLM weight transfer: the group was aborted; init it again")
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._in_flight.append(t)
        nccl_lib.broadcast(self._comm, t, 0, self._stream)
        return self._launched()

    def _launched(self) -> _Work:
        event = torch.cuda.Event()
        event.record(self._stream)
        return _Work(self, event)

    def arrived(self) -> None:
        """A broadcast has arrived: those before it too (one stream), so their buffers are free."""
        if self._stream.query():
            self._in_flight = []

    def stuck(self) -> None:
        """A broadcast did not arrive in time: abort the communicator (which ends its kernels)
        and keep its buffers, which those kernels may have written until they ended."""
        if self._comm is not None:
            nccl_lib.abort(self._comm)
            self._comm = None
        _STUCK.append(self._in_flight)
        self._in_flight = []

    def abort(self) -> None:
        """Leave the group. ncclCommAbort, not ncclCommDestroy: destroy finalizes, which waits
        for the other ranks (a trainer that keeps its communicator would hold this rank forever)."""
        if self._comm is None:
            return
        idle = self._stream.query()
        nccl_lib.abort(self._comm)
        self._comm = None
        if not idle:
            _STUCK.append(self._in_flight)
        self._in_flight = []


def connect(master_address: str, master_port: int, rank: int, world_size: int, device: torch.device,
            timeout: timedelta) -> tuple[VllmNcclComm, dist.Store]:
    """Rank `rank` (> 0) of the trainer's vLLM weight-transfer group, once every rank has joined."""
    store, uid = read_unique_id(master_address, master_port, world_size, timeout)
    return VllmNcclComm(uid, rank, world_size, device, timeout), store
