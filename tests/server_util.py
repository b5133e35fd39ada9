"""A real `siesta serve` in a subprocess on a free loopback port, for the HTTP tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator

import httpx

STARTUP_TIMEOUT_S = 120.0
STREAM_CAP_S = 900.0  # the longest a BackgroundStream may take in all, however it progresses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server.cli serve --model DIR --device cpu ...`, ready when /health says 200.
    `port` restarts a server on the URL a stopped one had (a gateway knows workers by URL)."""

    def __init__(
        self, model: str | None, *args: str, api_key: str | None = None, log_path: str | None = None,
        env: dict[str, str] | None = None, port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), "--device", "cpu", *args]
        if model is not None:
            cmd += ["--model", model, "--dtype", "float32"]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log_path
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0, **kwargs)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"siesta serve exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"siesta serve not healthy within {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def logged_server(model: str, logs: str, name: str, *args: str) -> ServerProcess:
    """A server on `model` (context 512, extra flags `args`) whose log is `{logs}/{name}.log`."""
    return ServerProcess(model, "--max-model-len", "512", *args, log_path=os.path.join(logs, f"{name}.log"))


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s; returns once the process is gone."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream, in order, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield line[len("data: "):]


class BackgroundStream:
    """A streamed `/generate` read on a thread: `events` fills as they come (error events
    included); `started` waits for the first one (the request is running), `join` for the end.
    `headers` are the response's, `done` says whether `[DONE]` ended it, `error` what broke the read."""

    def __init__(self, url: str, body: dict) -> None:
        self.events: list[dict] = []
        self.headers: httpx.Headers | None = None
        self.done = False
        self.error: Exception | None = None
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/generate", json=body | {"stream": True}, timeout=120) as r:
                self.headers = r.headers
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[len("data: "):]))
                        self.done = False  # [DONE] counts only as the stream's last line
                        self._first.set()
        except Exception as e:  # the test reads it; a thread's exception would be lost
            self.error = e

    def started(self, timeout: float = 60) -> bool:
        return self._first.wait(timeout)

    def wait(self, timeout: float = 120) -> list[dict]:
        """Every event, once the stream has ended. Bounded by progress, not by the clock: it fails
        once no event has come for `timeout` seconds (a loaded machine streams slowly, a stuck
        stream not at all), or after STREAM_CAP_S in all."""
        cap = time.monotonic() + STREAM_CAP_S
        seen, moved = -1, time.monotonic()
        while self._thread.is_alive() and time.monotonic() - moved < timeout and time.monotonic() < cap:
            self._thread.join(0.25)
            if len(self.events) != seen:
                seen, moved = len(self.events), time.monotonic()
        assert not self._thread.is_alive(), (
            f"the stream is still open after {len(self.events)} events, none for {time.monotonic() - moved:.0f} s; "
            f"last: {self.events[-1] if self.events else None}"
        )
        assert self.error is None, f"the stream's read failed after {len(self.events)} events: {self.error!r}"
        return self.events

    def join(self, timeout: float = 120) -> dict:
        """The last event's meta_info."""
        return self.wait(timeout)[-1]["meta_info"]
