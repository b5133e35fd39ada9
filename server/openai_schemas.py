"""Request bodies of the OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`).

Rules:
- OpenAI's field names, plus vLLM's sampling extensions (top_k, min_p, repetition_penalty,
  min_tokens, ignore_eos, stop_token_ids, skip_special_tokens), which clients send at top level
  (the `openai` client's `extra_body`).
- `model` is checked by the route against the served names (server/model_names.py).
- A null field means its default, as OpenAI documents. Unknown fields are ignored (clients send
  extras), but known fields that would change the output and that we cannot honour
  (logit_bias, suffix, best_of) are refused, never silently dropped.
- `response_format` (`json_object`, `json_schema`, `structural_tag`) and vLLM's structured
  outputs (server/output_constraints.py), or a chat's forced `tool_choice`, constrain the output
  by grammar (engine/runner/grammar.py); tools: server/tool_calls.py.
- Renamed fields (max_tokens, min_tokens, logprobs) are bounded here, so a 400 names the OpenAI
  field; the rest are checked by `engine.request.SamplingParams`, which names them the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequest
from engine.request import SamplingParams
from server.generation import check_vocab
from server.output_constraints import OutputConstraints
from server.schemas import MAX_N, Int64
from server.text_input import encode_text
from server.tool_calls import ToolChoice

# The most top logprobs a request may ask for (as vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAISampling(OutputConstraints):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    n: int = Field(default=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None  # read only when streaming
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # ignored
    return_token_ids: bool = False  # vLLM's: the ids of the prompt and of each choice's text
    logit_bias: dict[str, float] | None = None  # refused unless empty

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported")

    def sampling_params(
        self, max_new_tokens: int, logprobs: bool, top_logprobs_num: int, logprob_start_len: int = -1,
        constraint: Mapping[str, str] | None = None,
    ) -> SamplingParams:
        """The engine's params; raises `InvalidRequest` naming a bad value."""

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1),
            min_p=pick(self.min_p, 0.0),
            seed=self.seed,
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            ignore_eos=self.ignore_eos,
            stop=pick(self.stop, ()),
            stop_token_ids=pick(self.stop_token_ids, ()),
            logprobs=logprobs,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            skip_special_tokens=self.skip_special_tokens,
            **(constraint or {}),
        )


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default is 16; null means "up to the context length" (as vLLM); 0 only with echo
    # (the prompt scored, nothing generated).
    max_tokens: int | None = Field(default=16, ge=0)
    # Legacy logprobs: an int, the number of top alternatives per token (0: the sampled one only).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        self.constraint()  # a bad response_format is a 400 before anything runs
        if self.suffix:
            raise InvalidRequest("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (leave it unset or equal to n)")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens: 0 generates nothing; it is allowed only with echo (to score the prompt)")

    def prompts(self, tokenizer: Any, info: Mapping[str, Any]) -> tuple[list[list[int]], list[str] | None]:
        """Token ids of each prompt, and its text when echo is on (token-id prompts decoded).

        `info` is the engine's (`vocab_size`, `max_context_length`): a text prompt surely over the
        context is refused before tokenizing (server.text_input). Token-id prompts are
        range-checked here only when echo decodes them (the tokenizer cannot decode an id outside
        its range); check_prompt checks them all later."""
        p = self.prompt
        if isinstance(p, str):
            texts = [p]
        elif not p:
            raise InvalidRequest("the prompt is empty")
        elif isinstance(p[0], str):
            texts = list(p)
        else:
            ids = [list(p)] if isinstance(p[0], int) else [list(x) for x in p]
            if not self.echo:
                return ids, None
            for x in ids:
                check_vocab(x, info["vocab_size"])
            return ids, [tokenizer.decode(x, skip_special_tokens=False) for x in ids]
        limit = info["max_context_length"]
        return [encode_text(tokenizer, t, limit) for t in texts], texts if self.echo else None


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_call_id, ...) go to the chat template unchanged, but
    an assistant's `tool_calls` give the template their arguments as objects (vLLM's rule: the
    templates write them with `tojson`)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self, i: int) -> dict[str, Any]:
        """The message as a chat template reads it: content a string; text parts are joined with
        newlines (as vLLM does), and other part types (images, audio) are refused."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}]: only parts of type 'text' with a string 'text' "
                        f"are supported, got type {part.get('type')!r}"
                    )
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif self.content is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            msg["tool_calls"] = [_with_object_arguments(c) for c in calls]
        return msg


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        return call | {"function": fn | {"arguments": json.loads(fn["arguments"])}}
    except json.JSONDecodeError:
        return call


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # max_completion_tokens wins over the older max_tokens; neither: up to the context length.
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's chat-template extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        self.constraint()  # a bad response_format or tool_choice is a 400 before anything runs
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true")

    def tool_choice_of(self, parser: str = "hermes") -> ToolChoice | None:
        return ToolChoice.of(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def constraint(self, forced: dict[str, tuple[str, str]] | None = None) -> dict[str, str]:
        """The engine's grammar param: a forced tool choice's schema counts as one constraint
        beside response_format and the structured outputs (server/output_constraints.py)."""
        tools = self.tool_choice_of()
        schema = None if tools is None else tools.json_schema()
        own = {"tool_choice": ("json_schema", schema)} if schema is not None else {}
        return super().constraint({**own, **(forced or {})})

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]
