"""bench_serving.py's table: per N, the in-process Engine, the batched request against it and the
server's CPU there, each other mode against the batched request (issue 13's targets); then the
online shape. Each row also shows the server's, the engine's and the busiest client's CPU."""

from __future__ import annotations

from typing import Any

from bench_runtime import elapsed
from report import Rows, over, print_targets, run_footer
from serving_clients import SAMPLES
from serving_routes import routed_rows

# A mode's tok/s over the batched request's; "engine": the batched request's over the Engine's.
TARGETS = {"singles": 0.95, "streams": 0.85, "n8": 0.95, "engine": 0.95}
SERVER_CPU_TARGET_PCT = 60.0
CPU_COLUMNS = (("server CPU %", "server_cpu"), ("engine CPU %", "engine_cpu"), ("client CPU % max", "client_cpu"))


def table_rows(res: dict[str, Any]) -> Rows:
    """The table: per N the Engine, the batched request against it, the server's CPU there, each
    other mode against the batched request; then the online shape. CPU columns per section."""
    rows = Rows()

    def row(metric: str, measured: Any, ref: Any = None, target: str = "-", least: float | None = None,
            sec: dict[str, Any] | None = None, higher: bool = True) -> None:
        ratio = over(measured, ref) if least is not None and higher else None
        value = ratio if higher else measured
        ok = None if least is None or value is None else (value >= least if higher else value < least)
        sec = sec or {}
        note = "INVALID: client CPU" if sec.get("invalid") else f"{sec['failed']} FAILED" if sec.get("failed") else ""
        rows.add(metric, measured, ref, ratio, target, ok, server_cpu=sec.get("server_cpu_pct"),
                 engine_cpu=sec.get("engine_cpu_pct"), client_cpu=sec.get("client_cpu_pct_max"), note=note)

    for n, sec in sorted(res["rl"].items(), key=lambda kv: int(kv[0])):
        tps = {mode: r["tokens_per_s"] for mode, r in sec.items()}
        if "engine" in sec:
            row(f"N={n} in-process Engine, tok/s (client col: this process)", tps["engine"], sec=sec["engine"])
        if "batched" in sec:
            b = sec["batched"]
            row(f"N={n} one batched /generate, tok/s; ref = Engine", tps["batched"], tps.get("engine"),
                f">= {TARGETS['engine']}", TARGETS["engine"], b)
            row(f"N={n} server CPU in the batched section, % of a core (busiest API process)", b.get("server_cpu_pct_max"),
                target=f"< {SERVER_CPU_TARGET_PCT:.0f}", least=SERVER_CPU_TARGET_PCT, higher=False)
        for mode, label in (("singles", "N concurrent singles"), ("streams", "N concurrent streams"),
                            ("n8", f"N/{SAMPLES} concurrent n:{SAMPLES}")):
            if mode in sec:
                row(f"N={n} {label}, tok/s; ref = batched", tps[mode], tps.get("batched"),
                    f">= {TARGETS[mode]}", TARGETS[mode], sec[mode])
    routed_rows(res, row)
    on = res.get("online")
    if on:
        row(f"online {on['request_rate']} req/s x {on['num_requests']}: output tok/s; ref = req/s",
            on["tokens_per_s"], on["requests_per_s"], sec=on)
        row("online TTFT ms: p50; ref = p99", on["ttft_ms"]["p50"], on["ttft_ms"]["p99"])
        row("online inter-token latency ms: p50; ref = p99", on["itl_ms"]["p50"], on["itl_ms"]["p99"])
    lt = res.get("longtail")
    if lt:
        row(f"long tail {lt['sequences']} x {lt['prompt_tokens']}-token prompts, {lt['output_tokens_each']} new each: "
            "tok/s per sequence; ref = mean step ms", lt["tokens_per_s_per_sequence"], lt["mean_step_ms"], sec=lt)
    return rows


def print_table(res: dict[str, Any]) -> None:
    ckpt, server = res.get("checkpoint") or {}, res.get("server") or {}
    title = (f"siesta serving benchmark: {'TINY smoke run (numbers mean nothing): ' if res['meta']['tiny'] else ''}"
             f"{ckpt.get('label', 'no checkpoint')}; device {server.get('device', '?')}, {server.get('dtype', '?')}")
    print_targets(title, res["table"], CPU_COLUMNS, run_footer(res, elapsed()))
