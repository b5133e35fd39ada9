"""Structural tags (engine/runner/structural_tag.py, compiled by xgrammar) through the real server
on the CPU: free text in which every `<tool_call>` ... `</tool_call>` holds JSON matching its schema.

The tiny random model never spells a tag of its own accord, so: a tagged request whose output
holds no tag must equal the same seeded request unconstrained (the text outside the tags is
free); with `at_least_one` each output opens with a tag, and every tag's content parses and
matches its schema in 100 % of samples (temperature 1, eight seeds a request), because of the mask.

Payload shapes, cited:
- SGLang: python/sglang/srt/entrypoints/openai/protocol.py `LegacyStructuralTagResponseFormat`
  ({type, structures [{begin, schema, end}], triggers, at_least_one}) and xgrammar's
  `StructuralTag` ({type, format}) as `response_format` on /v1/chat/completions and
  /v1/completions; serving_chat.py / serving_completions.py `_build_sampling_params` send it to
  /generate as `sampling_params.structural_tag`, `json.dumps(response_format)`.
- vLLM: vllm/entrypoints/openai/protocol.py `LegacyStructuralTagResponseFormat`,
  `StructuralTagResponseFormat` ({type, format}); `structured_outputs.structural_tag` a JSON
  string (vllm/v1/structured_output/backend_xgrammar.py `XgrammarBackend.compile_grammar`).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_util import ServerProcess

BEGIN, END = "<tool_call>", "</tool_call>"
ARGS = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
LEGACY = {"type": "structural_tag", "structures": [{"begin": BEGIN, "schema": ARGS, "end": END}], "triggers": [BEGIN]}
# xgrammar's form of the same, opening with a tag; two whitespace characters in a row at most.
XGRAMMAR = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": [BEGIN], "at_least_one": True,
    "tags": [{"type": "tag", "begin": BEGIN, "content": {"type": "json_schema", "json_schema": ARGS, "max_whitespace_cnt": 2},
              "end": END}],
}}  # fmt: skip
# 8 gaps of at most 16 whitespace characters (grammar.JSON_WHITESPACE) and the tags: within 160.
BUDGET = 160


@pytest.fixture(scope="module")
def http(qwen3_server: ServerProcess):
    # Sampled outputs run their whole budget often: on a loaded machine a request takes longer than 60 s.
    with httpx.Client(base_url=qwen3_server.url, timeout=300.0) as client:
        yield client




def tool_calls(text: str) -> list[Any]:
    """The JSON of every tag in `text`; fails on a tag that does not close."""
    calls, rest = [], text
    while BEGIN in rest:
        body, closed, rest = rest.split(BEGIN, 1)[1].partition(END)
        assert closed, f"an unclosed tag in {text!r}"
        calls.append(json.loads(body, strict=False))  # xgrammar lets raw control characters into strings
    return calls


def _matches(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str)
            and len(value["name"]) <= 6 and isinstance(value["age"], int) and 0 <= value["age"] <= 99)  # fmt: skip


def _every_sample_opens_with_a_matching_call(texts: list[str]) -> None:
    for text in texts:
        calls = tool_calls(text)
        assert text.startswith(BEGIN) and calls and all(_matches(c) for c in calls), text
    assert len(set(texts)) == len(texts)  # sampled, not one forced string


def _generate(http: httpx.Client, **sampling: Any) -> list[dict]:
    body = {"text": "Say:", "sampling_params": {"max_new_tokens": BUDGET, "temperature": 1.0, "n": 8, "seed": 11} | sampling}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_sglang_generate_text_outside_the_tags_is_free(http: httpx.Client) -> None:
    """sampling_params.structural_tag (SGLang's JSON string): with no tag in the output, the
    constrained samples are the unconstrained ones, token for token."""
    free = _generate(http, max_new_tokens=48)
    tagged = _generate(http, max_new_tokens=48, structural_tag=json.dumps(LEGACY))
    assert [o["output_ids"] for o in tagged] == [o["output_ids"] for o in free]
    assert not any(BEGIN in o["text"] for o in tagged)


def test_sglang_generate_every_tag_parses_and_matches(http: httpx.Client) -> None:
    outs = _generate(http, structural_tag=json.dumps(LEGACY | {"at_least_one": True}), seed=29)
    _every_sample_opens_with_a_matching_call([o["text"] for o in outs])
    assert all(o["text"].index(END) + len(END) < len(o["text"]) for o in outs)  # free text after the tag


def test_openai_response_format_both_forms(http: httpx.Client) -> None:
    """SGLang's and vLLM's {structures, triggers} on chat, xgrammar's {format} on completions."""
    chat = {"messages": [{"role": "user", "content": "Call a tool."}], "n": 8, "seed": 3, "temperature": 1.0,
            "max_tokens": BUDGET, "response_format": LEGACY | {"at_least_one": True}}  # fmt: skip
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    _every_sample_opens_with_a_matching_call([c["message"]["content"] for c in r.json()["choices"]])
    completion = {"prompt": "Call:", "n": 8, "seed": 5, "temperature": 1.0, "max_tokens": 64, "response_format": XGRAMMAR}
    r = http.post("/v1/completions", json=completion)
    assert r.status_code == 200, r.text
    _every_sample_opens_with_a_matching_call([c["text"] for c in r.json()["choices"]])


def test_vllm_structured_outputs_structural_tag(http: httpx.Client) -> None:
    """structured_outputs.structural_tag (a JSON string) on tokens-in generate and on chat."""
    tag = json.dumps(XGRAMMAR)
    body = {"token_ids": [5, 9, 13], "sampling_params": {"max_tokens": 64, "temperature": 1.0, "n": 8, "seed": 17,
                                                         "structured_outputs": {"structural_tag": tag}}}  # fmt: skip
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    texts = [http.post("/detokenize", json={"tokens": c["token_ids"]}).json()["prompt"] for c in r.json()["choices"]]
    _every_sample_opens_with_a_matching_call(texts)
    chat = {"messages": [{"role": "user", "content": "Call a tool."}], "n": 4, "seed": 23, "temperature": 1.0,
            "max_tokens": 64, "structured_outputs": {"structural_tag": tag}}  # fmt: skip
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    _every_sample_opens_with_a_matching_call([c["message"]["content"] for c in r.json()["choices"]])


def test_a_request_with_no_stop_token_runs_on_through_free_text(http: httpx.Client) -> None:
    """ignore_eos: free text may always go on, so the budget ends it (length), never the grammar's
    first chance to end; a format that allows nothing after its tag ends there (stop)."""
    outs = _generate(http, max_new_tokens=24, ignore_eos=True, structural_tag=json.dumps(LEGACY), n=2)
    assert all(len(o["output_ids"]) == 24 and o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    once = json.loads(json.dumps(XGRAMMAR))
    once["format"]["stop_after_first"] = True
    for o in _generate(http, max_new_tokens=64, ignore_eos=True, structural_tag=json.dumps(once), n=4):
        assert o["meta_info"]["finish_reason"]["type"] == "stop" and o["text"].endswith(END), o
        _every_sample_opens_with_a_matching_call([o["text"]])


BAD: list[tuple[Any, str]] = [
    ("{not json", "is not JSON"),
    ({"structures": [{"begin": BEGIN, "schema": ARGS, "end": END}]}, "triggers"),
    ({"structures": [], "triggers": [BEGIN]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "<call>", "schema": ARGS, "end": END}], "triggers": [BEGIN]}, "starts with none of the triggers"),
    ({"structures": [{"begin": BEGIN, "schema": "x", "end": END}], "triggers": [BEGIN]}, "schema must be a JSON schema object"),
    ({"structures": [{"begin": BEGIN, "schema": ARGS, "end": ""}], "triggers": [BEGIN]}, "end must be a non-empty string"),
    ({"type": "regex", "format": {"type": "tag"}}, "must be 'structural_tag'"),
    ({"type": "structural_tag"}, "needs `structures`"),
]


