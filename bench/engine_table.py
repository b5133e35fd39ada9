"""bench_engine.py's one table: the rows (metric | measured | roofline/reference | ratio | target |
ok) built from the results, and their markdown printout."""

from __future__ import annotations

from typing import Any

from bench_runtime import MIB, elapsed
from engine_shapes import shape_label


def decode_targets(shape: dict[str, Any] | None) -> tuple[float, float, tuple[int, ...]]:
    """(bs=1 measured / roofline at most, roofline fraction at least, the batch sizes held to it):
    a model of hidden size >= 4096 (the 8B shape) is held closer to the roofline than a small
    one, whose step is launch-bound, at batch 64; a small one at 64 and 256."""
    big = bool(shape) and shape.get("hidden_size", 0) >= 4096
    return (1.3, 0.75, (64,)) if big else (2.5, 0.65, (64, 256))


def table_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    max_bs1, min_fraction, held = decode_targets(res["meta"].get("model_shape"))
    copy = res.get("copy")
    if copy:
        rows.append(dict(metric="copy bandwidth, best of the timed copies, read + write (GB/s)", measured=copy["bandwidth_bytes_per_s"] / 1e9,
                         reference=None, ratio=None, target="-", ok=None))
    for d in (res.get("decode") or {}).get("batches", []):
        bs = d["batch_size"]
        if bs == 1:
            rows.append(dict(metric="decode step bs=1 (ms); ratio = measured / roofline",
                             measured=d["step_mean_s"] * 1e3, reference=d["roofline_s"] * 1e3,
                             ratio=d["measured_over_roofline"], target=f"<= {max_bs1:.2f}",
                             ok=d["measured_over_roofline"] <= max_bs1))
        else:
            target = bs in held
            rows.append(dict(metric=f"decode step bs={bs} (ms); ratio = roofline / measured",
                             measured=d["step_mean_s"] * 1e3, reference=d["roofline_s"] * 1e3,
                             ratio=d["roofline_bandwidth_fraction"], target=f">= {min_fraction:.2f}" if target else "-",
                             ok=d["roofline_bandwidth_fraction"] >= min_fraction if target else None))
    rows += mixed_rows(res.get("mixed"))
    tp, hf = res.get("throughput"), res.get("hf")
    if tp:
        ratio = tp["tokens_per_s"] / hf["tokens_per_s"] if hf else None
        partial = " PARTIAL (time limit)" if tp["partial"] else ""
        rows.append(dict(metric=f"offline throughput (tok/s); ref = transformers generate{partial}",
                         measured=tp["tokens_per_s"], reference=hf["tokens_per_s"] if hf else None, ratio=ratio,
                         target=">= 20", ok=ratio >= 20 if ratio is not None else None))
    gm = res.get("graph_memory")
    if gm:
        rows.append(dict(metric=f"graph memory (MiB): ladder of {len(gm['ladder_batch_sizes'])} vs bs={gm['max_bs']} alone",
                         measured=gm["ladder_bytes"] / MIB, reference=gm["single_bytes"] / MIB, ratio=gm["ratio"],
                         target="<= 1.20", ok=gm["ratio"] is not None and gm["ratio"] <= 1.2))
    return rows


def mixed_rows(m: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The mixed section: its two halves apart (no target), then the mixed step against their sum."""
    if not m:
        return []
    bs, chunk = m["batch_size"], m["chunk_tokens"]
    none = dict(reference=None, ratio=None, target="-", ok=None)
    return [
        dict(metric=f"mixed: decode step bs={bs} alone (ms)", measured=m["decode_step_median_s"] * 1e3, **none),
        dict(metric=f"mixed: one {chunk}-token chunk prefill alone (ms)", measured=m["chunk_step_median_s"] * 1e3,
             **none),
        dict(metric=f"mixed step: {bs} decodes + one {chunk}-token chunk (ms); ref = decode step + chunk prefill "
             "alone", measured=m["mixed_step_median_s"] * 1e3, reference=m["reference_s"] * 1e3, ratio=m["ratio"],
             target="<= 1.30", ok=m["ratio"] <= 1.3),
    ]


def print_table(rows: list[dict[str, Any]], res: dict[str, Any]) -> None:
    def num(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:.3g}" if abs(x) < 0.01 else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"

    head = ["metric", "measured", "roofline/reference", "ratio", "target", "ok"]
    lines = [[r["metric"], num(r["measured"]), num(r["reference"]), num(r["ratio"]), r["target"],
              "-" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")] for r in rows]
    meta = res["meta"]
    print(f"\n## siesta engine benchmark: {meta['device_name']}, backend {meta.get('attention_backend')}, "
          f"{'TINY smoke run (numbers mean nothing): ' if meta['tiny'] else ''}"
          f"{shape_label(meta['model_shape']) if meta.get('model_shape') else 'no checkpoint'}")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(" --- " for _ in head) + "|")
    for line in lines:
        print("| " + " | ".join(line) + " |")
    hf = res.get("hf")
    if hf:
        print(f"(transformers ran {hf['requests']} requests x {hf['max_new_tokens']} new tokens in one batch, "
              f"left-padded to {hf['padded_width']}; siesta ran the full workload)")
    for section, err in res["errors"].items():
        print(f"section {section} FAILED: {err.splitlines()[-1] if err else ''}")
    print(f"total {elapsed():.0f} s; JSON in {res['meta']['out']}", flush=True)
