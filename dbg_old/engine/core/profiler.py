"""Profiling of the engine process, as SGLang's `/start_profile` and `/stop_profile` do it: a
`torch.profiler` trace of the engine's steps, written as a Chrome trace.

Rules:
- One profile at a time: a start while one runs (or waits for its `start_step`) is refused.
- `output_dir`: where the trace goes; default the SGLANG_TORCH_PROFILER_DIR environment variable,
  else a fresh temporary directory. The answer names the directory and the file.
- `activities`: CPU and GPU (CUDA kernels; dropped, and said so, on a CPU engine), default both;
  MEM records CUDA allocations and dumps a memory snapshot (`.pickle`) next to the trace (CUDA
  only). Anything else (RPD, CUDA_PROFILER) is refused.
- `start_step`: profiling starts when the engine has run that many steps (now if already past).
  `num_steps`: profiling stops by itself after that many engine steps; `/stop_profile` then
  answers with the files written. Without it, `/stop_profile` stops it.
- `with_stack` and `record_shapes` default to true, as SGLang's. `profile_by_stage` (separate
  prefill and decode traces) and `merge_profiles` are not implemented: refused when true.
- The file is `{profile_prefix-}{profile_id}-TP-0.trace.json.gz` (SGLang's name on one GPU).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any

import torch

from engine.core import calls

log = logging.getLogger("siesta.engine")

ENV_DIR = "SGLANG_TORCH_PROFILER_DIR"
ACTIVITIES = ("CPU", "GPU", "MEM")


class StepProfiler:
    """The profile in progress (or waiting to start), counted in engine steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.profiler: torch.profiler.profile | None = None
        self.settings: dict[str, Any] | None = None  # set from start until the profile is written
        self.started = False  # recording (after start_step)
        self.start_at = 0  # the engine step at which it starts
        self.stop_at: int | None = None  # the engine step after which it stops by itself
        self.written: list[str] = []  # files of the last profile that stopped by itself

    @property
    def active(self) -> bool:
        return self.settings is not None

    def start(self, step: int, output_dir: str | None, start_step: int | None, num_steps: int | None,
              activities: list[str] | None, with_stack: bool | None, record_shapes: bool | None,
              profile_id: str | None, profile_prefix: str | None) -> dict[str, Any]:
        if self.active:
            raise ValueError("a profile is already running: call /stop_profile first")
        wanted = list(activities) if activities else ["CPU", "GPU"]
        unknown = [a for a in wanted if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"activities {unknown} are not supported here; use a subset of {list(ACTIVITIES)}")
        notes = []
        if self.device.type != "cuda":
            if "MEM" in wanted:
                raise ValueError("activity MEM records CUDA allocations: this engine runs on the CPU")
            if "GPU" in wanted:
                wanted.remove("GPU")
                notes.append("GPU dropped: the engine runs on the CPU")
        if not any(a in wanted for a in ("CPU", "GPU", "MEM")):
            raise ValueError("nothing to profile: give CPU, GPU or MEM in activities")
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if start_step is not None and start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        for name, value in (("profile_id", profile_id), ("profile_prefix", profile_prefix)):
            if value and (os.sep in value or value.startswith(".")):
                raise ValueError(f"{name} names the trace file: no {os.sep!r} and no leading '.', got {value!r}")
        directory = output_dir or os.environ.get(ENV_DIR) or tempfile.mkdtemp(prefix="siesta-profile-")
        directory = os.path.abspath(os.path.expanduser(directory))
        os.makedirs(directory, exist_ok=True)  # a directory that cannot be made is refused now
        if not os.access(directory, os.W_OK):
            raise PermissionError(f"cannot write profiles to {directory!r}")
        self.settings = {
            "output_dir": directory, "activities": wanted, "profile_id": profile_id or f"{time.time():.6f}",
            "with_stack": with_stack is not False, "record_shapes": record_shapes is not False,
            "prefix": f"{profile_prefix}-" if profile_prefix else "",
        }
        self.written = []
        self.start_at = max(start_step or 0, step)
        self.stop_at = self.start_at + num_steps if num_steps is not None else None
        if self.start_at == step:
            try:
                self._begin()
            except Exception:
                self._reset()
                raise
        message = "profiling started" if self.started else f"profiling starts at step {self.start_at}"
        return {"success": True, "message": "; ".join([message, *notes]), "output_dir": directory,
                "profile_id": self.settings["profile_id"], "activities": wanted,
                "start_step": self.start_at, "stop_step": self.stop_at}

    def after_step(self, step: int) -> None:
        """Called by the engine loop after each step it ran (`step`: steps run so far)."""
        if not self.active:
            return
        try:
            if not self.started and step >= self.start_at:
                self._begin()
            if self.started and self.stop_at is not None and step >= self.stop_at:
                self.written = self._end()
                log.info("profile stopped after its steps: %s", self.written)
        except Exception:  # a profiler failure must not take the engine down
            log.exception("profiling failed; the profile is dropped")
            self._reset()

    def stop(self) -> dict[str, Any]:
        if not self.active:
            if self.written:  # stopped by itself after num_steps
                files, self.written = self.written, []
                return {"success": True, "message": "the profile had stopped after its num_steps", "files": files}
            raise ValueError("no profile is running: call /start_profile first")
        files = self._end()
        message = f"profile written to {os.path.dirname(files[0])}" if files else "nothing written: start_step was not reached"
        return {"success": True, "message": message, "files": files}

    def _begin(self) -> None:
        s = self.settings
        assert s is not None
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        torch_activities = [kinds[a] for a in s["activities"] if a in kinds]
        if torch_activities:
            self.profiler = torch.profiler.profile(
                activities=torch_activities, with_stack=s["with_stack"], record_shapes=s["record_shapes"]
            )
            self.profiler.start()
        if "MEM" in s["activities"]:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.started = True
        log.info("profiling %s into %s", s["activities"], s["output_dir"])

    def _end(self) -> list[str]:
        """Stop and write what was recorded; returns the files (none when it never started)."""
        s = self.settings
        assert s is not None
        files = []
        base = os.path.join(s["output_dir"], f"{s['prefix']}{s['profile_id']}-TP-0")
        try:
            profiler, self.profiler = self.profiler, None
            if profiler is not None:
                profiler.stop()
                profiler.export_chrome_trace(base + ".trace.json.gz")
                files.append(base + ".trace.json.gz")
            if "MEM" in s["activities"] and self.started:
                torch.cuda.memory._dump_snapshot(base + "-memory.pickle")
                torch.cuda.memory._record_memory_history(enabled=None)
                files.append(base + "-memory.pickle")
        finally:
            self._reset()
        return files

    def _reset(self) -> None:
        if self.profiler is not None and self.started:
            try:
                self.profiler.stop()
            except Exception:  # it failed to start or stop: nothing more to do with it
                log.debug("profiler stop failed", exc_info=True)
        self.profiler = None
        self.settings = None
        self.started = False
        self.start_at, self.stop_at = 0, None


class ProfileCalls:
    """Mixed into EngineCore; uses its `profiler` (a StepProfiler) and `num_steps`."""

    def start_profile(self, call: calls.StartProfile) -> dict[str, Any]:
        if call.profile_by_stage or call.merge_profiles:
            raise ValueError("profile_by_stage and merge_profiles are not supported here: one trace per profile")
        return self.profiler.start(
            self.num_steps, call.output_dir, call.start_step, call.num_steps, call.activities, call.with_stack,
            call.record_shapes, call.profile_id, call.profile_prefix,
        )

    def stop_profile(self, call: calls.StopProfile) -> dict[str, Any]:
        return self.profiler.stop()
