"""`/generate` with SGLang's `return_text_in_logprobs`: every logprob entry's third item is its
token's text decoded alone (special tokens kept), whole and streamed; without it, null."""

from __future__ import annotations

import json

from server_util import ServerProcess
from transformers import AutoTokenizer


def _entries(meta: dict) -> list[list]:
    """Every [logprob, token id, text] entry of a meta_info, in all four logprob fields."""
    out = list(meta["output_token_logprobs"]) + list(meta["input_token_logprobs"])
    for name in ("output_top_logprobs", "input_top_logprobs"):
        out += [entry for row in meta[name] if row is not None for entry in row]
    return out


def test_logprob_entries_carry_token_texts(demo_server: ServerProcess, demo_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    body = {"text": "Hello there, friend", "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with demo_server.client() as http:
        plain = http.post("/generate", json=body).json()["meta_info"]
        named = http.post("/generate", json=body | {"return_text_in_logprobs": True}).json()["meta_info"]
        with http.stream("POST", "/generate", json=body | {"return_text_in_logprobs": True, "stream": True}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(text is None for _, _, text in _entries(plain))
    entries = _entries(named)
    assert len(entries) == len(_entries(plain)) > 6 + 3 * 6
    assert all(text == tokenizer.decode([tok], skip_special_tokens=False) for _, tok, text in entries)
    assert [e[:2] for e in entries] == [e[:2] for e in _entries(plain)]
    assert _entries(events[-1]["meta_info"]) == entries
