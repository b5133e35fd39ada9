"""Request bodies of the SGLang-native routes, with SGLang's field names so RL clients work
unchanged.

Rules:
- `sampling_params` takes every field of SGLang's SamplingParams. Unknown fields are refused (a
  typo must not silently sample with defaults); unknown top-level fields are ignored, as SGLang
  does, since clients send extras.
- An explicit JSON `null` means the field's default, in `sampling_params` and at the top level
  (slime sends `"stop": null, "stop_token_ids": null`).
- `sampling_seed` is SGLang's name for `seed`: either may be given; both with different values is
  a 400. `custom_params` is accepted and has no effect (no custom logit processors here).
- Constrained decoding by `json_schema`, `regex`, `ebnf` or `structural_tag` (a JSON string:
  engine/runner/grammar.py, engine/runner/structural_tag.py; a malformed tag is a 400 here);
  `stop_regex` is not implemented: any non-null value is a 400 saying so.
  So are the top-level `image_data`, `lora_path` and `custom_logit_processor`.
- `return_routed_experts: true` needs a server started with `--enable-return-routed-experts`
  (SGLang's flag), else a 400; `meta_info.routed_experts` is then the base64 of an int32 array
  [prompt + output - 1, num_layers, top_k] (SGLang's layout), or of uint16 / uint8 with
  `--routed-experts-dtype` (SGLang's SGLANG_ROUTED_EXPERTS_DTYPE), named in
  `meta_info.routed_experts_dtype`.
- `stream_interval`: a streamed request sends an event every that many tokens (and the last).
- `logit_bias`: {"token id": bias}, added to the logits (engine/runner/sampler.py).
- `weight_version` fields take a string or an integer, kept as a string.
- A batched `/generate` (a list of texts or of id lists) may give `sampling_params`,
  `return_logprob`, `top_logprobs_num` and `logprob_start_len` as lists, one value per prompt, as
  SGLang's GenerateReqInput does; SGLang's rules hold: a list's length is the batch's, every
  prompt's `n` is the same, and the logprob fields are lists only with n = 1. A string `rid` on a
  batch names prompt p `f"{rid}_{p}"`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    create_model,
    model_validator,
)

from engine.errors import InvalidRequest
from engine.request import SamplingParams
from engine.runner.structural_tag import xgrammar_tag

# Set from the request's top level (`return_logprob`, `top_logprobs_num`), not sampling_params.
_TOP_LEVEL = frozenset({"logprobs", "top_logprobs_num", "logprob_start_len", "return_routed_experts"})
# Integers the engine sees fit in 64 bits (its messages are msgspec: a larger int is a 500 there).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# The most samples per prompt (`n`): make_jobs builds them all at once.
MAX_N = 1024
# JSON shapes of fields whose engine type is a tuple: a string or a list.
_JSON_TYPES: dict[str, Any] = {
    "stop": str | list[str] | None, "stop_token_ids": list[Int64] | None, "logit_bias": dict[str, float] | None,
}
_INT_TYPES: dict[Any, Any] = {int: Int64, int | None: Int64 | None}
# SGLang's sampling fields not implemented here: only null is accepted.
UNSUPPORTED_SAMPLING = ("stop_regex",)
# sampling_params fields SGLang has and the engine does not: handled (or refused) here.
_SERVER_ONLY: dict[str, Any] = {
    "n": (int, Field(default=1, le=MAX_N, description="samples per prompt")),
    "sampling_seed": (Int64 | None, Field(default=None, description="SGLang's name for `seed`")),
    "custom_params": (dict[str, Any] | None, Field(default=None, description="accepted; no effect here")),
    "stream_interval": (Int64 | None, Field(default=None, ge=1, description="tokens per streamed event")),
    **{name: (Any, Field(default=None, description="not supported, null only"))
       for name in UNSUPPORTED_SAMPLING},
}


def _version_str(v: str | int | None) -> str | None:
    return None if v is None else str(v)


# A weight version as clients send it (slime: "3" or 3); kept as a string.
WeightVersion = Annotated[str | StrictInt | None, AfterValidator(_version_str)]


def _without_nulls(data: Any) -> Any:
    """A JSON object with its null fields left out, so that they take their defaults."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _sampling_fields() -> dict[str, Any]:
    """`sampling_params`' fields: the engine's SamplingParams (one source of defaults) plus the
    fields of SGLang's that only the server reads."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {
        f.name: (_JSON_TYPES[f.name], None) if f.name in _JSON_TYPES
        else (_INT_TYPES.get(hints[f.name], hints[f.name]), f.default)
        for f in dataclasses.fields(SamplingParams)
        if f.name not in _TOP_LEVEL
    }
    return fields | _SERVER_ONLY


class _SamplingBase(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _without_nulls(data)

    def to_engine(
        self, logprobs: bool, top_logprobs_num: int, logprob_start_len: int = -1, return_routed_experts: bool = False
    ) -> SamplingParams:
        """Engine params; raises `InvalidRequest` naming the bad value."""
        server_only = self.model_dump(include=set(_SERVER_ONLY))
        unsupported = [name for name in UNSUPPORTED_SAMPLING if server_only[name] is not None]
        if unsupported:
            raise InvalidRequest(f"sampling_params.{unsupported[0]} is not supported here")
        fields = self.model_dump(exclude=set(_SERVER_ONLY))
        if fields["structural_tag"] is not None:  # its shape checked now; the engine compiles it
            xgrammar_tag(fields["structural_tag"], where="sampling_params.structural_tag")
        seed, alias = fields["seed"], server_only["sampling_seed"]
        if seed is not None and alias is not None and seed != alias:
            raise InvalidRequest(f"sampling_params: seed ({seed}) and sampling_seed ({alias}) differ; give one")
        fields["seed"] = seed if seed is not None else alias
        fields["stop"] = fields["stop"] or ()
        fields["stop_token_ids"] = fields["stop_token_ids"] or ()
        fields["logit_bias"] = _logit_bias(fields["logit_bias"])
        return SamplingParams(
            **fields, logprobs=logprobs, top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
        )  # fmt: skip


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """SGLang's {"token id": bias} as (id, bias) pairs; a key that is not an integer is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), value))
        except ValueError:
            raise InvalidRequest(f"sampling_params.logit_bias: key {key!r} is not a token id") from None
    return tuple(pairs)


