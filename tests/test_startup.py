"""`siesta` as a newcomer first meets it: `--help` at once with each default once, a bad `--model`
in one line, a startup that logs each phase with its time (the first line before any heavy
import), named processes in `ps`, and the README's first example run as a script.

Times are bounded against `python -c "import torch"` measured in the same run, not a wall clock:
a CLI that imported torch could not beat it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_util import free_port, stop_process

from engine import Engine, SamplingParams

CLI = [sys.executable, "-m", "server.cli"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 120.0


def _seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, timeout=120)
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def torch_import_s() -> float:
    """How long a Python process that imports torch takes here: the bound a light CLI beats."""
    return _seconds([sys.executable, "-c", "import torch"])


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "serve", *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, **(env or {})})


# ---- --help -------------------------------------------------------------------------------------


def test_help_imports_nothing_heavy(torch_import_s: float) -> None:
    probe = ("import sys; from server.cli import build_parser; build_parser().parse_args(['serve', '--port', '1']);"
             "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
    for args in (["--help"], ["serve", "--help"]):
        took = _seconds([*CLI, *args])
        assert took < torch_import_s, f"siesta {' '.join(args)} took {took:.2f} s, import torch {torch_import_s:.2f} s"


def test_help_prints_each_default_once() -> None:
    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "COLUMNS": "100"}).stdout
    options = re.split(r"\n  (?=-)", out.split("options:", 1)[1])
    flags = [o for o in options if o.startswith("--")]
    assert len(flags) > 20
    for option in flags:
        text = " ".join(option.split())
        assert text.count("(default") == 1, f"default printed {text.count('(default')} times: {text}"


# ---- a bad --model ------------------------------------------------------------------------------


def _one_line_error(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_bad_model_path_is_one_line(tmp_path, qwen3_dir: str) -> None:
    _one_line_error(_serve("--model", str(tmp_path / "does-not-exist")), "does-not-exist", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(_serve("--model", str(empty)), str(empty), "no config.json")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(qwen3_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    _one_line_error(_serve("--model", str(no_weights)), str(no_weights), "no *.safetensors weights")
    _one_line_error(_serve("--model", str(no_weights / "config.json")), "config.json", "not a checkpoint directory")
    _one_line_error(_serve("--model", str(empty), "--mem-fraction", "3"), "mem_fraction")


def test_dummy_weights_need_only_the_config(tmp_path, qwen3_moe_dir: str) -> None:
    """`load_format="dummy"` (vLLM's): a directory without safetensors serves random weights of
    its config's shape, the same on every start (the benchmarks' 30B-A3B shape has no checkpoint)."""
    shape_only = tmp_path / "shape_only"
    shutil.copytree(qwen3_moe_dir, shape_only)
    for f in shape_only.glob("*.safetensors"):
        f.unlink()
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        with Engine(model=str(shape_only), load_format="dummy", device="cpu", dtype="float32", max_model_len=128) as llm:
            runs.append(llm.generate(input_ids=[[3, 1, 4, 1, 5]], sampling_params=greedy)[0].output_ids)
    assert len(runs[0]) == 6 and runs[0] == runs[1]
    with Engine(model=qwen3_moe_dir, device="cpu", dtype="float32", max_model_len=128) as llm:
        assert llm.generate(input_ids=[[3, 1, 4, 1, 5]], sampling_params=greedy)[0].output_ids != runs[0]


def hub_cache(home: str, repo_id: str, checkpoint: str, revision: str = "0123456789abcdef") -> str:
    """`checkpoint` laid out as huggingface_hub caches `repo_id` under HF_HOME `home`; the snapshot."""
    repo = os.path.join(home, "hub", "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", revision)
    shutil.copytree(checkpoint, snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    return snapshot


def test_a_repo_id_missing_from_the_offline_cache_is_one_line(tmp_path, qwen3_dir: str) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    line = _one_line_error(_serve("--model", "siesta-tests/absent", env=env), "'siesta-tests/absent'", "HF_HUB_OFFLINE")
    assert str(tmp_path / "hf") in line
    snapshot = hub_cache(str(tmp_path / "hf"), "siesta-tests/no-weights", qwen3_dir)
    os.unlink(os.path.join(snapshot, "model.safetensors"))
    _one_line_error(_serve("--model", "siesta-tests/no-weights", env=env), snapshot, "no *.safetensors weights")


# ---- a real start from the Hub cache ------------------------------------------------------------


class TimedServer:
    """`siesta serve` whose output lines are kept with the seconds since it was started."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[tuple[float, str]] = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([*CLI, "serve", "--port", str(self.port), *args], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env})
        threading.Thread(target=self._read, daemon=True).start()
        deadline = self.t0 + STARTUP_TIMEOUT_S
        while not self._healthy():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.log}"
            assert time.monotonic() < deadline, f"not healthy in {STARTUP_TIMEOUT_S} s:\n{self.log}"
            time.sleep(0.2)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def log(self) -> str:
        return "\n".join(f"{t:7.2f} {line}" for t, line in self.lines)


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: str) -> Iterator[tuple[TimedServer, str]]:
    """A server on repo id `siesta-tests/tiny-qwen3`, found in a local Hub cache, offline."""
    home = str(tmp_path_factory.mktemp("hf_home"))
    snapshot = hub_cache(home, "siesta-tests/tiny-qwen3", qwen3_dir)
    server = TimedServer("--model", "siesta-tests/tiny-qwen3", "--device", "cpu", "--dtype", "float32",
                         "--max-model-len", "256", env={"HF_HOME": home, "HF_HUB_OFFLINE": "1"})
    try:
        yield server, snapshot
    finally:
        stop_process(server.proc)


