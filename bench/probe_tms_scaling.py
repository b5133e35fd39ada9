"""How torch_memory_saver's pause and resume times scale with region size (preload hook mode),
so the memory benchmark's release/resume targets can be read against what the driver costs.
Run under the hook: the script re-executes itself inside `configure_subprocess()`."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def child(sizes_gib: list[int]) -> None:
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    torch.zeros(1, device="cuda")
    print("| region GiB | pause ms | resume ms | pause GiB/ms | resume GiB/ms |")
    print("| --- | --- | --- | --- | --- |")
    for gib in sizes_gib:
        with tms.region(tag="probe"):
            t = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        pauses, resumes = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tms.pause("probe")
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            tms.resume("probe")
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            pauses.append(t1 - t0)
            resumes.append(t2 - t1)
        p, r = sorted(pauses)[2] * 1e3, sorted(resumes)[2] * 1e3
        print(f"| {gib} | {p:.1f} | {r:.1f} | {gib / p:.2f} | {gib / r:.2f} |", flush=True)
        del t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sizes = [int(x) for x in (sys.argv[1:] or ["1", "8", "32", "100"])]
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        child(sizes)
    else:
        from torch_memory_saver import configure_subprocess

        with configure_subprocess():
            sys.exit(subprocess.call([sys.executable, __file__, *map(str, sizes)]))
