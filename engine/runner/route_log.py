"""`RouteLog`: the experts every MoE layer chose for the token in each KV slot, on the host, for RL
routing replay (SGLang's `--enable-return-routed-experts` and the request's `return_routed_experts`).

    table [num_slots, num_layers, top_k] (numpy; num_slots = KV blocks x block size) of the wire
          dtype (`--routed-experts-dtype`: int32, uint16 or uint8), which must hold every expert id
    row s: the choices of the forward that wrote the KV in slot s (a dense layer's column is 0)

Rules:
- With the flag on, every step is recorded, whoever asked: a request whose prompt comes from the
  prefix cache reads the rows of the forward that computed that KV, as it reads the KV itself.
- At launch (`stage`), the step's rows (the model's `RoutedExperts.last(T)`, in the step's token
  order) are copied to pinned host memory behind the forward, on its stream, with the step's KV
  slots kept beside them. When the step is read (`StagedRoutes.commit`), before anything else of it
  is applied, they land in their slots. A slot's row is rewritten whenever a forward writes KV into
  it (preemption, recompute after a release): rows and KV go together.
- Staging is a ring of two buffers: the engine reads step k before it launches step k + 2 (overlap
  scheduling keeps at most one step in flight past the one read).
- A request's rows are read by position through its block table (`rows`), while it holds its
  blocks: SGLang's layout is positions 0 .. prompt + output - 2 (the last token is sampled, never a
  forward's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ConfigError
from engine.models.routed_experts import RoutedExperts


@dataclass
class StagedRoutes:
    """One launched step's rows on their way to the host: `rows` [T, layers, k] int32 (pinned on
    CUDA), ready once `ready` (a CUDA event; None on a CPU) has passed; `slots` [T] their KV slots."""

    log: RouteLog
    rows: torch.Tensor
    slots: list[int]
    ready: torch.cuda.Event | None

    def commit(self) -> None:
        """Wait for the copy and write the rows into the log's table at their slots."""
        if self.ready is not None:
            self.ready.synchronize()
        self.log.table[np.asarray(self.slots, dtype=np.int64)] = self.rows.numpy()


class RouteLog:
    def __init__(self, routed: RoutedExperts, num_slots: int, block_size: int, num_experts: int, dtype: str = "int32") -> None:
        wire = np.dtype(dtype)
        if num_experts - 1 > np.iinfo(wire).max:
            raise ConfigError(f"--routed-experts-dtype {dtype} holds ids up to {np.iinfo(wire).max}, the model has {num_experts} experts")
        self.routed = routed
        self.block_size = block_size
        _, layers, k = routed.buffer.shape
        self.table = np.zeros((num_slots, layers, k), dtype=wire)
        device = routed.buffer.device
        self._staging = None
        if device.type == "cuda":
            shape = tuple(routed.buffer.shape)
            self._staging = [torch.empty(shape, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._turn = 0

    @property
    def row_bytes(self) -> int:
        return self.table[0].nbytes

    def stage(self, slots: list[int]) -> StagedRoutes:
        """The step just queued on the device wrote rows [0, len(slots)) of the routed experts'
        buffer: copy them out behind it (on a CPU at once: the next forward overwrites them)."""
        n = len(slots)
        device_rows = self.routed.last(n)
        if self._staging is None:
            return StagedRoutes(self, device_rows.clone(), slots, None)
        host = self._staging[self._turn][:n]
        self._turn ^= 1
        host.copy_(device_rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return StagedRoutes(self, host, slots, ready)

    def rows(self, spans: list[tuple[list[int], int, int]]) -> list[bytes]:
        """For each (block table, start, end): the rows of positions [start, end) of the sequence
        whose KV is in that block table, as the bytes of an array [end - start, layers, k] of the
        table's dtype (C order, little-endian on every platform torch runs on). One gather for all of them: a
        decode step asks for one row per running request."""
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, start, end in spans for p in range(start, end)]
        data = self.table[np.asarray(slots, dtype=np.int64)].tobytes() if slots else b""
        out, at, row = [], 0, self.row_bytes
        for _, start, end in spans:
            n = max(end - start, 0) * row
            out.append(data[at : at + n])
            at += n
        return out
