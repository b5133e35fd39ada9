"""bench_flip.py's calls to the server: `Http` times each call's wall around it, `Beside` runs a
call in a thread (one the server answers only once this process has joined a collective), and
`Poster` posts from a process of its own, as an RL trainer's rollout actor does."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx


class Http:
    """POST/GET with the wall time around each call; a non-200 answer raises with its body."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.client = httpx.Client(base_url=url, timeout=timeout_s)

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[Any, float]:
        t = time.perf_counter()
        r = self.client.post(path, json=body or {})
        wall = time.perf_counter() - t
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:2000]}")
        return r.json(), wall

    def get(self, path: str) -> Any:
        r = self.client.get(path)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path}: HTTP {r.status_code}: {r.text[:2000]}")
        return r.json()

    def close(self) -> None:
        self.client.close()


class Beside:
    """`fn(*a)` in a thread (an HTTP call the server answers only once this process has joined
    a collective); `result` joins it and returns its value or raises."""

    def __init__(self, fn: Any, *a: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, *a))
        self.thread.start()

    def _run(self, fn: Any, *a: Any) -> None:
        try:
            self.value = fn(*a)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def result(self, what: str) -> Any:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"{what}: {self.error}") from self.error
        return self.value


def _post_loop(url: str, timeout_s: float, conn: Any) -> None:
    """The child of `Poster`: POST each (path, body) it is sent; send back (status, json, when
    the call went out, when its answer was in), times on the host's monotonic clock."""
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        conn.send("ready")
        while (job := conn.recv()) is not None:
            t = time.monotonic()
            try:
                r = client.post(job[0], json=job[1])
                value = r.json() if r.status_code == 200 else r.text[:2000]
                conn.send((r.status_code, value, t, time.monotonic()))
            except Exception as e:  # noqa: BLE001 - sent back, raised by result()
                conn.send((None, repr(e), t, time.monotonic()))


class Poster:
    """An HTTP client in its own process, as an RL trainer's call to a rollout server goes out
    from another process (slime: the engine's Ray actor posts while the trainer broadcasts), so
    that this process's collective launches and waits do not share a GIL with the request."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_post_loop, args=(url, timeout_s, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the HTTP poster process did not start")

    def start(self, path: str, body: dict[str, Any]) -> Poster:
        """POST `body` to `path` from the child; `result` waits for its answer."""
        self.conn.send((path, body))
        return self

    def result(self, what: str) -> tuple[Any, float, float]:
        """The answer, when the call went out and when the answer was in (time.monotonic)."""
        status, value, sent, answered = self.conn.recv()
        if status != 200:
            raise RuntimeError(f"{what}: HTTP {status}: {value}")
        return value, sent, answered

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
