"""`set_process_title`: the name `ps`, `top` and `/proc` show for an engine, worker or API server
process (`siesta::engine`, `siesta::tp1`, `siesta::api1`), with no dependency beyond libc.

Rules:
- The kernel's `comm` (what `ps -e`, `top` and `/proc/PID/comm` show; 15 bytes at most) is set with
  prctl(PR_SET_NAME) on the calling thread: call it from the main thread, before the process
  starts its own threads (they inherit it).
- `/proc/PID/cmdline` (what `ps aux` shows) is rewritten in place: the title, then NUL bytes over
  the rest of the original argument strings, whose bounds the kernel gives in /proc/self/stat.
  Python keeps its own copy of argv, so nothing reads those bytes again. A title longer than the
  original arguments is cut to fit.
- Where either is not possible (not Linux, no libc), the process keeps its name: nothing fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_NAME = 15
COMM_BYTES = 15  # TASK_COMM_LEN less its NUL


def set_process_title(title: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    data = title.encode()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(data[:COMM_BYTES]), 0, 0, 0)
    except OSError:
        return
    _rewrite_cmdline(data)


def _rewrite_cmdline(data: bytes) -> None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return
    # Fields after the parenthesised command name; arg_start and arg_end are fields 48 and 49.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if len(fields) < 47:
        return
    start, end = int(fields[45]), int(fields[46])
    size = end - start
    if size < 2:
        return
    title = data[: size - 1]
    ctypes.memmove(start, title + b"\0" * (size - len(title)), size)
