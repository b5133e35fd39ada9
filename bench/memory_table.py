"""bench_memory.py's table: reclaim, residual, drift, identical outputs, release and resume times
(against the issue's absolute targets and against the CUDA driver's own cost for the same bytes,
measured in the same run), and the weights restore against pinned host-to-device copies."""

from __future__ import annotations

from typing import Any

from bench_runtime import GIB, MIB, elapsed
from report import Rows, print_targets, run_footer

RECLAIM_TARGET = 0.995
RESIDUAL_TARGET = 256 * MIB
DRIFT_TARGET = 4 * MIB
RELEASE_TARGET_S = 0.050
RESUME_KV_GRAPH_TARGET_S = 0.020
RESTORE_BW_TARGET = 0.90


def mib(x: float | None) -> float | None:
    return None if x is None else x / MIB


def table_rows(res: dict[str, Any]) -> Rows:
    rows = Rows()
    row = rows.add

    idle, rc, cy = res.get("idle"), res.get("reclaim"), res.get("cycles")
    h2d, tms = res.get("h2d"), res.get("tms_cpu_backup")
    if idle:
        how = (rc or {}).get("method") or ("per_pid" if idle["per_pid"] is not None else "device")
        row(f"idle CUDA process footprint (MiB, {how})", mib(idle[how]))
    if rc:
        how = rc["method"]
        row(f"engine used when ready, after traffic (MiB, {how}); ref = regions", mib(rc["used_ready"][how]),
            mib(sum(res["engine"]["region_bytes"].values())) if res.get("engine") else None)
        row("reclaim = 1 - (released - idle) / (ready - idle)", rc["reclaim"], target=">= 0.995",
            ok=rc["reclaim"] is not None and rc["reclaim"] >= RECLAIM_TARGET)
        row("residual over idle, all released (MiB); ref = idle", mib(rc["residual_over_idle_bytes"]), mib(rc["idle_bytes"]),
            target="<= 256", ok=rc["residual_over_idle_bytes"] <= RESIDUAL_TARGET)
    if cy:
        n = cy["cycles"]
        part = " PARTIAL" if cy["partial"] else ""
        for state in ("released", "resumed"):
            drift = cy[f"drift_{state}_bytes"]
            row(f"drift over {n} cycles, {state} (MiB); ref = spread{part}", mib(drift), mib(cy[f"spread_{state}_bytes"]),
                target="<= 4", ok=abs(drift) <= DRIFT_TARGET)
        row(f"outputs identical to the run before any release (of {n} cycles)", cy["identical"], target=f"= {n}", ok=cy["identical"] == n)
        for key, what, limit in (("release_s", "release all: the call's seconds", RELEASE_TARGET_S),
                                 ("release_wall_s", "release all: wall around the call", RELEASE_TARGET_S),
                                 ("resume_kv_graph_s", "resume kv_cache + cuda_graph: the call's seconds", RESUME_KV_GRAPH_TARGET_S),
                                 ("resume_kv_graph_wall_s", "resume kv_cache + cuda_graph: wall", RESUME_KV_GRAPH_TARGET_S)):
            s = cy[key]
            row(f"{what} (ms, median; ref = max)", s["median"] * 1e3, s["max"] * 1e3, target=f"< {limit * 1e3:.0f}",
                ok=s["median"] < limit)
        row("resume weights: the call's seconds (ms, median)", cy["resume_weights_s"]["median"] * 1e3)
    sc, drv = res.get("scrubbed"), res.get("driver")
    if sc:
        row(f"resume kv_cache + cuda_graph {sc['wait_s']:.1f} s after release (ms, median; ref = max)",
            sc["resume_kv_graph_median_s"] * 1e3, sc["resume_kv_graph_max_s"] * 1e3,
            target=f"< {RESUME_KV_GRAPH_TARGET_S * 1e3:.0f}", ok=sc["resume_kv_graph_median_s"] < RESUME_KV_GRAPH_TARGET_S)
    ours_release = (cy or {}).get("release_s", {}).get("median")
    if drv:
        gib = drv["bytes"] / GIB
        a, b = drv["right_after"], drv["after_wait"]

        def against_driver(metric: str, driver_s: float, ours_s: float | None) -> None:
            row(metric, driver_s * 1e3, ours_s * 1e3 if ours_s else None, ours_s / driver_s if ours_s else None)

        resume_all = None
        if cy:
            resume_all = cy["resume_kv_graph_s"]["median"] + cy["resume_weights_s"]["median"]
        against_driver(f"driver alone, {gib:.0f} GiB (every region's bytes): unmap + release, pages settled (ms); "
                       "ref = siesta release all, pages settled (section scrubbed); target ratio <= 1.10",
                       a["pause_median_s"], (sc or {}).get("release_median_s"))
        against_driver(f"driver alone, {gib:.0f} GiB: create + map right after release (ms); "
                       "ref = siesta resume kv+graph, then weights; target ratio <= 1.10", a["resume_median_s"], resume_all)
        against_driver(f"driver alone, {gib:.0f} GiB: create + map {drv['wait_s']:.1f} s after (ms); "
                       "ref = siesta resume kv+graph + weights after the same wait",
                       b["resume_median_s"], (sc or {}).get("resume_all_median_s"))
    h2d_bw = h2d["bandwidth_bytes_per_s"] if h2d else None
    if h2d:
        row(f"pinned host -> device copy, {h2d['bytes'] // MIB} MiB (GB/s)", h2d_bw / 1e9)
    if cy and cy["restore_bandwidth_median_bytes_per_s"]:
        bw = cy["restore_bandwidth_median_bytes_per_s"]
        ratio = bw / h2d_bw if h2d_bw else None
        row("siesta weights restore (GB/s); ref = pinned H2D", bw / 1e9, h2d_bw / 1e9 if h2d_bw else None, ratio,
            ">= 0.90", ratio >= RESTORE_BW_TARGET if ratio is not None else None)
    if tms:
        bw = tms["restore_bandwidth_bytes_per_s"]
        ratio = bw / h2d_bw if h2d_bw else None
        row("torch_memory_saver enable_cpu_backup restore (GB/s); ref = pinned H2D", bw / 1e9,
            h2d_bw / 1e9 if h2d_bw else None, ratio)
        row("torch_memory_saver enable_cpu_backup pause, weights only (ms); ref = siesta release all",
            tms["pause_median_s"] * 1e3, ours_release * 1e3 if ours_release is not None else None)
        row("torch_memory_saver enable_cpu_backup content identical after resume", float(tms["all_identical"]),
            target="= 1", ok=tms["all_identical"])
    return rows


def print_table(res: dict[str, Any]) -> None:
    meta = res["meta"]
    title = (f"siesta memory benchmark: {meta.get('device_name')}, Qwen3-0.6B shape, random bf16 weights, "
             f"mem_fraction {meta['args']['mem_fraction']}, graphs up to bs {meta['args']['graph_max_bs']}")
    print_targets(title, res.get("table", []), footer=run_footer(res, elapsed()))