def test_a_repo_id_serves_from_the_hub_cache(hub_server: tuple[TimedServer, str]) -> None:
    server, snapshot = hub_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["root"]) for m in models] == [("siesta-tests/tiny-qwen3", snapshot)]
        assert http.get("/get_server_info").json()["model_path"] == snapshot
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
        for name in ("siesta-tests/tiny-qwen3", snapshot):
            r = http.post("/v1/completions", json=body | {"model": name})
            assert r.status_code == 200 and r.json()["model"] == "siesta-tests/tiny-qwen3", r.text


def test_startup_logs_each_phase_with_its_time(hub_server: tuple[TimedServer, str], torch_import_s: float) -> None:
    server, _ = hub_server
    first_at, first = server.lines[0]
    assert first_at < torch_import_s, f"first line after {first_at:.2f} s (import torch: {torch_import_s:.2f} s)"
    assert "siesta-tests/tiny-qwen3" in first
    timed = [r"HTTP server modules imported in \d+\.\d s", r"tokenizer loaded in \d+\.\d s",
             r"engine process \d+ up in \d+\.\d s", r"weights loaded in \d+\.\d+ s", r"KV cache in \d+\.\d+ s: \d+ blocks",
             r"engine core ready in \d+\.\d+ s", r"engine ready in \d+\.\d s"]
    for phase in timed:
        assert re.search(phase, server.log), f"no {phase!r} in the log:\n{server.log}"


def test_the_engine_process_is_named(hub_server: tuple[TimedServer, str]) -> None:
    server, _ = hub_server
    pid = httpx.get(f"{server.url}/get_server_info", timeout=10).json()["engine_pid"]
    with open(f"/proc/{pid}/comm") as f:
        assert f.read().strip() == "siesta::engine"
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0] == b"siesta::engine"


def test_the_memory_report_says_what_holds_the_host_copy(hub_server: tuple[TimedServer, str]) -> None:
    """On a CPU the host copy of the weights is kept in pageable memory (nothing can be pinned)."""
    server, _ = hub_server
    report = httpx.get(f"{server.url}/memory_occupation", timeout=10).json()
    assert report["weights_backup"] == "host" and report["weights_host_copy"] == "pageable"
    assert report["weights_host_copy_bytes"] > 0
    assert "host copy pageable" in server.log, "the startup log names the host copy as the report does"


def test_a_tensor_parallel_worker_is_named(qwen3_dir: str) -> None:
    with Engine(model=qwen3_dir, device="cpu", dtype="float32", tp_size=2, max_model_len=256) as llm:
        worker = llm.get_server_info()["tp_worker_pids"][0]
        names = {}
        for pid in (llm.pid, worker):
            with open(f"/proc/{pid}/comm") as f:
                names[pid] = f.read().strip()
        assert names == {llm.pid: "siesta::engine", worker: "siesta::tp1"}
        assert llm.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2))[0].output_ids


# ---- Engine in a script ---------------------------------------------------------------------------


def _readme_example(model: str) -> str:
    """The README's first Python example, on `model`."""
    with open(os.path.join(REPO, "README.md")) as f:
        code = f.read().split("```python\n", 1)[1].split("```", 1)[0]
    assert "if __name__ == \"__main__\":" in code, "the README's first example has no main guard"
    return code.replace("/tmp/siesta-demo", model)


def _run_script(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})


def test_the_readme_example_runs_as_a_script(tmp_path, demo_dir: str) -> None:
    result = _run_script(tmp_path, _readme_example(demo_dir))
    assert result.returncode == 0, result.stderr
    assert "length" in result.stdout or "stop" in result.stdout


def test_an_engine_started_at_import_time_says_so_in_one_line(tmp_path, demo_dir: str) -> None:
    """Without the main guard the spawned engine process imports the script again: the script
    fails with one line naming the fix, not the spawned child's traceback."""
    code = textwrap.dedent(f"""
        from engine import Engine
        with Engine(model={demo_dir!r}, device="cpu") as llm:
            print(llm.info["architecture"])
    """)
    result = _run_script(tmp_path, code)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "Error:" in line and not line.startswith(" ")]
    assert len(errors) == 1 and 'if __name__ == "__main__":' in errors[0], result.stderr
    assert "multiprocessing" not in result.stderr and len(result.stderr.splitlines()) < 15, result.stderr
