"""Keys, body limits and a dying engine, against real servers on loopback."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_util import ServerProcess

from server.app import ServerConfig
from server.cli import bind_warning


@pytest.fixture(scope="module")
def keyed(demo_dir: str):
    server = ServerProcess(demo_dir, "--admin-api-key", "boss", "--max-request-bytes", "2000", api_key="user")
    yield server
    server.stop()


def _post(server: ServerProcess, path: str, body: dict | None = None, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body or {}, headers=headers, timeout=60)


def test_admin_routes_need_the_admin_key(keyed: ServerProcess) -> None:
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert _post(keyed, "/generate", gen, "user").status_code == 200
    assert _post(keyed, "/generate", gen, "boss").status_code == 200  # the admin key opens everything
    assert _post(keyed, "/generate", gen).status_code == 401
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    admin_calls = [("/release_memory_occupation", {"tags": ["kv_cache"]}), ("/resume_memory_occupation", {}),
                   ("/flush_cache", {}), ("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {}),
                   ("/update_weights_from_disk", {"model_path": "/nowhere"}),
                   ("/destroy_weights_update_group", {"group_name": "g"}),
                   ("/weights_checker", {"action": "checksum"}), ("/post_process_weights", {}),
                   ("/start_profile", {}), ("/stop_profile", {})]
    for path, body in admin_calls:
        user = _post(keyed, path, body, "user")
        assert user.status_code == 403 and "admin" in user.json()["error"]["message"], path
        assert _post(keyed, path, body).status_code == 401, path
    assert _post(keyed, "/release_memory_occupation", {"tags": ["kv_cache"]}, "boss").status_code == 200
    assert _post(keyed, "/resume_memory_occupation", {}, "boss").status_code == 200
    assert _post(keyed, "/abort_request", {"abort_all": True}, "user").status_code == 403
    assert _post(keyed, "/abort_request", {"abort_all": True}, "boss").status_code == 200
    assert _post(keyed, "/abort_request", {"rid": "nobody"}, "user").status_code == 200


def test_large_bodies_get_413(keyed: ServerProcess) -> None:
    big = {"text": "x" * 5000, "sampling_params": {"max_new_tokens": 2}}
    r = _post(keyed, "/generate", big, "user")
    assert r.status_code == 413 and "max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"text": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    r = httpx.post(f"{keyed.url}/generate", content=chunks(), headers={"Authorization": "Bearer user"}, timeout=60)
    assert r.status_code == 413
    assert _post(keyed, "/generate", {"text": "small", "sampling_params": {"max_new_tokens": 2}}, "user").status_code == 200


def test_bind_warning() -> None:
    assert bind_warning(ServerConfig(host="127.0.0.1")) is None
    assert bind_warning(ServerConfig(host="localhost")) is None
    assert bind_warning(ServerConfig(host="::1")) is None
    assert "no --api-key" in bind_warning(ServerConfig(host="0.0.0.0"))
    assert "no --api-key" in bind_warning(ServerConfig(host="my-host.example"))
    assert bind_warning(ServerConfig(host="0.0.0.0", api_key="k")) is None
    assert bind_warning(ServerConfig(host="0.0.0.0", admin_api_key="k")) is None


def test_dead_engine_means_503_then_a_non_zero_exit(demo_dir: str) -> None:
    server = ServerProcess(demo_dir)
    try:
        pid = httpx.get(f"{server.url}/get_server_info").json()["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(f"{server.url}/health", timeout=2).status_code != 503:
            assert time.monotonic() - killed < 2, "/health still 200 two seconds after the engine died"
            time.sleep(0.05)
        server.proc.wait(timeout=10 - (time.monotonic() - killed))
        assert server.proc.returncode not in (0, None)
    finally:
        server.stop()


def test_readme_config_table_is_the_clis() -> None:
    from pathlib import Path

    from server.cli import config_table

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    shown = readme.split("<!-- config-table -->\n")[1].split("\n<!-- /config-table -->")[0]
    assert shown == config_table(), "README's table is stale: paste `siesta config-table` into README.md"