SamplingParamsIn = create_model("SamplingParamsIn", __base__=_SamplingBase, **_sampling_fields())

# Tags of a one-or-per-prompt field's two shapes; they name no field, so error messages omit them.
ONE, PER_PROMPT = "one", "per_prompt"
UNION_TAGS = frozenset({ONE, PER_PROMPT})


def _shape(value: Any) -> str:
    return PER_PROMPT if isinstance(value, list) else ONE


def one_or_per_prompt(t: Any) -> Any:
    """A field that takes one value for every prompt or a list of one per prompt; an error names
    only the shape the value has (a plain union would report both)."""
    return Annotated[Annotated[t, Tag(ONE)] | Annotated[list[t], Tag(PER_PROMPT)], Discriminator(_shape)]


SamplingParamsField = one_or_per_prompt(SamplingParamsIn)
BoolField = one_or_per_prompt(bool)
Int64Field = one_or_per_prompt(Int64)


class GenerateRequest(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _without_nulls(data)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsField = Field(default_factory=SamplingParamsIn)
    return_logprob: BoolField = False
    top_logprobs_num: Int64Field = 0
    logprob_start_len: Int64Field = -1  # with return_logprob: input_token_logprobs from this prompt position
    rid: str | list[str] | None = None
    stream: bool = False
    return_text_in_logprobs: bool = False  # each logprob entry's third item: the token's text, not null
    # Each MoE layer's experts per position, base64 in meta_info (the server records them:
    # --enable-return-routed-experts; int32 unless --routed-experts-dtype).
    return_routed_experts: bool = False
    # SGLang's, not served here: null (or false) only.
    image_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerateRequest:
        for name in ("image_data", "lora_path", "custom_logit_processor"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported here (text-only models, no LoRA)")
        return self

    def per_prompt(self, num_prompts: int, is_batch: bool) -> PromptParams:
        """Each prompt's engine params, with `n` and the stream interval (SGLang's rules, above);
        raises `InvalidRequest` naming the field that breaks them."""
        sampling = self._each("sampling_params", num_prompts, is_batch)
        logprob, top_n, start = (self._each(name, num_prompts, is_batch) for name in _LOGPROB_FIELDS)
        ns = sorted({sp.n for sp in sampling})
        if len(ns) > 1:
            raise InvalidRequest(f"sampling_params: every prompt's n must be the same, got {ns}")
        listed = [name for name in _LOGPROB_FIELDS if isinstance(getattr(self, name), list)]
        if ns[0] > 1 and listed:
            raise InvalidRequest(f"{listed[0]} can be a list only with n = 1, got n = {ns[0]}")
        routes = self.return_routed_experts
        params = [sp.to_engine(lp, k, s if lp else -1, routes) for sp, lp, k, s in zip(sampling, logprob, top_n, start, strict=True)]
        return PromptParams(params, ns[0], [sp.stream_interval or 1 for sp in sampling])

    def rids(self, num_prompts: int, is_batch: bool) -> list[str] | None:
        """Each prompt's request id (None: fresh ones), as SGLang expands a string for a batch."""
        if isinstance(self.rid, str):
            return [f"{self.rid}_{p}" for p in range(num_prompts)] if is_batch else [self.rid]
        return self.rid

    def _each(self, name: str, num_prompts: int, is_batch: bool) -> list[Any]:
        value = getattr(self, name)
        if not isinstance(value, list):
            return [value] * num_prompts
        if not is_batch:
            raise InvalidRequest(f"{name} is a list, but the prompt is not a batch (give a list of texts or of id lists)")
        if len(value) != num_prompts:
            raise InvalidRequest(f"{name}: {len(value)} values for {num_prompts} prompts")
        return value


# The top-level logprob fields that may be lists, in `SamplingParamsIn.to_engine`'s argument order.
_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len")


@dataclasses.dataclass(frozen=True)
class PromptParams:
    """A `/generate` request's parameters per prompt: engine params, samples per prompt (one `n`
    for all) and tokens per streamed event."""

    params: list[SamplingParams]
    n: int
    stream_intervals: list[int]


class AbortRequestIn(BaseModel):
    rid: str | None = None
    abort_all: bool = False


class PauseGenerationIn(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ReleaseMemoryIn(BaseModel):
    tags: list[str] | None = None  # null or []: all of weights, kv_cache, cuda_graph
    mode: Literal["wait", "abort"] = "wait"


class ResumeMemoryIn(BaseModel):
    tags: list[str] | None = None
    # Wait up to this long for a trainer to free the device before answering 503.
    wait_for_memory_s: float = Field(default=0.0, ge=0.0, le=600.0)
