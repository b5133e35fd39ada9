"""Tool calls on /v1/chat/completions (server/tool_calls.py): the Hermes parser (Qwen2.5, Qwen3)
alone, and through the real server with the `openai` client, whole and streamed. The tiny random
model calls no tool of its own will, so its output is steered: by vLLM's structured outputs (a
regex in Hermes' format) for `auto`, by the forced choices' own grammars for `required` and a
named function."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_util import ServerProcess

from server.tool_calls import HermesStream, parse_hermes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'


def test_hermes_parser_whole_and_streamed() -> None:
    text = ('Let me look. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> <tool_call>not json</tool_call> done')  # fmt: skip
    content, calls = parse_hermes(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1} and calls[0]["id"].startswith("call_")
    assert content == "Let me look.  <tool_call>not json</tool_call> done"
    stream, streamed, names = HermesStream(), "", []
    for i, ch in enumerate(text):  # one character at a time: a tag split anywhere
        piece, made = stream.feed(ch, final=i == len(text) - 1)
        assert "<tool" not in piece or "not json" in streamed + piece  # no call's tag leaks into content
        streamed += piece
        names += [c["function"]["name"] for c in made]
    assert names == ["a", "b"] and streamed.strip() == content
    assert parse_hermes("no calls") == ("no calls", [])


@pytest.fixture(scope="module")
def server(demo_dir: str):
    s = ServerProcess(demo_dir, "--max-model-len", "2048")  # the tools' listing alone is ~450 tokens
    yield s
    s.stop()


def test_auto_parses_the_models_calls(server: ServerProcess) -> None:
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 128, "temperature": 1.0, "seed": 1,
            "structured_outputs": {"regex": HERMES}}  # fmt: skip
    with server.client() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        plain = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}).json()
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "choices" in whole, whole
    choice = whole["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    # The tools went through the chat template: the prompt lists them.
    assert whole["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50
    assert "tool_calls" not in plain["choices"][0]["message"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["index"] for tc in streamed] == [0] and streamed[0]["function"] == call["function"]
    assert not any(d.get("content") for d in deltas) and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_and_named_through_the_openai_client(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    # One call each (parallel_tool_calls false: the array holds one), so every sample ends in budget.
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0,
                                       seed=2, max_tokens=160)  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    named = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, TIME], max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert named.choices[0].finish_reason == "stop"
    # An agent's next turn: its call (arguments as JSON text) and the tool's answer render.
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]  # fmt: skip
    after = client.chat.completions.create(model="", messages=history, tools=[WEATHER, TIME], max_tokens=2)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400s(server: ServerProcess) -> None:
    cases = [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
             ({"tools": [{"type": "function"}]}, "tools[0]"),
             ({"tool_choice": "required"}, "tool_choice needs tools"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "one output constraint")]
    with server.client() as http:
        for extra, says in cases:
            r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2} | extra)
            assert r.status_code == 400 and says in r.json()["error"]["message"], (extra, r.text)
        assert http.get("/health").status_code == 200


def test_none_leaves_the_text(server: ServerProcess) -> None:
    with server.client() as http:
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 128,
                "structured_outputs": {"regex": HERMES}}  # fmt: skip
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "<tool_call>" in choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert isinstance(httpx.Response(200, json=choice).json(), dict)
