"""The OpenAI-compatible routes through the official `openai` client, against a real `siesta serve`
on the demo model (a tiny random model: gibberish, but deterministic when greedy or seeded)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from oracle import hf_greedy
from server_util import ServerProcess
from transformers import AutoTokenizer

from engine.errors import InvalidRequest

openai = pytest.importorskip("openai")  # the dev extra has it; the GPU machine may not

NO_EOS = {"ignore_eos": True}
PROMPT = "Good morning! How are you"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Good morning!"}]


@pytest.fixture(scope="module")
def oai(demo_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(demo_dir: str) -> str:
    """The name the demo server serves: its --model as given (server/model_names.py)."""
    return demo_dir


@pytest.fixture(scope="module")
def tokenizer(demo_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(demo_dir)


def _chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _native(demo_server: ServerProcess, **body: Any) -> dict:
    r = httpx.post(demo_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _engine_idle(demo_server: ServerProcess) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = httpx.get(demo_server.url + "/get_server_info").json()
        if info["num_running"] == 0 and info["kv_blocks_free"] == info["kv_blocks_total"]:
            return True
        time.sleep(0.1)
    return False


def test_models_list(oai: openai.OpenAI, demo_dir: str) -> None:
    models = oai.models.list().data
    assert len(models) == 1
    assert models[0].id == demo_dir and models[0].object == "model"
    assert models[0].to_dict()["max_model_len"] == 512


def test_completion_greedy_matches_generate_and_transformers(
    oai: openai.OpenAI, demo_server: ServerProcess, demo_dir: str, tokenizer: Any, model: str
) -> None:
    ids = tokenizer.encode(PROMPT)
    expected = hf_greedy(demo_dir, [ids], 20)[0]
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=NO_EOS)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == demo_dir
    [c] = r.choices
    native = _native(demo_server, text=PROMPT, sampling_params={"max_new_tokens": 20, "temperature": 0} | NO_EOS)
    assert native["output_ids"] == expected
    assert c.text == native["text"] == tokenizer.decode(expected)
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 20, len(ids) + 20)
    # Token ids as the prompt: the same text.
    by_ids = oai.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0, extra_body=NO_EOS)
    assert by_ids.choices[0].text == c.text
    # Echo puts the prompt in front.
    echoed = oai.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, echo=True, extra_body=NO_EOS)
    assert echoed.choices[0].text == PROMPT + c.text
    # Several prompts and n: prompt-major choices.
    other = "Numbers too"
    both = oai.completions.create(model=model, prompt=[PROMPT, other], n=2, max_tokens=20, temperature=0, extra_body=NO_EOS)
    assert [ch.index for ch in both.choices] == [0, 1, 2, 3]
    texts = [ch.text for ch in both.choices]
    alone = oai.completions.create(model=model, prompt=other, max_tokens=20, temperature=0, extra_body=NO_EOS)
    assert texts == [c.text, c.text, alone.choices[0].text, alone.choices[0].text]
    assert both.usage.prompt_tokens == len(ids) + len(tokenizer.encode(other))
    assert both.usage.completion_tokens == 80


def test_n_with_seed_is_reproducible(oai: openai.OpenAI, model: str) -> None:
    def sample() -> list[str]:
        r = oai.completions.create(model=model, prompt=PROMPT, n=2, seed=3, max_tokens=12, temperature=1.0, extra_body=NO_EOS)
        assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 24
        return [c.text for c in r.choices]

    first = sample()
    assert first[0] != first[1]
    assert sample() == first


def test_completion_logprobs(oai: openai.OpenAI, demo_server: ServerProcess, model: str) -> None:
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] - lp.text_offset[i] == len(lp.tokens[i]) for i in range(5))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the best
    native = _native(demo_server, text=PROMPT, return_logprob=True,
                     sampling_params={"max_new_tokens": 6, "temperature": 0} | NO_EOS)
    native_lps = [t[0] for t in native["meta_info"]["output_token_logprobs"]]
    assert lp.token_logprobs == pytest.approx(native_lps, abs=1e-5)


def test_stop_strings_cut_the_text(oai: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 11, "extra_body": NO_EOS}
    text = oai.completions.create(**args).choices[0].text
    k = next(i for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    stop = text[k:k + 2]
    expected = text[: text.find(stop)]
    r = oai.completions.create(**args, stop=[stop, "never-seen-stop"])
    [c] = r.choices
    assert c.text == expected and c.finish_reason == "stop" and c.to_dict()["stop_reason"] == stop
    chunks = list(oai.completions.create(**args, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streaming_completion_equals_whole(oai: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": [PROMPT, "Numbers"], "n": 2, "max_tokens": 16, "temperature": 0,
            "logprobs": 1, "extra_body": NO_EOS}
    whole = oai.completions.create(**args)
    chunks = list(oai.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1 and all(ch.object == "text_completion" for ch in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert all(ch.usage is None and len(ch.choices) == 1 for ch in body)
    for want in whole.choices:
        mine = [ch.choices[0] for ch in body if ch.choices[0].index == want.index]
        assert "".join(c.text for c in mine) == want.text
        assert [t for c in mine for t in c.logprobs.tokens] == want.logprobs.tokens
        assert [o for c in mine for o in c.logprobs.text_offset] == want.logprobs.text_offset
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]


def test_chat_completion(oai: openai.OpenAI, demo_server: ServerProcess, tokenizer: Any, model: str) -> None:
    ids = _chat_ids(tokenizer, MESSAGES)
    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0, extra_body=NO_EOS)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    [c] = r.choices
    native = _native(demo_server, input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0} | NO_EOS)
    assert c.message.role == "assistant" and c.message.content == native["text"]
    assert c.finish_reason == "length" and c.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 16)
    # Text parts are joined with newlines; one part is the plain string.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Good morning!"}]}]
    same = oai.chat.completions.create(model=model, messages=parts, max_tokens=16, temperature=0, extra_body=NO_EOS)
    assert same.choices[0].message.content == c.message.content
    # max_completion_tokens wins over max_tokens.
    short = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, max_completion_tokens=5,
                                        temperature=0, extra_body=NO_EOS)
    assert short.usage.completion_tokens == 5 and c.message.content.startswith(short.choices[0].message.content)


def test_streaming_chat_equals_whole(oai: openai.OpenAI, model: str) -> None:
    args = {"model": model, "messages": MESSAGES, "n": 2, "max_tokens": 16, "temperature": 0,
            "logprobs": True, "top_logprobs": 1, "extra_body": NO_EOS}
    whole = oai.chat.completions.create(**args)
    chunks = list(oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    for want in whole.choices:
        mine = [ch.choices[0] for ch in body if ch.choices[0].index == want.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == want.message.content
        streamed = [e for c in mine if c.logprobs is not None for e in c.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in want.logprobs.content]
        assert mine[-1].finish_reason == "length"


def test_chat_logprobs(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_abort_and_disconnect_end_requests(oai: openai.OpenAI, demo_server: ServerProcess, model: str) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 450, "temperature": 0, "stream": True} | NO_EOS
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[len("data: "):])
        assert first["choices"][0]["delta"]["role"] == "assistant"
        # At once: the engine has the request as soon as the stream has started.
        aborted = httpx.post(demo_server.url + "/abort_request", json={"rid": first["id"]}).json()
        assert aborted["num_aborted"] == 1
        rest = [line[len("data: "):] for line in lines]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    # A client that goes away mid-stream aborts its request.
    before = _disconnected(demo_server)
    with httpx.stream("POST", demo_server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 480,
                      "temperature": 0, "stream": True} | NO_EOS, timeout=60) as r:
        next(r.iter_lines())
    assert _engine_idle(demo_server)
    assert _disconnected(demo_server) == before + 1


def _disconnected(demo_server: ServerProcess) -> float:
    """Requests the server saw end by their client going away."""
    for line in httpx.get(demo_server.url + "/metrics").text.splitlines():
        if line.startswith('siesta_requests_total{outcome="disconnected"}'):
            return float(line.split()[-1])
    return 0.0


BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 0}, "n must be"),
    ("completions", {"prompt": "x", "max_tokens": 600}, "context length"),
    ("completions", {"prompt": ""}, "empty"),
    ("completions", {"prompt": []}, "empty"),
    ("completions", {"prompt": [1, 99999]}, "vocabulary"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "extra_body": {"top_k": -5}}, "top_k"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"content": "hi"}]}, "role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": MESSAGES, "max_tokens": 600}, "context length"),
    ("chat", {"messages": MESSAGES, "temperature": -1}, "temperature"),
    ("chat", {"messages": MESSAGES, "n": 0}, "n must be"),
]


@pytest.mark.parametrize("route,args,needle", BAD, ids=[f"{r}-{n}" for r, _, n in BAD])
def test_bad_input_is_a_400(oai: openai.OpenAI, route: str, args: dict, needle: str, model: str) -> None:
    create = oai.completions.create if route == "completions" else oai.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model=model, **args)
    assert e.value.status_code == 400 and needle in str(e.value)


def test_chat_template_problems_are_invalid_requests(tokenizer: Any) -> None:
    from server.openai_api import chat_prompt
    from server.openai_schemas import ChatCompletionRequest

    body = ChatCompletionRequest(messages=MESSAGES)
    assert chat_prompt(tokenizer, body) == _chat_ids(tokenizer, MESSAGES)
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        chat_prompt(plain, body)
    plain.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        chat_prompt(plain, body)


def test_return_token_ids(oai: openai.OpenAI, model: str, tokenizer: Any) -> None:
    """vLLM's `return_token_ids`: a completion choice carries its prompt's ids and its own, a chat
    response the prompt's at the top; the ids decode to the text, and a stream's pieces join to
    the whole response's."""
    ids = tokenizer(PROMPT)["input_ids"]
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True, **NO_EOS})
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 8
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True, **NO_EOS}).model_dump()
    assert chat["prompt_token_ids"] == _chat_ids(tokenizer, MESSAGES)
    assert tokenizer.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    stream = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"return_token_ids": True, **NO_EOS})
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == chat["choices"][0]["token_ids"]
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=2).model_dump()
    assert "token_ids" not in plain["choices"][0]
