"""`/v1/completions` with `echo` and `logprobs`: the prompt's tokens scored (their logprobs and
top alternatives), as lm-evaluation-harness asks for loglikelihoods, checked against
`transformers` on the demo model through a real server."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
import torch
from server_util import ServerProcess
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def hf_logprobs(demo_dir: str) -> Any:
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row i is log p(. | ids[: i + 1])."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)

    return run


def _lm_eval_loglikelihood_payload(requests: list[list[int]]) -> dict[str, Any]:
    """lm-evaluation-harness, lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload
    with generate=False (a loglikelihood batch; token-id prompts, its default tokenized_requests)."""
    return {"prompt": requests, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}


def _lm_eval_parse_logprobs(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness, same file, LocalCompletionsAPI.parse_logprobs: the continuation's
    summed logprob (token_logprobs[ctxlen:-1], the last being the generated token) and whether
    each continuation token was the best."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True))
        res.append((sum(token_logprobs), is_greedy))
    return res


def test_lm_eval_loglikelihood_matches_transformers(demo_server: ServerProcess, hf_logprobs: Any) -> None:
    rng = random.Random(5)
    context = [rng.randrange(3, 500) for _ in range(12)]
    greedy = hf_logprobs(context)[-1].argmax().item()
    greedy_next = hf_logprobs([*context, greedy])[-1].argmax().item()
    best = [greedy, greedy_next]  # the continuation greedy decoding would write
    other = [rng.randrange(3, 500) for _ in range(3)]
    requests = [context + best, context + other]
    r = httpx.post(demo_server.url + "/v1/completions", json=_lm_eval_loglikelihood_payload(requests), timeout=60)
    assert r.status_code == 200, r.text
    got = _lm_eval_parse_logprobs(r.json(), [len(context)] * 2)
    for ids, (logprob, is_greedy) in zip(requests, got, strict=True):
        lp = hf_logprobs(ids)
        positions = range(len(context), len(ids))
        want = sum(lp[q - 1, ids[q]].item() for q in positions)
        assert logprob == pytest.approx(want, abs=1e-3)
        assert is_greedy == all(lp[q - 1].argmax().item() == ids[q] for q in positions)
    assert [g for _, g in got] == [True, False]


def test_echo_logprobs_shape_and_top_alternatives(demo_server: ServerProcess, hf_logprobs: Any) -> None:
    """Tokens, logprobs, top alternatives and offsets cover the prompt then the completion; the
    first prompt token has no logprob; the alternatives are transformers' top N."""
    ids = [random.Random(9).randrange(3, 500) for _ in range(10)]
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 3, "echo": True, "ignore_eos": True}
    r = httpx.post(demo_server.url + "/v1/completions", json=body, timeout=60).json()
    [choice] = r["choices"]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == len(lps["text_offset"]) == 14
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["text_offset"][:10] == [len("".join(lps["tokens"][:i])) for i in range(10)]
    assert choice["text"].endswith("".join(lps["tokens"][10:]))
    lp = hf_logprobs(ids)
    for q in range(1, 10):
        assert lps["token_logprobs"][q] == pytest.approx(lp[q - 1, ids[q]].item(), abs=1e-4)
        top = lps["top_logprobs"][q]
        want = lp[q - 1].topk(3)
        assert 3 <= len(top) <= 4 and lps["tokens"][q] in top
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert r["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}


def test_echo_logprobs_stream_equals_whole(demo_server: ServerProcess) -> None:
    """Streamed, the prompt's text and logprobs open each choice in one chunk with its first
    token (as vLLM sends them); the chunks add up to the whole response, for every sample of n."""
    body = {"prompt": "Good morning! How are you", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "echo": True, "n": 2, "ignore_eos": True}
    with httpx.Client(base_url=demo_server.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()
        texts: dict[int, str] = {}
        logprobs: dict[int, dict[str, list]] = {}
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[len("data: "):])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    if c["logprobs"] is None:
                        continue
                    merged = logprobs.setdefault(c["index"], {k: [] for k in c["logprobs"]})
                    for k, v in c["logprobs"].items():
                        merged[k] += v
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        assert logprobs[c["index"]] == c["logprobs"]
        assert c["text"].startswith(body["prompt"]) and c["logprobs"]["token_logprobs"][0] is None


def test_echo_with_max_tokens_zero_scores_the_prompt_only(demo_server: ServerProcess) -> None:
    ids = [7, 8, 9, 10, 11]
    body = {"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True}
    with httpx.Client(base_url=demo_server.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body).json()
        [choice] = r["choices"]
        assert len(choice["logprobs"]["tokens"]) == 5 and choice["finish_reason"] == "length"
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: the token itself
        assert r["usage"]["completion_tokens"] == 0
        refused = http.post("/v1/completions", json=body | {"echo": False})
        assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]
