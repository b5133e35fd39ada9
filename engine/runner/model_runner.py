"""`ModelRunner`: owns the device side of the engine. Startup is a recipe (model, weights, KV cache,
attention backend, sampler); `launch` turns a scheduled `Batch` into tensors, runs the model and
samples the rows that finished their tokens this step, all queued on the device without waiting;
its `LaunchedStep.results()` waits for the tokens (overlap scheduling: see engine/core/engine_core.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.attention import (
    AttentionBackend,
    ForwardContext,
    get_backend_class,
    resolve_backend_name,
)
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kernels import configure as configure_kernels
from engine.memory.kv_budget import make_kv_cache
from engine.memory.regions import MemoryRegions
from engine.models import invariant
from engine.models.routed_experts import RoutedExperts
from engine.parallel import FusedReduce, TensorParallel, device_for_rank
from engine.request import Batch, Request
from engine.runner.graph_setup import attach_graphs, region_tensors
from engine.runner.graph_sizes import GraphSizes
from engine.runner.kv_sizing import num_kv_blocks
from engine.runner.launched_step import LaunchedStep
from engine.runner.model_builder import ModelBuilder
from engine.runner.prompt_logprobs import PromptLogprobs
from engine.runner.route_log import RouteLog
from engine.runner.sampler import SampledOnDevice, Sampler
from engine.runner.sampling_batch import SamplingBatch
from engine.runner.step_inputs import StepInputs, Uploader, step_inputs
from engine.runner.step_plan import SLOTS_PART, StepPlan, mixed_plan, plan_step
from engine.weights.loader import load_checkpoint, load_dummy
from engine.weights.store import WeightStore

log = logging.getLogger("siesta.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Steps of up to this many tokens all-reduce through the fused NVLink kernel at tp_size > 1.
FUSED_REDUCE_MAX_ROWS = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no CUDA GPU")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    return _DTYPES[model_config.torch_dtype if name == "auto" else name]


class ModelRunner:
    """Startup, in order (docs/ARCHITECTURE.md: Startup): 1. the model and its weights, inside the
    `weights` region, and their pinned host copy; 2. a profiling forward sizes the KV cache; 3. the
    KV cache inside the `kv_cache` region; 4. the attention backend (its workspaces), the graphs'
    static buffers and the captured decode graphs, inside the `cuda_graph` region; 5. the sampler;
    6. on CUDA, one mixed step (`mixed_plan`), so that no kernel compiles while serving."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tp: TensorParallel | None = None
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tp = tp = replace(tp or TensorParallel(), expert_parallel=config.enable_expert_parallel)
        self.device = resolve_device(device_for_rank(config.device, tp))
        # This rank's heads (engine/parallel.py): the KV cache and attention hold only these.
        self.num_heads = tp.split(model_config.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.kv_heads(model_config.num_kv_heads)
        # Rank 0 hands each step's plan to the other ranks through this before it runs it.
        self.fan_out: Callable[[StepPlan], None] | None = None
        self._last_tokens: torch.Tensor | None = None  # [S] the tokens of the last step run
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.block_size = config.block_size
        self.backend_name = resolve_backend_name(config.attention_backend, self.device.type, config.deterministic)
        self.graph_sizes = GraphSizes.of(config, self.device, get_backend_class(self.backend_name), model_config)
        self.upload = Uploader(self.device)
        self.memory = MemoryRegions(self.device, enabled=config.memory_saver, poison_on_resume=config.debug_poison_on_resume)
        torch.manual_seed(config.seed)
        configure_kernels(pdl=config.pdl, fast_launch=config.fast_launch, splitk_linear=config.splitk_linear)
        mc = model_config
        if config.deterministic:  # the ranks' partial sums meet in rank order (no fused reduce)
            self.tp = tp = replace(tp, ordered=True)
        elif tp.enabled and self.device.type == "cuda" and not config.disable_custom_all_reduce:
            self.tp = tp = replace(tp, fused=self._fused_reduce(tp))

        # `--deterministic`'s split matmuls count their chunks' arrivals here (models/invariant.py).
        with self.memory.region("cuda_graph"):
            self.arrivals = invariant.reserve(self.device) if config.deterministic else None
        t0 = time.perf_counter()
        build = ModelBuilder(config, self.dtype, self.device, self.arrivals)
        with self.memory.region("weights"):
            self.model = build.model(model_config, tp=tp, logits_pieces=config.logits_pieces)
            self.draft = build.draft(self.model, model_config, self.block_size)  # riding in the same allocation
            self.weights = WeightStore(self.model, self.device)
        if config.load_format == "dummy":
            load_dummy(self.model, config.seed)
        else:
            load_checkpoint(self.model, self.model_config.path, self.weights.targets)
            if self.draft is not None:
                load_checkpoint(self.draft.model, config.speculative_draft_model_path)
        self.weights_bytes = self.weights.nbytes
        self.memory.holds("weights", lambda: [self.weights.flat])
        if config.weights_backup == "host":  # on a CPU too: a release there loses the weights as well
            self.weights.keep_host_copy()
        log.info(
            "weights loaded in %.2f s: %.1f MiB in one allocation (%s, %s), host copy %s",
            time.perf_counter() - t0, self.weights_bytes / (1 << 20), self.device, str(self.dtype).replace("torch.", ""),
            self.weights.host_copy_kind,
        )

        # What every step shares at its largest size, allocated before the KV profile counts the
        # memory left: the fused MoE kernels' workspace, and the routed experts' record when asked.
        self.max_step_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.routed: RoutedExperts | None = None
        with self.memory.region("cuda_graph"):
            kernels = self.device.type == "cuda" and not config.deterministic  # the fused MoE's (invariant.py: not in the mode)
            self.moe_workspaces = self.model.reserve_workspaces(self.max_step_tokens) if kernels else []
            if config.enable_return_routed_experts:
                self.routed = self._capture_routes()

        t0 = time.perf_counter()
        self.num_kv_blocks = num_kv_blocks(self)
        with self.memory.region("kv_cache"):
            self.kv_cache = make_kv_cache(
                mc, self.num_kv_blocks, self.block_size, self.dtype, self.device, self.num_kv_heads
            )
            # The target's cache, then the draft model's on the same blocks (draft_model.py).
            self.kv_caches = [self.kv_cache]
            if self.draft is not None:
                self.kv_caches.append(self.draft.allocate_cache(self.num_kv_blocks, self.dtype, self.device))
        self.kv_cache_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.memory.holds("kv_cache", lambda: self.kv_caches)
        self.route_log = RouteLog(self.routed, self.num_kv_blocks * self.block_size, self.block_size, mc.num_experts,
                                  config.routed_experts_dtype) if self.routed else None  # fmt: skip
        log.info("KV cache in %.2f s: %d blocks of %d tokens, %.1f MiB", time.perf_counter() - t0, self.num_kv_blocks,
                 self.block_size, self.kv_cache_bytes / (1 << 20))

        # The attention backend, the persistent decode paths and the graphs, captured on one pool:
        # attn_backend, decode_paths, graphs, piecewise and graph_bytes (graph_setup.py).
        attach_graphs(self)
        self.memory.holds("cuda_graph", self._graph_region_tensors)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        # Compile what only mixed steps launch (mixed_plan: two sequences). One sequence at a time
        # never mixes, and its backend's workspace holds one row of split merges.
        if self.device.type == "cuda" and config.max_num_seqs > 1:
            self.run(mixed_plan(self.block_size, self.num_kv_blocks))
            torch.cuda.synchronize(self.device)

    def after_resume(self) -> None:
        """The `cuda_graph` region came back with undefined contents: the counters kept there
        (the attention's split merges, the graphs' replays, the persistent decode kernels' grid
        barriers, the MoE kernels' and the invariant matmuls' arrivals, the routed experts' columns
        of dense layers) start from zero again."""
        self.attn_backend.after_resume()
        if self.arrivals is not None:
            self.arrivals.after_resume()
        if self.draft is not None:
            self.draft.after_resume()
        for ws in self.moe_workspaces:
            ws.after_resume()
        if self.routed is not None:
            self.routed.reset()
        if self.graphs is not None:
            self.graphs.after_resume()
        for path in self.decode_paths:
            path.after_resume()

    def _capture_routes(self) -> RoutedExperts:
        try:
            routed = self.model.capture_routed_experts(self.max_step_tokens)
        except ValueError as e:
            raise ConfigError(f"--enable-return-routed-experts: {e}") from None
        log.info("routed experts recorded for steps of <= %d tokens: %.1f MiB on the device", self.max_step_tokens,
                 routed.buffer.numel() * routed.buffer.element_size() / (1 << 20))
        return routed

    def _graph_region_tensors(self) -> list[torch.Tensor]:
        """The tensors the `cuda_graph` region holds (graph_setup.region_tensors), with the MoE
        workspaces, the invariant matmuls' arrivals and the routed experts' record."""
        others = [self.arrivals, *self.moe_workspaces, *(ws.align for ws in self.moe_workspaces), self.routed]
        return region_tensors(self, others, self.weights.flat)

    def make_backend(self, kv_cache: torch.Tensor, draft: ModelConfig | None = None) -> AttentionBackend:
        """The attention backend over `kv_cache`: the target's, or the draft model's (`draft`: its config)."""
        mc = draft or self.model_config
        return get_backend_class(self.backend_name)(
            kv_cache,
            scale=mc.head_dim**-0.5,
            num_heads=self.num_heads if draft is None else mc.num_heads,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    def _fused_reduce(self, tp: TensorParallel) -> FusedReduce:
        """The NVLink all-reduce fused into the norms (engine/kernels/tp_reduce.py), for steps of up
        to FUSED_REDUCE_MAX_ROWS tokens: every decode graph; larger prefills use NCCL."""
        from engine.kernels.tp_reduce import TpReduce

        fused = TpReduce(tp, self.device, self.dtype, self.model_config.hidden_size, FUSED_REDUCE_MAX_ROWS)
        log.info("tensor parallelism: fused NVLink all-reduce for steps of <= %d tokens (%.1f MiB of buffers)",
                 FUSED_REDUCE_MAX_ROWS, fused.nbytes / (1 << 20))
        return fused

    def propose_drafts(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """The draft model's ks[i] tokens for requests[i] (draft_model.py); none while its weights
        are lost (released with no host copy, not updated since)."""
        self.weights.ensure_current()
        if self.draft is None or self.weights.lost:
            return [[] for _ in requests]
        return self.draft.propose(requests, ks, self.upload)

    @torch.inference_mode()
    def launch(self, batch: Batch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device and return without waiting for it (rank 0: it plans the
        step, hands the plan to the other tensor-parallel ranks through `fan_out`, then runs it).
        `previous` is the step launched before this one, if its tokens are not read yet: a row
        whose input is one of them takes it from the device."""
        pending = previous.pending_tokens() if previous is not None else None
        plan = plan_step(batch, self.block_size, pending, self.config.max_num_seqs)
        if self.fan_out is not None:
            self.fan_out(plan)
        samples, prompt = self.run(plan)
        for j, ((i, q, _), lp) in enumerate(zip(plan.prompt_logprob_rows, prompt.logprobs, strict=True)):
            req = batch.requests[i]
            req.prompt_logprobs[q] = lp
            if req.prompt_top_logprobs and prompt.tops is not None:
                req.prompt_top_logprobs[q] = prompt.tops[j][: req.sampling_params.top_logprobs_num]
        routes = self.route_log.stage(plan.parts[SLOTS_PART]) if self.route_log is not None else None
        return LaunchedStep(batch, [batch.requests[i] for i in plan.sample_rows], samples, routes)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[SampledOnDevice | None, PromptLogprobs]:
        """Run a planned step on this rank: (its samples, None when no row samples; the prompt
        logprobs it asked for). Stale weights (after a resume) are restored first. A decode step
        where every row samples replays a CUDA graph when one fits. Pending input tokens come
        from the tokens this rank sampled in the step it ran last."""
        self.weights.ensure_current()
        if self.graphs is not None and self.graphs.can_run(plan):
            samples = self._replay(plan)
            self._last_tokens = self.graphs.io.tokens[: plan.num_seqs] if not plan.drafted else None
            return samples, PromptLogprobs.none()
        inputs = step_inputs(plan, self.upload, self._last_tokens)
        samples = None
        if not inputs.sample_rows:
            _, prompt_logprobs = self._eager(plan, inputs)
        else:
            hidden, prompt_logprobs = self._eager(plan, inputs)
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            assert plan.sampling is not None
            samples = self.sampler.sample(logits, SamplingBatch.from_plan(plan.sampling, self.device, self.upload))
        self._last_tokens = None
        if samples is not None and not plan.drafted:  # with graphs: where a graph's pending rows read them
            self._last_tokens = self.graphs.io.keep(samples.token_ids) if self.graphs is not None else samples.token_ids
        return samples, prompt_logprobs

    def _replay(self, plan: StepPlan) -> SampledOnDevice:
        """A decode step from its graph. The graph samples greedily; a step that asks for more
        (sampled rows, top logprobs, penalties, bias, banned tokens) runs the sampler on its
        logits after it, reusing the graph's log-sum-exp and argmax where the logits stay as they are."""
        sampling = plan.sampling
        assert sampling is not None
        n = plan.num_seqs
        slot = self.graphs.run(plan)
        io = self.graphs.io
        if sampling.leaves_logits and sampling.all_greedy and not any(sampling.top_logprobs_nums):
            return io.landed(slot, n)
        batch = SamplingBatch.from_plan(sampling, self.device, self.upload)
        samples = self.sampler.sample(self.graphs.logits[:n], batch, lse_argmax=(io.lse[:n], io.tokens[:n], io.pairs[:n]))
        io.keep(samples.token_ids)
        return samples

    def _eager(self, plan: StepPlan, inputs: StepInputs) -> tuple[torch.Tensor, PromptLogprobs]:
        """The forward without a full graph: (hidden states [T, hidden], the prompt logprobs the
        plan asks for), replayed from the piecewise graphs when T fits them."""
        num_tokens = inputs.input_ids.shape[0]
        if self.piecewise is not None and self.piecewise.can_run(num_tokens):
            hidden = self.piecewise.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            ctx = ForwardContext(self.attn_backend, inputs.meta, plan.long_kv, plan.verify)
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not plan.prompt_logprob_rows:
            return hidden, PromptLogprobs.none()
        rows = [r for _, _, r in plan.prompt_logprob_rows]
        return hidden, PromptLogprobs.score(hidden, rows, plan.prompt_logprob_targets, plan.prompt_logprob_top_k,
                                            self.model.compute_logits)
