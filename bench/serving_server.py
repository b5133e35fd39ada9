"""The server under test for bench_serving.py, bench_replicas.py, bench_flip.py and
control_storm.py: `siesta serve` started as a user starts it (`Server`), its processes' CPU read
from /proc (`cpu_s`, `cpu_pct`), sampled by py-spy when asked (`py_spy`, `stop_py_spy`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
from bench_runtime import ROOT, free_port, say


def cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads), seconds; None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None
    return None if fields[0] == "Z" else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_pct(before: float | None, after: float | None, wall: float) -> float | None:
    return None if before is None or after is None or wall <= 0 else 100.0 * (after - before) / wall


class Server:
    """`python -m server.cli serve` (what `siesta serve` runs) in a process group of its own, on a
    free loopback port; `stop` ends it and then its engine process, waiting a bounded time for each."""

    def __init__(self, model: str, flags: list[str], log_path: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, *flags, "--host", "127.0.0.1", "--port", str(port)]
        say(f"server: {shlex.join(cmd)} (log: {log_path})")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.engine_pid: int | None = None
        self.api_pids: list[int] = [self.proc.pid]  # every API server process (--api-server-count)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"siesta serve exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    info = httpx.get(f"{self.url}/get_server_info", timeout=30.0).json()
                    self.engine_pid = info["engine_pid"]
                    self.api_pids = [self.proc.pid, *self._helpers()]
                    if len(self.api_pids) >= info["api_server"]["count"]:
                        return info
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"siesta serve not healthy within {timeout_s:.0f} s: see {self.log.name}")

    def _helpers(self) -> list[int]:
        """API server processes 1..N-1: the server's children named `siesta::api<i>` (or, before
        they name themselves, spawned multiprocessing children), never its engine."""
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/comm", "rb") as f:
                    comm = f.read()
            except (OSError, ValueError, IndexError):
                continue
            api = b"siesta::api" in cmdline or comm.startswith(b"siesta::api") or b"spawn_main" in cmdline
            if ppid == self.proc.pid and api and int(entry) != self.engine_pid:
                pids.append(int(entry))
        return pids

    def steps(self) -> int:
        """The engine's step count so far (a section's steps: its tokens per step say how full they ran)."""
        return int(httpx.get(f"{self.url}/get_server_info", timeout=30.0).json()["num_steps"])

    def flush(self) -> None:
        for _ in range(50):  # 400 while requests still run (a client's abort lands late)
            if httpx.post(f"{self.url}/flush_cache", timeout=30.0).status_code == 200:
                return
            time.sleep(0.1)
        raise RuntimeError("flush_cache kept refusing: requests still running")

    def stop(self) -> None:
        """Bounded (about 40 s at most) and deaf to a second Ctrl-C, so it always finishes."""
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            for _ in range(100):  # the engine exits once its parent is gone; else it is killed
                if cpu_s(self.engine_pid) is None:
                    break
                time.sleep(0.1)
            else:
                os.kill(self.engine_pid, signal.SIGKILL)  # type: ignore[arg-type]
        finally:
            signal.signal(signal.SIGINT, old)
        self.log.close()
        say(f"server: stopped (exit {self.proc.returncode})")


def py_spy(binary: str | None, pids: dict[str, int | None], prefix: str) -> list[subprocess.Popen]:
    """Sample each process (idle time too) into `{prefix}.{name}.txt`, py-spy's raw (collapsed
    stack) format, until `stop_py_spy`. None: no profile."""
    if binary is None:
        return []
    procs = [subprocess.Popen([binary, "record", "--pid", str(pid), "--idle", "--nonblocking", "-r", "250", "-f", "raw",
                               "-o", f"{prefix}.{name}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items() if pid is not None]
    time.sleep(1.0)  # attached before the section starts
    return procs


def stop_py_spy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


