"""A batched `/generate` with fields given per prompt (SGLang's GenerateReqInput: `sampling_params`,
`return_logprob`, `top_logprobs_num`, `logprob_start_len` as lists), against a real server: each
prompt of the batch gets what the same prompt gets alone with its own fields."""

from __future__ import annotations

import json

import httpx
import pytest
from server_util import ServerProcess

PROMPTS = [[5, 9, 31, 7], [44, 2, 17, 90, 3, 8], [100, 101, 102]]
# Three prompts, three different sets of parameters: lengths, a stop id, a seeded sample.
SAMPLING = [
    {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True, "stop_token_ids": [40]},
    {"max_new_tokens": 5, "temperature": 1.0, "seed": 7, "ignore_eos": True},
]
RETURN_LOGPROB = [True, False, True]
TOP_LOGPROBS_NUM = [0, 0, 2]
LOGPROB_START_LEN = [-1, 0, 1]


def _without_timing(result: dict) -> dict:
    meta = {k: v for k, v in result["meta_info"].items() if k not in ("id", "e2e_latency", "cached_tokens")}
    return result | {"meta_info": meta}


def _close(a: object, b: object) -> bool:
    """Equal up to float rounding (logprobs of one prompt computed in different batches)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def test_per_prompt_fields_match_each_prompt_alone(demo_server: ServerProcess) -> None:
    batch = {"input_ids": PROMPTS, "sampling_params": SAMPLING, "return_logprob": RETURN_LOGPROB,
             "top_logprobs_num": TOP_LOGPROBS_NUM, "logprob_start_len": LOGPROB_START_LEN, "rid": "grp"}
    with demo_server.client() as http:
        r = http.post("/generate", json=batch)
        assert r.status_code == 200, r.text
        assert int(r.headers["content-length"]) == len(r.content) and "transfer-encoding" not in r.headers
        outs = r.json()
        alone = [http.post("/generate", json={
            "input_ids": ids, "sampling_params": sp, "return_logprob": lp, "top_logprobs_num": k, "logprob_start_len": s,
        }).json() for ids, sp, lp, k, s in zip(PROMPTS, SAMPLING, RETURN_LOGPROB, TOP_LOGPROBS_NUM, LOGPROB_START_LEN, strict=True)]
    assert [o["meta_info"]["id"] for o in outs] == ["grp_0", "grp_1", "grp_2"]  # SGLang's expansion of a string rid
    for out, one in zip(outs, alone, strict=True):
        assert _close(_without_timing(out), _without_timing(one)), (out, one)
    assert [o["meta_info"]["completion_tokens"] for o in outs[::2]] == [3, 5]
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 3 and "output_top_logprobs" not in outs[0]["meta_info"]
    assert [len(row) for row in outs[2]["meta_info"]["output_top_logprobs"]] == [2] * 5
    assert len(outs[2]["meta_info"]["input_token_logprobs"]) == len(PROMPTS[2]) - 1  # from position 1


def test_per_prompt_sampling_with_n_and_a_stream(demo_server: ServerProcess) -> None:
    """A list of sampling_params with one n for all: n results per prompt, each prompt's own
    length; streamed, each job's events come at its own prompt's stream_interval."""
    sampling = [{"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "n": 2, "stream_interval": 1},
                {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "n": 2, "stream_interval": 50}]
    body = {"input_ids": PROMPTS[:2], "sampling_params": sampling}
    with demo_server.client() as http:
        outs = http.post("/generate", json=body).json()
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [24, 24, 20, 20]
        assert outs[0]["output_ids"] == outs[1]["output_ids"]  # greedy samples of one prompt
        events: dict[int, list[dict]] = {}
        with http.stream("POST", "/generate", json=body | {"stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    events.setdefault(event["index"], []).append(event)
    assert sorted(events) == [0, 1, 2, 3]
    assert [events[j][-1]["output_ids"] for j in range(4)] == [o["output_ids"] for o in outs]
    # Prompt 1's interval (50) is above its length: only the whole result. Prompt 0's (1): an
    # event per update, so more than one (updates may carry several tokens, never all 24 here).
    assert [len(events[j]) for j in (2, 3)] == [1, 1]
    assert all(len(events[j]) > 1 for j in (0, 1)), {j: len(events[j]) for j in (0, 1)}


BAD = {
    "length": ({"input_ids": PROMPTS, "sampling_params": SAMPLING[:2]}, "sampling_params: 2 values for 3 prompts"),
    "not_a_batch": ({"input_ids": PROMPTS[0], "sampling_params": SAMPLING[:1]}, "sampling_params is a list, but the prompt is not a batch"),
    "text_not_a_batch": ({"text": "hi", "return_logprob": [True]}, "return_logprob is a list, but the prompt is not a batch"),
    "logprob_length": ({"text": ["a", "b"], "top_logprobs_num": [1, 2, 3]}, "top_logprobs_num: 3 values for 2 prompts"),
    "n_differs": ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "every prompt's n must be the same, got [2, 3]"),
    "list_with_n": ({"text": ["a", "b"], "sampling_params": {"n": 2}, "return_logprob": [True, False]},
                    "return_logprob can be a list only with n = 1"),
    "bad_element": ({"text": ["a", "b"], "sampling_params": [{}, {"temperature": "hot"}]}, "sampling_params.1.temperature"),
    "bad_element_unknown": ({"text": ["a", "b"], "sampling_params": [{}, {"temprature": 1}]}, "sampling_params.1.temprature"),
    "bad_single": ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature: Input should be"),
    "not_a_dict": ({"text": ["a", "b"], "sampling_params": [{}, 5]}, "sampling_params.1: Input should be a valid dictionary"),
    "bad_bool": ({"text": ["a", "b"], "return_logprob": [True, "maybe"]}, "return_logprob.1: Input should be a valid boolean"),
    "rid_length": ({"text": ["a", "b"], "rid": ["x"]}, "1 rids for 2 prompts"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_per_prompt_mistakes_are_400s_naming_the_field(demo_server: ServerProcess, case: str) -> None:
    body, needle = BAD[case]
    with demo_server.client() as http:
        r = http.post("/generate", json=body)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert needle in message, message
        assert ".one" not in message and "per_prompt" not in message  # the union's tags name no field
        short = [{"max_new_tokens": 1, "ignore_eos": True}, {"max_new_tokens": 2, "ignore_eos": True}]
        ok = http.post("/generate", json={"text": ["a", "b"], "sampling_params": short})
        assert ok.status_code == 200 and [o["meta_info"]["completion_tokens"] for o in ok.json()] == [1, 2]


def test_openapi_schema_offers_both_shapes(demo_server: ServerProcess) -> None:
    schema = httpx.get(demo_server.url + "/openapi.json").json()
    body = schema["components"]["schemas"]["GenerateRequest"]["properties"]
    for name in ("sampling_params", "return_logprob", "top_logprobs_num", "logprob_start_len"):
        shapes = body[name].get("oneOf") or body[name].get("anyOf")
        assert shapes is not None and any(s.get("type") == "array" for s in shapes), (name, body[name])
