"""Device memory as the driver sees it, read without opening a CUDA context in this process (one
costs hundreds of MiB and would blur the readings): NVML through pynvml, else nvidia-smi. Used by
bench_memory.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

MIB = 1 << 20


def gpu_index() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class GpuMeter:
    """The driver's view of device memory: NVML through pynvml, else nvidia-smi (MiB steps)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
            self.source = "nvml"
        except Exception as e:
            if shutil.which("nvidia-smi") is None:
                raise RuntimeError(f"neither NVML ({type(e).__name__}: {e}) nor nvidia-smi: no NVIDIA GPU here?") from None
            self.source = "nvidia-smi"

    def _smi(self, *query: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [[s.strip() for s in line.split(",")] for line in out.splitlines() if line.strip()]

    def name(self) -> str:
        if self.nvml is not None:
            name = self.nvml.nvmlDeviceGetName(self.handle)
            return name.decode() if isinstance(name, bytes) else str(name)
        return self._smi("--query-gpu=name", "-i", str(self.index))[0][0]

    def used_total(self) -> tuple[int, int]:
        """(used, total) bytes, used = total - free: every process's memory and the driver's."""
        if self.nvml is not None:
            info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return int(info.total - info.free), int(info.total)
        total, free = self._smi("--query-gpu=memory.total,memory.free", "-i", str(self.index))[0]
        return (int(total) - int(free)) * MIB, int(total) * MIB

    def used(self) -> int:
        return self.used_total()[0]

    def process_used(self, pid: int) -> int | None:
        """One process's device memory; None when the driver does not list the pid."""
        try:
            if self.nvml is not None:
                for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                    if p.pid == pid:
                        return int(p.usedGpuMemory) if isinstance(p.usedGpuMemory, int) else None
                return None
            for row in self._smi("--query-compute-apps=pid,used_memory"):
                if len(row) == 2 and row[0] == str(pid) and row[1].isdigit():
                    return int(row[1]) * MIB
        except Exception:
            return None
        return None

    def wait_used_at_most(self, limit: int, timeout_s: float = 30.0) -> int:
        """Memory of a process that exited comes back as the driver tears it down: wait for it."""
        deadline = time.monotonic() + timeout_s
        used = self.used()
        while used > limit and time.monotonic() < deadline:
            time.sleep(0.1)
            used = self.used()
        return used


class EngineMemory:
    """Readings of the engine process's device memory: per process (NVML) and device-wide
    against the baseline read before it started."""

    def __init__(self, meter: GpuMeter, pid: int, baseline_used: int) -> None:
        self.meter, self.pid, self.baseline = meter, pid, baseline_used

    def read(self) -> dict[str, int | None]:
        return {"per_pid": self.meter.process_used(self.pid), "device": self.meter.used() - self.baseline}


def pick(readings: list[dict[str, int | None]]) -> str:
    """Per process where every reading has it, else device-wide for all."""
    return "per_pid" if all(r.get("per_pid") is not None for r in readings) else "device"
