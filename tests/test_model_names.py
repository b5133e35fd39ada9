"""`--served-model-name` and the `model` of the OpenAI routes, as vLLM treats them: the served
names are listed and accepted, the checkpoint's path is accepted (RL clients send it), a missing
model means the served one, any other name is a 404 `model_not_found`; SGLang's /generate has no
model field and is unaffected."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_util import ServerProcess, logged_server

from server.model_names import ModelNames, ModelNotServed

openai = pytest.importorskip("openai")

NAMES = ("tiny-chat", "org/tiny-chat-v2")
COMPLETION = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(demo_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = logged_server(demo_dir, str(tmp_path_factory.mktemp("logs")), "model_names", "--served-model-name", *NAMES)
    try:
        yield proc
    finally:
        proc.stop()


def test_models_lists_every_served_name(server: ServerProcess, demo_dir: str) -> None:
    with server.client() as http:
        data = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in data] == list(NAMES)
        assert {m["root"] for m in data} == {demo_dir}
        assert http.get("/get_server_info").json()["served_model_name"] == NAMES[0]


@pytest.mark.parametrize("route,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_served_names_the_checkpoint_path_and_no_name_are_answered(
    server: ServerProcess, demo_dir: str, route: str, body: dict
) -> None:
    with server.client() as http:
        for model in (*NAMES, demo_dir, None, ""):
            r = http.post(route, json=body | ({"model": model} if model is not None else {}))
            assert r.status_code == 200, (model, r.text)
            assert r.json()["model"] == NAMES[0]


@pytest.mark.parametrize("route,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_an_unknown_model_is_a_404_model_not_found(server: ServerProcess, route: str, body: dict) -> None:
    with server.client() as http:
        r = http.post(route, json=body | {"model": "gpt-4o", "stream": True})
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "gpt-4o" in error["message"] and NAMES[0] in error["message"]
        assert http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        info = http.get("/get_server_info").json()
        assert info["num_running"] == 0 and info["num_waiting"] == 0


def test_the_openai_client_raises_not_found(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert e.value.code == "model_not_found"
    assert client.completions.create(model=NAMES[1], prompt="Hello", max_tokens=2).model == NAMES[0]


def test_the_default_served_name_is_the_model_as_given(tmp_path) -> None:
    names = ModelNames.of([], "/ckpt/qwen")
    assert names.served == ("/ckpt/qwen",)
    names.check("/ckpt/qwen")
    names.check(None)
    with pytest.raises(ModelNotServed, match="'other'"):
        names.check("other")
    linked = tmp_path / "link"
    linked.symlink_to(tmp_path)
    ModelNames.of(["a", "a", "b"], str(linked)).check(str(tmp_path))  # the real path of the checkpoint
    assert ModelNames.of(["a", "a", "b"], str(linked)).served == ("a", "b")


def test_the_cli_takes_several_names() -> None:
    from server.cli import build_parser

    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["serve"]).served_model_name is None
