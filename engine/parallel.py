"""`TensorParallel`: this process's place in the tensor-parallel group (`--tp-size`), and the two
collectives a sharded forward needs. Every rank is one process on one device; the group is
torch.distributed's default process group (NCCL on CUDA, gloo on a CPU), made once by
`join_group` before the model is built. At size 1 nothing is communicated and nothing is split.

Sharding rules (Megatron's, as vLLM and SGLang shard the decoder families served here):
- column-parallel linears (q/k/v, gate/up, lm_head) keep `1/size` of the output features;
  row-parallel ones (o, down) keep `1/size` of the input features and sum with an all-reduce;
- mixture-of-experts layers (engine/models/moe.py) split every expert's intermediate dimension
  as a dense MLP's (gate and up rows, down's columns: partial sums) and replicate the router;
- query heads split evenly; KV heads split evenly when there are at least `size` of them, else
  each rank keeps the one KV head its query heads use (replicated across `size / Hkv` ranks);
- the vocabulary splits into `ceil(V / size)` rows per rank (the last rank padded): embedding
  rows outside a rank's range look up zero and an all-reduce sums them; logits all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from engine.config import ConfigError

# How long a collective of the tensor-parallel group may wait for a peer before failing.
GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Shard:
    """The part of a full (checkpoint) tensor one rank holds: `length` of its `total` entries along
    dim `dim`, from `start`. The rank's tensor may be longer along `dim` (the vocabulary's padding)."""

    dim: int
    start: int
    length: int
    total: int

    @property
    def whole(self) -> bool:
        return self.length == self.total


class FusedReduce(Protocol):
    """An all-reduce fused with the residual add and RMSNorm after it (engine/kernels/tp_reduce.py)."""

    def fits(self, x: torch.Tensor) -> bool: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # Set by the model runner on CUDA (after the group exists); None: NCCL / gloo, then the norm.
    fused: FusedReduce | None = field(default=None, compare=False, repr=False)
    # `--deterministic`: all_reduce sums the ranks' tensors in rank order, whatever the message
    # (a library's all-reduce cuts a message into chunks by its size, each summed from another rank).
    ordered: bool = False
    # `--enable-expert-parallel`: each rank holds num_experts / size whole experts (models/moe.py)
    # instead of a slice of every expert's intermediate dimension.
    expert_parallel: bool = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def whole_experts(self) -> bool:
        """Whether this rank holds whole experts, a share of them (expert parallelism)."""
        return self.enabled and self.expert_parallel

    def defers_reduce(self, bias: bool) -> bool:
        """Whether a row-parallel linear leaves its output a partial sum for the RMSNorm after it to
        reduce (fused with its residual add): always at size > 1, unless the linear has a bias,
        which must be added after the sum."""
        return self.enabled and not bias

    # ---- how things split -----------------------------------------------------------------

    def split(self, n: int, what: str) -> int:
        """n / size, which must be whole."""
        if n % self.size:
            raise ConfigError(f"{what} ({n}) is not divisible by tp_size {self.size}")
        return n // self.size

    def even(self, n: int, what: str, dim: int = 0) -> Shard:
        """This rank's even slice of n entries along `dim`."""
        local = self.split(n, what)
        return Shard(dim, self.rank * local, local, n)

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads held by one rank: an even split, or one replicated head."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ConfigError(f"tp_size {self.size} is not a multiple of num_key_value_heads {num_kv_heads}")
        return 1

    def kv_shard(self, num_kv_heads: int, head_dim: int) -> Shard:
        """This rank's rows of k_proj / v_proj (dim 0: heads x head_dim)."""
        local = self.kv_heads(num_kv_heads)
        first = self.rank * local if num_kv_heads >= self.size else self.rank * num_kv_heads // self.size
        return Shard(0, first * head_dim, local * head_dim, num_kv_heads * head_dim)

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding and lm_head per rank (the last rank's tail is padding)."""
        return -(-vocab_size // self.size)

    def vocab_shard(self, vocab_size: int) -> Shard:
        rows = self.vocab_rows(vocab_size)
        start = min(self.rank * rows, vocab_size)
        return Shard(0, start, min(rows, vocab_size - start), vocab_size)

    # ---- collectives ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (capturable in a CUDA graph with NCCL). `ordered`:
        every rank's x gathered, then ((x_0 + x_1) + x_2) + ..., elementwise: an element's sum
        follows the rank order alone."""
        if not self.enabled:
            return x
        if not self.ordered:
            dist.all_reduce(x)
            return x
        parts = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather_single(parts, x.contiguous().view(-1))
        parts = parts.view(self.size, -1)  # [size, x.numel()], rank r's x in row r
        total = parts[0].clone()
        for r in range(1, self.size):
            total += parts[r]
        return x.copy_(total.view(x.shape))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[n, m] per rank -> [n, size * m], the ranks' columns in rank order."""
        if not self.enabled:
            return x
        n, m = x.shape
        parts = torch.empty((self.size * n, m), dtype=x.dtype, device=x.device)  # [size * n, m]
        _all_gather_single(parts, x.contiguous())
        return parts.view(self.size, n, m).permute(1, 0, 2).reshape(n, self.size * m)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest `value` any rank has (startup: a size every rank can hold)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


# torch 2.13 renamed all_gather_into_tensor; the GPU machines run 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def device_for_rank(device: str, tp: TensorParallel) -> str:
    """The device `tp.rank` runs on: cuda:<rank> when the engine runs on CUDA with several ranks;
    `device` as given at size 1."""
    if not tp.enabled or device == "cpu":
        return device
    if device == "auto":
        return f"cuda:{tp.rank}" if torch.cuda.is_available() else "cpu"
    return f"cuda:{tp.rank}" if device.startswith("cuda") else device


def host_rendezvous(size: int) -> dist.TCPStore:
    """Rank 0's side of the group's rendezvous, made before the workers start: a TCPStore on
    loopback whose port the OS picks as it binds (`.port`), so no other process can take the port
    between its choice and its use (a port probed free and bound later could be)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)


def join_group(tp: TensorParallel, device: torch.device, address: str, store: dist.Store | None = None) -> None:
    """Make the tensor-parallel group the default process group (a no-op at size 1): rank 0 with
    `host_rendezvous`'s `store`, the other ranks through `address` ("tcp://host:port", its port)."""
    if not tp.enabled:
        return
    if store is None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), tp.size, is_master=False, timeout=GROUP_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=tp.rank, world_size=tp.size, timeout=GROUP_TIMEOUT, device_id=device
        )
    else:
        dist.init_process_group("gloo", store=store, rank=tp.rank, world_size=tp.size, timeout=GROUP_TIMEOUT)
