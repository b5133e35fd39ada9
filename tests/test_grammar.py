"""Grammar-constrained decoding (engine/runner/grammar.py, xgrammar) through the real server on the
CPU: SGLang's `json_schema`, `regex` and `ebnf` sampling params on /generate, and the OpenAI chat
route's `response_format`. The tiny random model follows no format of its own, so every sample
that conforms does so because of the mask: sampled at temperature 1 with many seeds, each output
must parse and match its schema (100 % of samples), its regex or its grammar."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from server_util import ServerProcess

# Bounded strings and numbers: with at most 16 whitespace characters in each of the 12 gaps
# (grammar.JSON_WHITESPACE) a sample ends within 256 tokens whatever the model prefers.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
SAMPLES = 8


@pytest.fixture(scope="module")
def http(qwen3_server: ServerProcess):
    # Sampled outputs run their whole budget often: on a loaded machine a request takes longer than 60 s.
    with httpx.Client(base_url=qwen3_server.url, timeout=300.0) as client:
        yield client


def _matches(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "pet"} and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and isinstance(value["age"], int) and 0 <= value["age"] <= 99
            and value["pet"] in ("cat", "dog"))  # fmt: skip


def _generate(http: httpx.Client, **constraint: str) -> list[dict]:
    body = {"text": "Say something:", "sampling_params": {"max_new_tokens": 256, "temperature": 1.0, "n": SAMPLES, "seed": 7, **constraint}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_every_sample_parses_and_matches(http: httpx.Client) -> None:
    outs = _generate(http, json_schema=json.dumps(SCHEMA))
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        # strict=False: xgrammar 0.2's string rule lets a raw control character through after a
        # 4-byte UTF-8 character; Python's parser refuses those unless told.
        assert _matches(json.loads(out["text"], strict=False)), out["text"]
    assert len({o["text"] for o in outs}) > 1  # sampled, not one forced string


def test_regex_and_ebnf(http: httpx.Client) -> None:
    for out in _generate(http, regex=r"[0-9]{3}-(yes|no)"):
        assert re.fullmatch(r"[0-9]{3}-(yes|no)", out["text"]), out["text"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= "a" | "bb" | "ccc"'
    for out in _generate(http, ebnf=grammar):
        assert re.fullmatch(r"\((a|bb|ccc)(,(a|bb|ccc))*\)", out["text"]), out["text"]


def test_bad_grammars_are_400s(http: httpx.Client) -> None:
    for constraint, says in (({"regex": "[0-9"}, "regex does not compile"),
                             ({"json_schema": "{not json"}, "json_schema does not compile"),
                             ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one")):  # fmt: skip
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4, **constraint}}
        r = http.post("/generate", json=body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    ok = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3, "regex": "abc"}})
    assert ok.status_code == 200 and ok.json()["text"] == "abc"  # the engine serves on
    # No stop token at all (ignore_eos): the request ends where its grammar can, and the engine lives.
    free = {"max_new_tokens": 20, "regex": "(ab){1,3}", "ignore_eos": True, "temperature": 1.0, "n": 4, "seed": 1}
    for out in http.post("/generate", json={"text": "x", "sampling_params": free}).json():
        assert out["text"] == "ab" and out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert http.get("/health").status_code == 200


def test_an_install_without_xgrammar_refuses_grammars_and_serves_on(qwen3_dir: str, tmp_path) -> None:
    """A server whose xgrammar does not import (a shim package raising ImportError first on its
    path): a constrained request is a 400 naming the package; the engine lives and serves."""
    shim = tmp_path / "shim" / "xgrammar"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("xgrammar is not installed here")\n')
    path = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))
    server = ServerProcess(qwen3_dir, "--max-model-len", "256", env={"PYTHONPATH": path},
                           log_path=str(tmp_path / "server.log"))  # fmt: skip
    try:
        with server.client() as client:
            r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3, "regex": "abc"}})
            assert r.status_code == 400 and "xgrammar" in r.json()["error"]["message"], r.text
            ok = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3}})
            assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3, ok.text
            assert client.get("/health").status_code == 200
    finally:
        server.stop()


def test_openai_response_format(http: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    body = {"messages": [{"role": "user", "content": "Who?"}], "response_format": fmt, "n": 8, "seed": 3,
            "temperature": 1.0, "max_tokens": 256}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and _matches(json.loads(choice["message"]["content"], strict=False))
    bad = http.post("/v1/chat/completions", json=body | {"response_format": {"type": "yaml"}})
    assert bad.status_code == 400 and "response_format.type" in bad.json()["error"]["message"]
