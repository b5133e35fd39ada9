"""`ModelRunner`: owns the device side of the engine. Startup is a recipe (model, weights, KV cache,
attention backend, sampler); `execute` turns a scheduled `Batch` into tensors, runs the model and
samples the rows that finished their tokens this step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import (
    AttentionMetadata,
    ForwardContext,
    get_backend_class,
    resolve_backend_name,
)
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.models import get_model_class
from engine.request import Batch
from engine.sampler import Sampler, SamplingBatch
from engine.weights import load_checkpoint

log = logging.getLogger("siesta.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GIB = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no CUDA GPU")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    return _DTYPES[model_config.torch_dtype if name == "auto" else name]


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: K and V, each [block_size, num_kv_heads, head_dim]."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * elem


def num_kv_blocks_for_budget(budget_bytes: int, block_bytes: int, max_useful_blocks: int) -> int:
    """Blocks that fit in `budget_bytes`, capped at what the engine could ever use. Pure."""
    if budget_bytes < block_bytes:
        raise ConfigError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_bytes} bytes; "
            "raise the budget or lower --block-size"
        )
    return max(1, min(budget_bytes // block_bytes, max_useful_blocks))


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # batch index of each request that samples this step
    sample_indices: torch.Tensor  # [S] int64: token row of each sampling request's last token


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)

        t0 = time.perf_counter()
        self.model = self._load_model()
        self.weights_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        log.info(
            "weights loaded in %.2f s: %.1f MiB (%s, %s)",
            time.perf_counter() - t0, self.weights_bytes / (1 << 20), self.device, str(self.dtype).replace("torch.", ""),
        )

        self.num_kv_blocks = self._num_kv_blocks(max_model_len)
        mc = model_config
        # [num_layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            (mc.num_layers, 2, self.num_kv_blocks, self.block_size, mc.num_kv_heads, mc.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB", self.num_kv_blocks, self.block_size, self.kv_cache_bytes / (1 << 20))
        self.backend_name = resolve_backend_name(config.attention_backend, self.device.type)
        self.attn_backend = get_backend_class(self.backend_name)(self.kv_cache, scale=mc.head_dim**-0.5)
        self.sampler = Sampler(seed=config.seed, device=self.device)

    def _load_model(self) -> torch.nn.Module:
        cls = get_model_class(self.model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_checkpoint(model, self.model_config.path)
        return model.eval()

    def _num_kv_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        block_bytes = kv_block_bytes(self.model_config, self.block_size, self.dtype)
        # Never more blocks than max_num_seqs requests of full context length could use.
        max_useful = self.config.max_num_seqs * -(-max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - self.config.mem_fraction) * total)
        else:
            budget = int(self.config.kv_cache_memory_gb * _GIB)
        return num_kv_blocks_for_budget(budget, block_bytes, max_useful)

    def prepare(self, batch: Batch) -> StepInputs:
        """Flatten a batch into ragged tensors; built on the host, copied once to the device."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_indices: list[int] = []
        for i, req in enumerate(batch.requests):
            start, n = req.num_computed_tokens, batch.num_new_tokens[i]
            end = start + n
            input_ids += req.token_ids[start:end]
            positions += range(start, end)
            table = req.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if batch.samples(i):
                sample_rows.append(i)
                sample_indices.append(query_start[-1] - 1)
        width = max(len(r.block_table) for r in batch.requests)
        tables = [r.block_table + [0] * (width - len(r.block_table)) for r in batch.requests]

        def dev(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=dev(query_start, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_tables=dev(tables, torch.int32),
            slot_mapping=dev(slots, torch.int64),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=dev(input_ids, torch.int64),
            positions=dev(positions, torch.int64),
            meta=meta,
            sample_rows=sample_rows,
            sample_indices=dev(sample_indices, torch.int64),
        )

    @torch.inference_mode()
    def execute(self, batch: Batch) -> dict[str, SampleResult]:
        """Run one step; return the sampled token of each request that samples, by request id."""
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, ForwardContext(self.attn_backend, inputs.meta))
        if not inputs.sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        reqs = [batch.requests[i] for i in inputs.sample_rows]
        out = self.sampler(logits, SamplingBatch.from_requests(reqs, self.device))
        return {
            r.request_id: SampleResult(
                token_id=out.token_ids[j],
                logprob=out.logprobs[j],
                top_logprobs=out.top_logprobs[j] if out.top_logprobs is not None else None,
            )
            for j, r in enumerate(reqs)
        }
