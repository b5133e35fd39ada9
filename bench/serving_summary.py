"""What a load section measured, from the client processes' records (serving_clients.py):
throughput over the section's wall time, request outcomes, each client's CPU, and TTFT,
inter-token and end-to-end latencies (sglang.bench_serving's definitions)."""

from __future__ import annotations

import math
from typing import Any


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None when empty."""
    if not xs:
        return None
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def summarize(start_at: float, results: list[dict[str, Any]], expected_tokens: int) -> dict[str, Any]:
    """Throughput over the section's wall time (the common start to the last answer), request
    outcomes, each client process's CPU % of one core over its own busy time, and latencies."""
    recs = [r for res in results for r in res["records"]]
    wall = max((r["end"] for r in recs), default=start_at) - start_at
    tokens = sum(r["tokens"] for r in recs)
    clients = [100.0 * res["cpu_s"] / max(res["end"] - start_at, 1e-6) if res["records"] else 0.0 for res in results]
    ok = [r for r in recs if r["ok"]]
    ttft = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    itl = [g for r in ok for g in r["gaps"]]
    e2e = [r["end"] - r["start"] for r in ok]
    ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
    return {
        "requests": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
        "errors": sorted({r["error"] for r in recs if r["error"]})[:3],
        "output_tokens": tokens, "expected_output_tokens": expected_tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0, "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "client_cpu_pct": clients, "client_cpu_pct_max": max(clients, default=0.0),
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99)), "mean": ms(sum(ttft) / len(ttft)) if ttft else None},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99)), "mean": ms(sum(itl) / len(itl)) if itl else None},
        "e2e_ms": {"p50": ms(percentile(e2e, 50)), "p99": ms(percentile(e2e, 99))},
    }
