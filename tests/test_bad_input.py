"""Bad input is a 400 with a JSON error naming the problem, on a connection that stays open, while
other requests run on unharmed: lone UTF-16 surrogates in any string, token ids outside the
vocabulary (echo included), prompts of the wrong shape, and texts far over the context (refused
before tokenizing). Plus the soundness of that refusal's lower bound on the token count.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest
from server_util import BackgroundStream, ServerProcess
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from server.text_input import chars_per_token, min_tokens

CONTEXT = 512  # demo_server's --max-model-len
GEN = {"max_new_tokens": 2}
NORMAL = {"text": "Hello", "sampling_params": GEN}
SURROGATE = "lone UTF-16 surrogate"
TEN_MB = "hello world " * (10_000_000 // 12)


def _raw(text: str) -> bytes:
    """A JSON body written by hand, so that escapes reach the server as written."""
    return text.encode()


# (route, body bytes, words the error message must hold)
BAD: dict[str, tuple[str, bytes, list[str]]] = {
    "text": ("/generate", _raw('{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}'), ["text", SURROGATE, "\\ud800"]),
    "text_batch": ("/generate", _raw('{"text": ["ok", "a\\uDFFFb"]}'), ["text[1]", SURROGATE]),
    "stop": ("/generate", _raw('{"text": "hi", "sampling_params": {"stop": ["\\ud800"]}}'), ["sampling_params.stop[0]", SURROGATE]),
    "stop_str": ("/generate", _raw('{"text": "hi", "sampling_params": {"stop": "x\\uDbFf"}}'), ["sampling_params.stop", SURROGATE]),
    "rid": ("/generate", _raw('{"text": "hi", "rid": "\\udfff"}'), ["rid", SURROGATE]),
    "key": ("/generate", _raw('{"text": "hi", "sampling_params": {"\\ud800": 1}}'), ["a key in sampling_params", SURROGATE]),
    "low_then_high": ("/generate", _raw('{"text": "\\ude00\\ud83d"}'), ["text", SURROGATE]),
    "raw_bytes": ("/generate", b'{"text": "\xed\xa0\x80"}', ["text", SURROGATE]),
    "utf16_body": ("/generate", '{"text": "\ud800"}'.encode("utf-16", "surrogatepass"), ["text", SURROGATE]),
    "completion_prompt": ("/v1/completions", _raw('{"prompt": "\\ud800", "max_tokens": 2}'), ["prompt", SURROGATE]),
    "completion_prompts": ("/v1/completions", _raw('{"prompt": ["ok", "\\ud800"], "max_tokens": 2}'), ["prompt[1]", SURROGATE]),
    "completion_stop": ("/v1/completions", _raw('{"prompt": "hi", "stop": ["\\ud800"]}'), ["stop[0]", SURROGATE]),
    "chat_content": ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
                     ["messages[0].content", SURROGATE]),
    "chat_part": ("/v1/chat/completions",
                  _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
                  ["messages[0].content[0].text", SURROGATE]),
    "chat_role": ("/v1/chat/completions", _raw('{"messages": [{"role": "\\ud800", "content": "hi"}]}'),
                  ["messages[0].role", SURROGATE]),
    "abort_rid": ("/abort_request", _raw('{"rid": "\\ud800"}'), ["rid", SURROGATE]),
    "echo_negative": ("/v1/completions", _raw('{"prompt": [-1, 5], "echo": true, "max_tokens": 2}'),
                      ["token id -1 is outside the vocabulary [0, 512)"]),
    "echo_vocab": ("/v1/completions", _raw('{"prompt": [5, 512], "echo": true, "max_tokens": 2}'),
                   ["token id 512 is outside the vocabulary [0, 512)"]),
    "echo_huge": ("/v1/completions", _raw('{"prompt": [[5], [18446744073709551616]], "echo": true, "max_tokens": 2}'),
                  ["token id 18446744073709551616 is outside the vocabulary [0, 512)"]),
    "echo_stream": ("/v1/completions", _raw('{"prompt": [-7], "echo": true, "stream": true}'),
                    ["token id -7 is outside the vocabulary"]),
    "ids_vocab": ("/generate", _raw('{"input_ids": [5, 512], "sampling_params": {"max_new_tokens": 2}}'),
                  ["token id 512 is outside the vocabulary [0, 512)"]),
    "ids_huge": ("/generate", _raw('{"input_ids": [[1], [100000000000000000000000000000]]}'),
                 ["token id 100000000000000000000000000000 is outside"]),
    "ids_negative": ("/generate", _raw('{"input_ids": [[1, 2], [3, -1]]}'), ["token id -1 is outside"]),
    "ids_too_deep": ("/generate", _raw('{"input_ids": [[[1]]]}'), ["input_ids", "valid integer"]),
    "ids_digits": ("/generate", _raw('{"input_ids": [' + "9" * 5000 + "]}"), ["parsing the body"]),
    "ids_float": ("/generate", _raw('{"input_ids": [1.5]}'), ["input_ids"]),
    "prompt_too_deep": ("/v1/completions", _raw('{"prompt": [[[1]]]}'), ["prompt"]),
    "prompt_mixed": ("/v1/completions", _raw('{"prompt": [1, "a"]}'), ["prompt"]),
    "stop_ids_huge": ("/generate", _raw('{"text": "hi", "sampling_params": {"stop_token_ids": [100000000000000000000000]}}'),
                      ["sampling_params.stop_token_ids"]),
    # Once these killed the engine (the min_new_tokens mask indexed past the logits) or gave NaN logprobs.
    "stop_ids_vocab": ("/generate", _raw('{"text": "hi", "sampling_params": {"stop_token_ids": [3, 100000], "min_new_tokens": 2}}'),
                       ["stop_token_ids token id 100000 is outside the vocabulary [0, 512)"]),
    "min_new_unmeetable": ("/generate", json.dumps({"text": "hi", "sampling_params": {
        "stop_token_ids": list(range(512)), "min_new_tokens": 1}}).encode(), ["min_new_tokens 1 can never be met"]),
    "repetition_float32": ("/generate", _raw('{"text": "hi", "sampling_params": {"repetition_penalty": 6e91}}'),
                           ["repetition_penalty must be a finite number"]),
    "bias_float32": ("/generate", _raw('{"text": "hi", "sampling_params": {"logit_bias": {"5": -1e39}}}'),
                     ["logit_bias values must be finite"]),
    "chat_temperature_float32": ("/v1/chat/completions", _raw(
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e300}'), ["temperature must be a finite"]),
    "weight_version_huge": ("/update_weight_version", _raw('{"new_version": 643575036341766585429386823613808640}'),
                            ["new_version"]),
    "text_10mb": ("/generate", json.dumps({"text": TEN_MB, "sampling_params": GEN}).encode(),
                  ["the prompt is at least", f"over the context length of {CONTEXT}"]),
    "completion_10mb": ("/v1/completions", json.dumps({"prompt": TEN_MB, "max_tokens": 2}).encode(),
                        ["the prompt is at least", f"over the context length of {CONTEXT}"]),
}


def _local_port(response: httpx.Response) -> Any:
    """The client side of the connection that carried `response` (None once it is closed)."""
    try:
        return response.extensions["network_stream"].get_extra_info("client_addr")
    except OSError:
        return None


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_a_400_on_a_kept_connection(demo_server: ServerProcess, name: str) -> None:
    route, body, words = BAD[name]
    beside = BackgroundStream(demo_server.url, {"text": "Meanwhile", "sampling_params": {
        "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}})
    assert beside.started()
    with demo_server.client() as http:
        first = http.post("/generate", json=NORMAL)
        assert first.status_code == 200, first.text
        port = _local_port(first)
        t0 = time.monotonic()
        r = http.post(route, content=body, headers={"content-type": "application/json"})
        took = time.monotonic() - t0
        assert r.status_code == 400, r.text[:500]
        error = r.json()["error"]
        assert set(error) == {"message", "type", "code"} and error["code"] == 400, error
        for word in words:
            assert word in error["message"], (word, error["message"])
        assert "Traceback" not in r.text
        assert _local_port(r) == port, "the connection was replaced"
        after = http.post("/generate", json=NORMAL)
        assert after.status_code == 200, after.text
        assert _local_port(after) == port, "the bad request closed the connection"
    # A refusal by length is immediate: no tokenizing of 10 MB (about 15 s on one core).
    assert took < 5.0 or not name.endswith("10mb"), took
    meta = beside.join()
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 64, meta


VALID = {
    "pair_text": ("/generate", _raw('{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 2}}')),
    "pair_stop": ("/generate", _raw('{"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ["\\uD83D\\uDE00"]}}')),
    "pair_chat": ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}')),
    "escaped_backslash": ("/generate", _raw('{"text": "\\\\ud800", "sampling_params": {"max_new_tokens": 2}}')),
    "utf8_emoji": ("/v1/completions", json.dumps({"prompt": "😀 ok", "max_tokens": 2}, ensure_ascii=False).encode()),
    "echo_ids": ("/v1/completions", _raw('{"prompt": [5, 511], "echo": true, "max_tokens": 2}')),
    "long_but_fits": ("/generate", json.dumps({"text": "hello world " * 60, "sampling_params": GEN}).encode()),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_near_misses_are_served(demo_server: ServerProcess, demo_dir: str, name: str) -> None:
    """A high+low surrogate pair is one character, an escaped backslash is no escape, and a text
    longer than the context in characters may still fit in tokens."""
    route, body = VALID[name]
    r = httpx.post(demo_server.url + route, content=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    if name == "pair_text":
        assert r.json()["meta_info"]["prompt_tokens"] >= 1
    if name == "echo_ids":
        echoed = AutoTokenizer.from_pretrained(demo_dir).decode([5, 511], skip_special_tokens=False)
        assert r.json()["choices"][0]["text"].startswith(echoed)


# Values float32 holds that overflow once applied; each once gave NaN logprobs (a 500 from the
# OpenAI routes, whose JSON has no NaN) or NaN-picked tokens.
EXTREME = {
    "repetition_rounds_to_zero": {"repetition_penalty": 1e-300, "presence_penalty": -2.0},
    "repetition_float32_max": {"repetition_penalty": 3.0e38},
    "bias_float32_edge": {"logit_bias": {"5": 3.0e38, "6": 3.0e38, "7": -3.0e38}, "temperature": 2e-6},
    "temperature_below_eps": {"temperature": 1e-30, "repetition_penalty": 1.5},
}


CHAT_FIELDS = ("temperature", "repetition_penalty", "presence_penalty")  # the chat route takes no logit_bias


@pytest.mark.parametrize("name", sorted(EXTREME))
def test_extreme_sampling_values_give_numbers(demo_server: ServerProcess, name: str) -> None:
    """Every logprob is a number on /generate (where non-finite floats would be null) and the
    chat route answers 200 with its logprobs; a temperature below 1e-6 samples greedily."""
    params = EXTREME[name] | {"max_new_tokens": 8, "ignore_eos": True}
    with demo_server.client() as http:
        for seed in range(4):
            r = http.post("/generate", json={"text": "None None hello", "return_logprob": True, "top_logprobs_num": 3,
                                              "sampling_params": params | {"seed": seed}})
            assert r.status_code == 200, r.text[:500]
            meta = r.json()["meta_info"]
            values = [lp for lp, _, _ in meta["output_token_logprobs"]]
            values += [lp for top in meta["output_top_logprobs"] for lp, _, _ in top]
            assert len(values) == 8 * 4 and all(isinstance(v, float) for v in values), meta
            chat = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "None None"}], "logprobs": True, "top_logprobs": 3,
                "max_tokens": 8, "seed": seed, **{k: v for k, v in params.items() if k in CHAT_FIELDS}})
            assert chat.status_code == 200, chat.text[:500]
        if name == "temperature_below_eps":
            greedy = http.post("/generate", json={"text": "None None hello", "sampling_params": params | {"temperature": 0}})
            assert r.json()["output_ids"] == greedy.json()["output_ids"]


# ---- the lower bound on tokens ------------------------------------------------------------------

_SAMPLES = ["hello world ", "     ", "é", "e\u0301", "\u1100\u1161\u11a8", "😀", "中文字", "<|im_start|>", "\n\n", "ab",
            "\u03b1\u0313\u0300\u0345", "ﬁ", "İ", "\x00", "▁"]


_UNSEEN = ["Ω", "🙂", "\u0301\u0301"]  # not in the training corpus of _trained's tokenizers


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = _SAMPLES + _UNSEEN
    return ["".join(rng.choice(pieces) * rng.randrange(1, 40) for _ in range(rng.randrange(1, 60))) for _ in range(200)]


def _trained(normalizer: Any, pre_tokenizer: Any, alphabet: list[str] | None = None, **model: Any) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(**model))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    corpus = [s * 8 for s in _SAMPLES] + ["hello world " * 20, "the quick brown fox"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|im_start|>"],
                                                         initial_alphabet=alphabet or [], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_the_token_bound_is_sound(demo_dir: str) -> None:
    """For each pipeline the bound allows, no text has fewer tokens than the bound says."""
    tokenizers = {
        "demo": AutoTokenizer.from_pretrained(demo_dir),
        "nfc_metaspace": _trained(normalizers.NFC(), pre_tokenizers.Metaspace(), unk_token="<unk>"),
        "nfkc_lower_bytelevel": _trained(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False), pre_tokenizers.ByteLevel.alphabet()),
        "unk_not_fused": _trained(None, pre_tokenizers.Split("o", "isolated"), unk_token="<unk>"),
    }
    for name, tok in tokenizers.items():
        assert chars_per_token(tok) is not None, name
        for text in _texts(len(name)):
            assert len(tok.encode(text, add_special_tokens=False)) >= min_tokens(tok, len(text)), (name, text)


def test_no_bound_where_characters_can_vanish() -> None:
    """Pipelines that drop or fuse characters get no bound (their texts are tokenized whole)."""
    assert chars_per_token(_trained(None, pre_tokenizers.Whitespace())) is None
    assert chars_per_token(_trained(normalizers.Strip(), pre_tokenizers.Metaspace(), unk_token="<unk>")) is None
    assert chars_per_token(_trained(None, pre_tokenizers.Metaspace(), unk_token="<unk>", fuse_unk=True)) is None
    assert chars_per_token(_trained(normalizers.Replace("  ", " "), pre_tokenizers.Metaspace(), unk_token="<unk>")) is None
    # Neither an unknown token nor byte tokens: BPE drops the characters it has no token for.
    assert chars_per_token(_trained(None, pre_tokenizers.Metaspace())) is None
    assert chars_per_token(_trained(None, pre_tokenizers.Metaspace(), byte_fallback=True)) is None
