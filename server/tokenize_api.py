"""`/tokenize` and `/detokenize` in vLLM's and SGLang's shapes, one answer serving both.

- tokenize `{prompt, add_special_tokens: true, return_token_strs: false}` (vLLM's; SGLang's also
  takes a list of prompts) -> `{tokens, count, max_model_len}` (+ `token_strs` when asked); a
  list of prompts answers lists. `text` is accepted as SGLang's older name of `prompt`.
- tokenize `{messages, add_generation_prompt: true, continue_final_message, tools,
  chat_template_kwargs}` (vLLM's chat form): the ids the chat template gives, as
  /v1/chat/completions would prompt the model.
- detokenize `{tokens}` (a list of ids, or SGLang's list of lists) -> `{prompt, text}`: vLLM reads
  `prompt`, SGLang `text` (a list for a list of lists). Ids outside the vocabulary are a 400.
- `model`, when given, must be served (404 otherwise). Served at `/tokenize`, `/detokenize` and
  under `/v1/` (SGLang's names).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequest
from server.generation import check_vocab
from server.schemas import Int64

router = APIRouter()

# The most prompts (or id lists) one request may carry.
MAX_ITEMS = 1024


class TokenizeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str] | None = None
    text: str | list[str] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Int64] | list[list[Int64]] = Field(max_length=1 << 20)


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeIn, request: Request) -> dict[str, Any]:
    client = request.app.state.client
    request.app.state.model_names.check(body.model)
    if sum(x is not None for x in (body.prompt, body.text, body.messages)) != 1:
        raise InvalidRequest("give exactly one of `prompt`, `text` and `messages`")
    tok = client.tokenizer
    if body.messages is not None:
        ids, one = [_chat_ids(tok, body)], True
    else:
        given = body.prompt if body.prompt is not None else body.text
        prompts = [given] if isinstance(given, str) else given
        if not 0 < len(prompts) <= MAX_ITEMS:
            raise InvalidRequest(f"give 1 to {MAX_ITEMS} prompts, got {len(prompts)}")
        ids = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts]
        one = isinstance(given, str)
    answer: dict[str, Any] = {
        "tokens": ids[0] if one else ids, "count": len(ids[0]) if one else [len(i) for i in ids],
        "max_model_len": client.info["max_context_length"],
    }
    if body.return_token_strs:
        strs = [tok.convert_ids_to_tokens(i) for i in ids]
        answer["token_strs"] = strs[0] if one else strs
    return answer


def _chat_ids(tokenizer: Any, body: TokenizeIn) -> list[int]:
    from pydantic import ValidationError

    from server.openai_api import chat_prompt
    from server.openai_schemas import ChatCompletionRequest

    try:
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message,
                                     chat_template_kwargs=body.chat_template_kwargs)  # fmt: skip
    except ValidationError as e:
        raise InvalidRequest(f"messages: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}") from None
    return chat_prompt(tokenizer, chat)


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeIn, request: Request) -> dict[str, Any]:
    client = request.app.state.client
    request.app.state.model_names.check(body.model)
    many = bool(body.tokens) and isinstance(body.tokens[0], list)
    lists: list[list[int]] = body.tokens if many else [body.tokens]  # type: ignore[assignment]
    if len(lists) > MAX_ITEMS:
        raise InvalidRequest(f"give at most {MAX_ITEMS} id lists, got {len(lists)}")
    for ids in lists:
        check_vocab(ids, client.info["vocab_size"])
    try:
        texts = [client.tokenizer.decode(ids) for ids in lists]
    except (ValueError, TypeError, OverflowError) as e:  # an id the tokenizer has no piece for
        raise InvalidRequest(f"cannot detokenize: {e}") from None
    return {"prompt": texts if many else texts[0], "text": texts if many else texts[0]}