def test_bad_structures_are_400s_naming_the_problem(http: httpx.Client) -> None:
    for spec, says in BAD:
        text = spec if isinstance(spec, str) else json.dumps(spec)
        r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, "structural_tag": text}})
        assert r.status_code == 400 and says in r.json()["error"]["message"], (spec, r.text)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True}
    for spec, says in BAD[1:]:  # a stream is refused before it starts
        if "type" in spec:  # response_format.type is the route's to read
            continue
        r = http.post("/v1/chat/completions", json=chat | {"response_format": {"type": "structural_tag"} | spec})
        assert r.status_code == 400 and says in r.json()["error"]["message"], (spec, r.text)
    # What only xgrammar knows: the engine's compile names it (a whole request's 400).
    deep = [({"type": "structural_tag", "format": {"type": "bogus"}}, "bogus"),
            ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}}, "content"),
            ({"structures": [{"begin": BEGIN, "schema": {"type": "nonsense"}, "end": END}], "triggers": [BEGIN]}, "nonsense")]
    for spec, says in deep:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "response_format": {"type": "structural_tag"} | spec})
        assert r.status_code == 400 and says in r.json()["error"]["message"] and "structural_tag" in r.json()["error"]["message"], r.text
    two = http.post("/v1/completions", json={"prompt": "x", "response_format": LEGACY, "structured_outputs": {"regex": "a"}})
    assert two.status_code == 400 and "give one output constraint" in two.json()["error"]["message"], two.text
    vllm = {"token_ids": [5], "sampling_params": {"structured_outputs": {"structural_tag": "[]"}}}
    r = http.post("/inference/v1/generate", json=vllm)
    assert r.status_code == 400 and "structured_outputs.structural_tag must be a JSON object" in r.json()["error"]["message"]
    assert http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
