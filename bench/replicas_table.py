"""bench_replicas.py's table: the gateway's throughput against one replica's from the same run
(target: 0.9 x the number of replicas, on GPUs), how it split the requests, CPU, and each phase of
the fanned-out flip against its slowest worker. Rows are dicts (metric, measured, reference,
ratio, target, ok, note), printed by report.py."""

from __future__ import annotations

from typing import Any

from bench_runtime import elapsed
from report import Rows, over, print_targets, run_footer

PER_REPLICA_TARGET = 0.9  # the gateway's tok/s over one replica's, per replica
FLIP_VERSION = "flip-1"


def table_rows(res: dict[str, Any], replicas: int, gpu: bool) -> Rows:
    """The table: each load section's tok/s (the gateway's against one replica's), how the gateway
    split the requests, CPU; each flip phase's fan-out wall time against its slowest worker."""
    rows = Rows()

    def row(metric: str, measured: Any, ref: Any = None, ratio: float | None = None, target: str = "-",
            ok: bool | None = None, note: str = "") -> None:
        rows.add(metric, measured, ref, ratio, target, ok, note=note)

    def note(sec: dict[str, Any]) -> str:
        failed = f"{sec['failed']} FAILED; " if sec["failed"] else ""
        return f"{failed}clients {sec['client_cpu_pct_max']:.0f} % max: {'INVALID' if sec['invalid'] else 'valid'}"

    def each(xs: list[Any], fmt: str = "{:.0f}") -> str:
        return " / ".join("-" if x is None else fmt.format(x) for x in xs)

    one, gw, fl = res.get("one"), res.get("gateway"), res.get("flip")
    if one:
        row(f"one replica, N={one['requests']} singles: output tok/s", one["tokens_per_s"], note=note(one))
    if gw:
        want, ref = PER_REPLICA_TARGET * replicas, (one or {}).get("tokens_per_s")
        ratio = over(gw["tokens_per_s"], ref)
        row(f"{replicas} replicas via the gateway: output tok/s; ref = one replica", gw["tokens_per_s"], ref, ratio,
            f">= {want:.2f}" if gpu else "n/a (cpu)", None if ratio is None or not gpu else ratio >= want, note(gw))
        row("gateway: requests per replica; ref = all", each(gw["requests_per_replica"]), gw["requests"],
            ok=all(x > 0 for x in gw["requests_per_replica"]))
        row("gateway process CPU, % of a core", gw["gateway_cpu_pct"])
        row("servers' CPU per replica, % of a core; ref = engines'", each(gw["server_cpu_pct"]), each(gw["engine_cpu_pct"]))
    if fl:
        for name, p in fl["phases"].items():
            row(f"flip: {name}, ms: fan-out wall; ref = slowest worker", p["wall_ms"], p["worker_max_latency_ms"],
                ok=p["status"] == 200 and p["succeeded"] == replicas)
        row("flip: bytes freed per replica, MiB", each([(b or 0) / 2**20 for b in fl.get("bytes_freed", [])]))
        mem = fl["gpu_memory_mib"]
        if mem.get("released"):
            row("flip: GPU memory used once released, MiB per GPU; ref = before", each(list(mem["released"].values())),
                each(list((mem["before"] or {}).values())))
        row(f"flip: greedy outputs identical after, weight_version {FLIP_VERSION}", "yes" if fl["identical"] else "no",
            ok=fl["ok"], note=f"versions {fl['versions_after']}")
    return rows


def print_table(res: dict[str, Any]) -> None:
    meta = res["meta"]
    title = (f"siesta replicas behind the gateway: {'TINY smoke run (numbers mean nothing): ' if meta['tiny'] else ''}"
             f"{(res.get('checkpoint') or {}).get('label', 'no checkpoint')}; {meta['args']['replicas']} replicas on "
             f"{'GPUs' if meta['gpu'] else 'the CPU'}")
    print_targets(title, res["table"], footer=run_footer(res, elapsed()))
