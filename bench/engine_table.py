"""bench_engine.py's one table: its rows (metric | measured | roofline/reference | ratio | target |
ok) built from the results, printed by report.py."""

from __future__ import annotations

from typing import Any

from bench_runtime import MIB, elapsed
from engine_shapes import shape_label
from report import Rows, over, print_targets, run_footer


def decode_targets(shape: dict[str, Any] | None) -> tuple[float, float, tuple[int, ...]]:
    """(bs=1 measured / roofline at most, roofline fraction at least, the batch sizes held to it):
    a model of hidden size >= 4096 (the 8B shape) is held closer to the roofline than a small
    one, whose step is launch-bound, at batch 64; a small one at 64 and 256."""
    big = bool(shape) and shape.get("hidden_size", 0) >= 4096
    return (1.3, 0.75, (64,)) if big else (2.5, 0.65, (64, 256))


def table_rows(res: dict[str, Any]) -> Rows:
    rows = Rows()
    max_bs1, min_fraction, held = decode_targets(res["meta"].get("model_shape"))
    copy = res.get("copy")
    if copy:
        rows.add("copy bandwidth, best of the timed copies, read + write (GB/s)", copy["bandwidth_bytes_per_s"] / 1e9)
    for d in (res.get("decode") or {}).get("batches", []):
        bs, step, roof = d["batch_size"], d["step_mean_s"] * 1e3, d["roofline_s"] * 1e3
        if bs == 1:
            ratio = d["measured_over_roofline"]
            rows.add("decode step bs=1 (ms); ratio = measured / roofline", step, roof, ratio,
                     f"<= {max_bs1:.2f}", ratio <= max_bs1)
        else:
            ratio, target = d["roofline_bandwidth_fraction"], bs in held
            rows.add(f"decode step bs={bs} (ms); ratio = roofline / measured", step, roof, ratio,
                     f">= {min_fraction:.2f}" if target else "-", ratio >= min_fraction if target else None)
    m = res.get("mixed")
    if m:
        bs, chunk = m["batch_size"], m["chunk_tokens"]
        rows.add(f"mixed: decode step bs={bs} alone (ms)", m["decode_step_median_s"] * 1e3)
        rows.add(f"mixed: one {chunk}-token chunk prefill alone (ms)", m["chunk_step_median_s"] * 1e3)
        rows.add(f"mixed step: {bs} decodes + one {chunk}-token chunk (ms); ref = decode step + chunk prefill alone",
                 m["mixed_step_median_s"] * 1e3, m["reference_s"] * 1e3, m["ratio"], "<= 1.30", m["ratio"] <= 1.3)
    tp, hf = res.get("throughput"), res.get("hf")
    if tp:
        ratio = over(tp["tokens_per_s"], hf["tokens_per_s"] if hf else None)
        partial = " PARTIAL (time limit)" if tp["partial"] else ""
        rows.add(f"offline throughput (tok/s); ref = transformers generate{partial}", tp["tokens_per_s"],
                 hf["tokens_per_s"] if hf else None, ratio, ">= 20", ratio >= 20 if ratio is not None else None)
    gm = res.get("graph_memory")
    if gm:
        rows.add(f"graph memory (MiB): ladder of {len(gm['ladder_batch_sizes'])} vs bs={gm['max_bs']} alone",
                 gm["ladder_bytes"] / MIB, gm["single_bytes"] / MIB, gm["ratio"], "<= 1.20",
                 gm["ratio"] is not None and gm["ratio"] <= 1.2)
    return rows


def print_table(rows: list[dict[str, Any]], res: dict[str, Any]) -> None:
    meta = res["meta"]
    title = (f"siesta engine benchmark: {meta['device_name']}, backend {meta.get('attention_backend')}, "
             f"{'TINY smoke run (numbers mean nothing): ' if meta['tiny'] else ''}"
             f"{shape_label(meta['model_shape']) if meta.get('model_shape') else 'no checkpoint'}")
    hf = res.get("hf")
    footer = [f"(transformers ran {hf['requests']} requests x {hf['max_new_tokens']} new tokens in one batch, "
              f"left-padded to {hf['padded_width']}; siesta ran the full workload)"] if hf else []
    print_targets(title, rows, footer=footer + run_footer(res, elapsed()), reference="roofline/reference")
