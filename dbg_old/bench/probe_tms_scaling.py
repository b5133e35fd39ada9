"""How torch_memory_saver's pause and resume times scale with region size and with how the region
is split into allocations (preload hook mode), so the memory benchmark's release/resume targets can
be read against what the driver costs. Run under the hook: the script re-executes itself inside
`configure_subprocess()`. Arguments: layouts TOTALxCOUNT in GiB, e.g. 32x1 (one 32 GiB tensor)
or 32x28 (28 tensors adding up to 32 GiB)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def child(layouts: list[str]) -> None:
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    torch.zeros(1, device="cuda")
    print("| region GiB | allocations | pause ms | resume ms |")
    print("| --- | --- | --- | --- |")
    for layout in layouts:
        total, count = (int(x) for x in layout.split("x"))
        tag = f"probe-{layout}"
        with tms.region(tag=tag):
            parts = [torch.empty((total << 30) // count, dtype=torch.uint8, device="cuda") for _ in range(count)]
        for p in parts:
            p.fill_(1)
        pauses, resumes = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tms.pause(tag)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            tms.resume(tag)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            pauses.append(t1 - t0)
            resumes.append(t2 - t1)
        print(f"| {total} | {count} | {sorted(pauses)[2] * 1e3:.1f} | {sorted(resumes)[2] * 1e3:.1f} |", flush=True)
        tms.pause(tag)  # keep the device free for the next layout
        del parts


if __name__ == "__main__":
    layouts = sys.argv[1:] or ["8x1", "32x1", "32x4", "32x28", "96x28"]
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        child(layouts)
    else:
        from torch_memory_saver import configure_subprocess

        with configure_subprocess():
            sys.exit(subprocess.call([sys.executable, __file__, *layouts]))
