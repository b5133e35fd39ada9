"""bench_engine.py's one table: its rows (metric | measured | roofline/reference | ratio | target |
ok) built from the results, printed by report.py; for a mixture of experts one more column, the
distinct experts per sparse layer a decode step read (mean over the counted steps)."""

from __future__ import annotations

from typing import Any

from bench_runtime import MIB, elapsed
from engine_shapes import is_moe, shape_label
from report import Rows, cell, over, print_targets, run_footer


def decode_targets(shape: dict[str, Any] | None) -> tuple[float, float, tuple[int, ...]]:
    """(bs=1 measured / roofline at most, roofline fraction at least, the batch sizes held to it):
    a model of hidden size >= 4096 (the 8B shape) is held closer to the roofline than a small
    one, whose step is launch-bound, at batch 64; a small one at 64 and 256; a mixture of experts
    (issue 74: its roofline reads only the experts routed to) <= 1.6 at batch 1, >= 0.6 at 64 and 256."""
    if shape and is_moe(shape):
        return 1.6, 0.6, (64, 256)
    big = bool(shape) and shape.get("hidden_size", 0) >= 4096
    return (1.3, 0.75, (64,)) if big else (2.5, 0.65, (64, 256))


# Long contexts (issue 77): from LONG_CONTEXT tokens a decode step's KV is most of what it reads.
# Batch 1 at LONGEST_CONTEXT or more: measured / roofline at most LONG_BS1; batches LONG_HELD at
# LONG_CONTEXT or more: roofline fraction at least LONG_FRACTION.
LONG_CONTEXT, LONGEST_CONTEXT = 8192, 32768
LONG_BS1, LONG_FRACTION, LONG_HELD = 1.3, 0.85, (4, 8)


def decode_target(shape: dict[str, Any] | None, bs: int, context: int) -> tuple[str, float] | None:
    """The target of a decode point: ("<=", measured / roofline) at bs 1, (">=", roofline
    fraction) above; None where none holds."""
    max_bs1, min_fraction, held = decode_targets(shape)
    if context >= LONG_CONTEXT:
        if bs == 1:
            return ("<=", LONG_BS1) if context >= LONGEST_CONTEXT else None
        return (">=", LONG_FRACTION) if bs in LONG_HELD else None
    if bs == 1:
        return ("<=", max_bs1)
    return (">=", min_fraction) if bs in held else None


# Graph memory, the ladder over its largest graph at most: dense, mixture of experts (issue 74).
GRAPH_MEMORY_TARGET = {False: 1.20, True: 1.05}
# Prefill of a mixture of experts: achieved TFLOP/s over the dense bf16 matmul rate, at least.
PREFILL_TARGET = 0.35


def table_rows(res: dict[str, Any]) -> Rows:
    rows = Rows()
    shape = res["meta"].get("model_shape")
    moe = bool(shape) and is_moe(shape)
    copy = res.get("copy")
    if copy:
        rows.add("copy bandwidth, best of the timed copies, read + write (GB/s)", copy["bandwidth_bytes_per_s"] / 1e9)
    for d in (res.get("decode") or {}).get("batches", []):
        bs, ctx, step, roof = d["batch_size"], d["context"], d["step_mean_s"] * 1e3, d["roofline_s"] * 1e3
        experts = d.get("distinct_experts_per_layer")
        target = decode_target(shape, bs, ctx)
        if bs == 1:
            ratio, what = d["measured_over_roofline"], "measured / roofline"
        else:
            ratio, what = d["roofline_bandwidth_fraction"], "roofline / measured"
        ok = None if target is None else (ratio <= target[1] if target[0] == "<=" else ratio >= target[1])
        rows.add(f"decode step bs={bs}, context {ctx} (ms); ratio = {what}", step, roof, ratio,
                 f"{target[0]} {target[1]:.2f}" if target else "-", ok, experts=experts)
    p = res.get("prefill")
    if p:
        m, h, n = p["dense_matmul_shape"]
        rows.add(f"prefill {p['prompts']} x {p['prompt_len']} tokens (TFLOP/s); ref = dense bf16 matmul "
                 f"[{m} x {h}] x [{h} x {n}]", p["tflops"], p["dense_tflops"], p["dense_ratio"],
                 f">= {PREFILL_TARGET:.2f}", p["dense_ratio"] >= PREFILL_TARGET)
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
        limit = GRAPH_MEMORY_TARGET[moe]
        rows.add(f"graph memory (MiB): ladder of {len(gm['ladder_batch_sizes'])} vs bs={gm['max_bs']} alone",
                 gm["ladder_bytes"] / MIB, gm["single_bytes"] / MIB, gm["ratio"], f"<= {limit:.2f}",
                 gm["ratio"] is not None and gm["ratio"] <= limit)
    return rows


def print_table(rows: list[dict[str, Any]], res: dict[str, Any]) -> None:
    meta = res["meta"]
    title = (f"siesta engine benchmark: {meta['device_name']}, backend {meta.get('attention_backend')}, "
             f"{'TINY smoke run (numbers mean nothing): ' if meta['tiny'] else ''}"
             f"{shape_label(meta['model_shape']) if meta.get('model_shape') else 'no checkpoint'}")
    hf = res.get("hf")
    footer = [f"(transformers ran {hf['requests']} requests x {hf['max_new_tokens']} new tokens in one batch, "
              f"left-padded to {hf['padded_width']}; siesta ran the full workload)"] if hf else []
    moe = (res.get("decode") or {}).get("moe")
    if moe:
        footer.append(f"(MoE decode roofline: {cell(moe['non_expert_bytes'] / MIB)} MiB of weights besides the experts, "
                      f"the batch's embedding rows, the distinct experts each of the {moe['sparse_layers']} sparse "
                      f"layers routed to ({cell(moe['bytes_per_expert'] / MIB)} MiB each; counted over untimed steps "
                      f"after the timed ones) and the KV read)")
    experts = any(r.get("experts") is not None for r in rows)
    print_targets(title, rows, extra=[("experts per layer", "experts")] if experts else (),
                  footer=footer + run_footer(res, elapsed()), reference="roofline/reference")
