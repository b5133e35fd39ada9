"""`EngineConfig`: what the user asks for, every flag of `siesta serve` (the CLI generates them
from its fields: underscores become dashes); frozen, read everywhere and changed nowhere, its
defaults here and only here. `context_length`: the longest sequence served.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from engine.config.model_config import ConfigError, ModelConfig, dtype_name


@dataclass(frozen=True)
class EngineConfig:
    """User knobs. Every field becomes a `siesta serve` flag (underscores become dashes)."""

    model: str = field(default="", metadata={"help": "checkpoint directory or Hugging Face repo id (default: the embedded demo model)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: --model)"})
    device: str = field(default="auto", metadata={"help": "auto | cuda | cpu"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's) | float32 | bfloat16 | float16"})
    seed: int = field(default=0, metadata={"help": "seed of requests that name none"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "KV blocks (default: from the memory budget)"})
    kv_cache_memory_gb: float = field(default=1.0, metadata={"help": "KV cache budget on CPU, GiB"})
    mem_fraction: float = field(default=0.85, metadata={"help": "fraction of GPU memory the engine may use"})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "token budget of one step"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the model's)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV of shared prompt prefixes"})
    attention_backend: str = field(default="auto", metadata={"help": "auto (triton on CUDA, else sdpa; --deterministic: triton_fixed on CUDA, else sdpa_rows) | triton | sdpa | triton_fixed | sdpa_rows"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run every step eagerly (no decode or piecewise graphs)"})
    disable_overlap_schedule: bool = field(
        default=False, metadata={"help": "read each step's tokens before scheduling the next (default: overlap them)"}
    )
    memory_saver: bool = field(
        default=True, metadata={"help": "GPU memory in releasable regions (torch_memory_saver), on CUDA"}
    )
    debug_poison_on_resume: bool = field(
        default=False,
        metadata={"help": "fill what a GPU resume maps again with NaN / 0xFF bytes, so any read of memory lost in the release shows (a CPU release always does)"},
    )
    load_format: str = field(
        default="auto",
        metadata={"help": "auto (the checkpoint's safetensors) | dummy (random weights of config.json's shape: benchmarks; vLLM's name)"},
    )
    weights_backup: str = field(
        default="host", metadata={"help": "host (pinned copy: resume restores weights) | none (resume needs a weight update)"}
    )
    allowed_model_dirs: str | None = field(
        default=None, metadata={"help": "comma-separated directories weight updates may read (default: the parent of --model)"}
    )
    cuda_graph_max_bs: int | None = field(
        default=None, metadata={"help": "largest decode batch replayed from a CUDA graph (default: from memory)"}
    )
    piecewise_cuda_graph_max_tokens: int | None = field(
        default=None,
        metadata={"help": "largest step with prefill replayed from piecewise CUDA graphs (default: max-num-batched-tokens; 0: off)"},
    )
    tp_size: int = field(
        default=1, metadata={"help": "tensor-parallel ranks: one process per device (cuda:0 ..), NCCL on CUDA, gloo on CPU"}
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={"help": "at tp_size > 1, each rank holds num_experts / tp_size whole experts instead of a slice of every "
                          "expert (vLLM's flag); attention stays tensor-parallel"},
    )
    ep_size: int = field(
        default=1, metadata={"help": "SGLang's form of the above: 1 (experts sliced) or tp_size (whole experts per rank)"}
    )
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata={"help": "at tp_size > 1 on CUDA, all-reduce with NCCL instead of the fused NVLink kernel (engine/kernels/tp_reduce.py)"},
    )
    enable_return_routed_experts: bool = field(
        default=False,
        metadata={"help": "record every MoE layer's top-k experts per token, so requests may ask for them (return_routed_experts: RL routing replay)"},
    )
    routed_experts_dtype: str | None = field(
        default=None,
        metadata={"help": "integers of the returned routed experts' base64: int32 (SGLang's default), uint16 or uint8 "
                          "(a quarter of the bytes; every expert id must fit); unset: SGLang's SGLANG_ROUTED_EXPERTS_DTYPE, "
                          "else int32. Answers name it in meta_info.routed_experts_dtype, as SGLang's reader takes it"},
    )
    deterministic: bool = field(
        default=False,
        metadata={"help": "bitwise-reproducible tokens and logprobs whatever the batch, chunking or prefix cache "
                          "(batch-invariant ops; tensor-parallel sums in rank order)",
                  "aliases": ("--enable-deterministic-inference",)},
    )
    speculative_algorithm: str | None = field(
        default=None,
        metadata={"help": "speculative decoding, drafts verified in one forward, the tokens plain decoding's: ngram "
                          "(each request's own text and earlier rollouts of its prompt; SGLang's NGRAM) | draft (a small "
                          "model of the target's vocabulary, --speculative-draft-model-path; SGLang's STANDALONE)"},
    )
    speculative_draft_model_path: str | None = field(
        default=None, metadata={"help": "the draft model's directory (--speculative-algorithm draft); its weights are `draft.`-named"}
    )
    speculative_num_draft_tokens: int = field(default=4, metadata={"help": "tokens drafted per request and step"})
    speculative_ngram_min_match_window_size: int = field(default=2, metadata={"help": "shortest suffix an ngram draft matches"})
    speculative_ngram_max_match_window_size: int = field(default=8, metadata={"help": "longest suffix an ngram draft matches"})
    speculative_disable_by_batch_size: int = field(
        default=8, metadata={"help": "draft only while at most this many requests run (vLLM's disable_by_batch_size)"}
    )
    speculative_config: str | None = field(
        default=None,
        metadata={"help": "vLLM's JSON form of the above: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
                          "\"prompt_lookup_min\": n, \"prompt_lookup_max\": m, \"disable_by_batch_size\": b}; method draft_model "
                          "with \"model\": DIR"},
    )
    # Kernel choices on CUDA (docs/KERNELS.md): each on by default; off runs the path it replaces.
    fused_ops: bool = field(default=True, metadata={"help": "Triton norms, rope, SiLU-mul and few-rows GEMVs (off: torch ops)"})
    fused_decode: bool = field(default=True, metadata={"help": "decode steps of 1-4 rows as one kernel per layer"})
    batch_decode: bool = field(default=True, metadata={"help": "decode steps of up to 64 rows as two kernels per layer"})
    rope_decode: bool = field(
        default=True, metadata={"help": "the layers' decode attention with q/k norm, rope and the K/V store in one kernel"}
    )
    logits_pieces: bool = field(
        default=True, metadata={"help": "a decode graph's lm_head writes the sampler's log-sum-exp pieces (off: it reads the logits)"}
    )
    splitk_linear: bool = field(default=True, metadata={"help": "split-K GEMMs for o_proj / down_proj at 1-64 rows and for the layers' decode attention's qkv at 1-16 rows (off: skinny GEMVs to 16 rows, cuBLAS above)"})
    pdl: bool = field(default=True, metadata={"help": "programmatic dependent launch between kernels on Hopper and later"})
    fast_launch: bool = field(default=True, metadata={"help": "launch Triton kernels from their cached binaries (off: Triton's JIT path)"})

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "tp_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.piecewise_cuda_graph_max_tokens is not None and self.piecewise_cuda_graph_max_tokens < 0:
            raise ConfigError(f"piecewise_cuda_graph_max_tokens must be >= 0, got {self.piecewise_cuda_graph_max_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.weights_backup not in ("host", "none"):
            raise ConfigError(f"weights_backup must be host or none, got {self.weights_backup!r}")
        if self.dtype != "auto":
            dtype_name(self.dtype)
        if self.ep_size not in (1, self.tp_size):
            raise ConfigError(f"ep_size must be 1 or tp_size ({self.tp_size}): experts are spread over the "
                              f"tensor-parallel ranks, got {self.ep_size}")
        if self.ep_size > 1 or (self.enable_expert_parallel and self.tp_size > 1):  # one switch, both forms
            object.__setattr__(self, "enable_expert_parallel", True)
            object.__setattr__(self, "ep_size", self.tp_size)
        wire = (self.routed_experts_dtype or os.environ.get(ROUTED_EXPERTS_DTYPE_ENV) or "int32").strip().lower()
        if wire not in ROUTED_EXPERTS_DTYPES:
            raise ConfigError(f"routed_experts_dtype must be one of {', '.join(ROUTED_EXPERTS_DTYPES)}, got {wire!r}")
        object.__setattr__(self, "routed_experts_dtype", wire)
        if self.speculative_config is not None:
            self._take_speculative_config(self.speculative_config)
        if self.speculative_algorithm is not None:
            algorithm = _SPECULATIVE.get(self.speculative_algorithm.lower())
            if algorithm is None:
                raise ConfigError(f"speculative_algorithm must be ngram or draft, got {self.speculative_algorithm!r}")
            object.__setattr__(self, "speculative_algorithm", algorithm)
            if (algorithm == "draft") != (self.speculative_draft_model_path is not None):
                raise ConfigError("speculative_algorithm draft and speculative_draft_model_path come together")
            if algorithm == "draft" and self.tp_size > 1:
                raise ConfigError("a draft model serves one GPU for now (tp_size 1)")
            low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
            if self.speculative_num_draft_tokens < 1 or not 1 <= low <= high or self.speculative_disable_by_batch_size < 1:
                raise ConfigError("speculative decoding needs num_draft_tokens >= 1, 1 <= ngram min window <= max "
                                  "window, and disable_by_batch_size >= 1")

    def _take_speculative_config(self, text: str) -> None:
        """vLLM's --speculative-config (ngram, draft_model): its keys set the speculative_* fields."""
        names = {"method": "speculative_algorithm", "num_speculative_tokens": "speculative_num_draft_tokens",
                 "model": "speculative_draft_model_path",
                 "prompt_lookup_min": "speculative_ngram_min_match_window_size",
                 "prompt_lookup_max": "speculative_ngram_max_match_window_size",
                 "disable_by_batch_size": "speculative_disable_by_batch_size"}  # fmt: skip
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(spec, dict) or set(spec) - set(names) or "method" not in spec:
            raise ConfigError(f"speculative_config takes a JSON object with method and any of {sorted(names)}, got {text!r}")
        for key, value in spec.items():
            if key not in ("method", "model") and not isinstance(value, int):
                raise ConfigError(f"speculative_config: {key} must be an integer, got {value!r}")
            object.__setattr__(self, names[key], value)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# The routed experts' wire integers (SGLang's names), and SGLang's variable naming one.
ROUTED_EXPERTS_DTYPES = ("int32", "uint16", "uint8")
ROUTED_EXPERTS_DTYPE_ENV = "SGLANG_ROUTED_EXPERTS_DTYPE"

# speculative_algorithm's names, SGLang's and vLLM's -> ours
_SPECULATIVE = {"ngram": "ngram", "draft": "draft", "standalone": "draft", "draft_model": "draft"}


def context_length(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence the engine serves: --max-model-len, at most the model's."""
    limit = model_config.max_position_embeddings
    return min(config.max_model_len or limit, limit)
