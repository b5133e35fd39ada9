"""The benchmark suite's shape, checked without running a benchmark: every suite, kernel
benchmark and probe parses its arguments (`--help`) without a GPU; one report helper prints every
table; RESULTS.md is the current state (a row per target naming its device, date, command and
history entry); nothing imports a probe and probes stay on public names; bench/README.md names
every script; the decode targets follow the batch and the context."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest
from bench_util import BENCH, ROOT, SCRIPTS, SUITES, run_script


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmarks_parse_their_arguments_anywhere(script: str) -> None:
    p = run_script(os.path.join("bench", script), "--help")
    assert p.returncode == 0, p.stderr
    assert "usage:" in p.stdout and "Traceback" not in p.stderr


def test_the_report_helper_prints_the_table_it_is_given() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from report import Rows, print_table, print_targets
    finally:
        sys.path.remove(str(BENCH))
    rows = Rows()
    rows.add("decode step bs=1 (ms)", 0.727, 0.296, 2.4561, "<= 2.5", True)
    rows.add("requests per replica", "512 / 512", 1024, note="valid", cpu=37.1)
    rows.add("copy bandwidth (GB/s)", 4235.04, None, None, "-", None)
    rows.add("tiny ratio", 0.00123, ratio=float("nan"), target=">= 0.65", ok=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_targets("a title", rows, extra=[("server CPU %", "cpu")], footer=["total 3 s"])
        print_table("kernels", ["op", "us"], [["rms_norm", 12], ["silu", 3.14159]])
    assert out.getvalue().splitlines() == [
        "",
        "## a title",
        "| metric | measured | reference | ratio | target | ok | server CPU % | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| decode step bs=1 (ms) | 0.7270 | 0.2960 | 2.456 | <= 2.5 | PASS | - |  |",
        "| requests per replica | 512 / 512 | 1024 | - | - | - | 37.1 | valid |",
        "| copy bandwidth (GB/s) | 4235.0 | - | - | - | - | - |  |",
        "| tiny ratio | 0.00123 | - | - | >= 0.65 | FAIL | - |  |",
        "total 3 s",
        "",
        "## kernels",
        "| op | us |",
        "| --- | --- |",
        "| rms_norm | 12 |",
        "| silu | 3.142 |",
    ]
    assert rows[1] == dict(metric="requests per replica", measured="512 / 512", reference=1024, ratio=None,
                           target="-", ok=None, note="valid", cpu=37.1)  # the JSON keeps the rows as they are


def test_idle_gaps_are_grouped_by_the_ops_around_them() -> None:
    """device_timing.idle_gaps on a real profile (CPU ops here, kernels on a GPU): a 30 ms wait
    between two ops is the largest gap, named by the op before and the op after; kernel_times
    counts each op's launches; path_times gives each op its whole span where none overlaps, and
    with the gaps covers the profile's span."""
    import time

    import torch

    sys.path.insert(0, str(BENCH))
    try:
        from device_timing import idle_gaps, kernel_times, path_times
    finally:
        sys.path.remove(str(BENCH))
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            torch.mm(a, a)
            time.sleep(0.03)
            torch.sub(a, a)
    events = [e for e in prof.events() if e.name in ("aten::mm", "aten::sub")]
    gaps = idle_gaps(events, steps=2)
    top = gaps[0]
    assert (top["before"], top["after"]) == ("aten::mm", "aten::sub"), gaps
    assert top["count_per_step"] == 1.0 and 30_000 <= top["us_per_step"] < 300_000, top
    assert {name: n for name, n, _ in kernel_times(events)} == {"aten::mm": 2, "aten::sub": 2}
    path = path_times(events)
    own = {name: sum(e.time_range.end - e.time_range.start for e in events if e.name == name) for name in path}
    assert path == pytest.approx(own) and own["aten::mm"] > 0
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    assert sum(path.values()) + sum(g["us_per_step"] * 2 for g in gaps) == pytest.approx(span)


def test_engine_process_heap_hides_startup_objects_from_full_collections_until_it_exits() -> None:
    """bench_runtime.engine_process_heap: a cycle made before it stays through a full collection
    inside it (frozen, as the engine process freezes what startup made), and is collected once it
    exits (unfrozen: a core deleted after a measurement frees its memory)."""
    import gc
    import weakref

    sys.path.insert(0, str(BENCH))
    try:
        from bench_runtime import engine_process_heap
    finally:
        sys.path.remove(str(BENCH))

    class Node:
        pass

    node = Node()
    node.self = node  # type: ignore[attr-defined]  # a cycle: only a full collection frees it
    alive = weakref.ref(node)
    frozen_before = gc.get_freeze_count()
    with engine_process_heap():
        assert gc.get_freeze_count() > frozen_before
        del node
        gc.collect()
        assert alive() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_results_is_the_current_state_and_every_row_says_where_and_how() -> None:
    text = (BENCH / "RESULTS.md").read_text()
    assert len(text.splitlines()) <= 200
    tables = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in tables[0].strip("|").split("|")]
    assert {"metric", "value", "ratio", "target", "device", "date", "command"} <= set(head), head
    rows = [line for line in tables if not line.startswith(("| metric |", "| --- |"))]
    assert len(rows) >= 20
    for line in rows:
        cells = dict(zip(head, (c.strip() for c in line.strip().strip("|").split(" | ")), strict=True))
        assert re.fullmatch(r"(\d+x )?H[0-9]{3}", cells["device"]), line
        assert re.fullmatch(r"2\d{3}-\d\d-\d\d", cells["date"]), line
        assert cells["command"].startswith("`") and ".py" in cells["command"], line
        entry = re.fullmatch(r"\[(\d{4}-\d\d-\d\d)[a-z]\]\(history/(\d{4}-\d\d-\d\d)\.md\)", cells["entry"])
        assert entry and entry[1] == entry[2] == cells["date"] and (BENCH / "history" / f"{entry[2]}.md").exists(), line
    for path in re.findall(r"`(?:[A-Z_]+=\S+ )?python3 (?:-m pytest \S+ \S+ )?(\S+\.py)", text):
        assert (Path(ROOT) / path).exists(), path


def test_no_bench_file_imports_a_probe_and_probes_stay_on_public_names() -> None:
    probes = {p.stem for p in (BENCH / "probes").glob("*.py")}
    wrong = []
    for path in BENCH.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if path.parent.name == "probes" and (node.module or "").startswith("engine"):
                    wrong += [f"{path.name} imports engine's private {a.name}" for a in node.names if a.name.startswith("_")]
            wrong += [f"{path.relative_to(BENCH)} imports the probe {n}" for n in names if n.split(".")[-1] in probes]
            if path.parent.name == "probes" and isinstance(node, ast.Attribute) and re.fullmatch(r"_[a-z]\w*", node.attr):
                wrong.append(f"{path.name} reaches the private {node.attr}")
    assert not wrong, wrong


def test_the_readme_names_every_script_and_says_nothing_of_how_it_was_made() -> None:
    readme = (BENCH / "README.md").read_text()
    for script in SUITES + ["report.py"] + [s for s in SCRIPTS if "/" in s]:
        assert f"bench/{script}" in readme, script
    said = [f"{p.relative_to(BENCH)}: {line.strip()}" for p in BENCH.rglob("*") if p.suffix in (".py", ".md")
            and p.parent.name != "history" for line in p.read_text().splitlines()
            if re.search(r"session", line.replace("start_new_session", ""), re.I)]
    assert not said, said


def test_decode_targets_by_batch_and_context() -> None:
    """Short contexts keep each shape's targets; from 8k tokens issue 77's: batch 1 at 32k, batches 4-8."""
    sys.path.insert(0, str(BENCH))
    try:
        from engine_shapes import SHAPES
        from engine_table import decode_target
    finally:
        sys.path.remove(str(BENCH))

    big, small = SHAPES["8b"], SHAPES["0.6b"]
    assert decode_target(big, 1, 512) == ("<=", 1.3) and decode_target(small, 1, 512) == ("<=", 2.5)
    assert decode_target(big, 64, 512) == (">=", 0.75) and decode_target(small, 8, 512) is None
    assert decode_target(small, 1, 32768) == ("<=", 1.3) and decode_target(small, 1, 8192) is None
    assert decode_target(big, 4, 8192) == decode_target(small, 8, 32768) == (">=", 0.85)
    assert decode_target(small, 64, 8192) is None
    assert SHAPES["0.6b"]["max_position_embeddings"] == SHAPES["8b"]["max_position_embeddings"] == 40960


def test_with_knobs_sets_an_engine_constant_before_the_script_and_refuses_a_typo(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import sys\nimport engine.kernels.moe_tiles as m\nprint('tiles', m.SPARSE_TILES, sys.argv[1:])\n")
    probe = os.path.join("bench", "probes", "with_knobs.py")
    p = run_script(probe, "--set", "engine.kernels.moe_tiles.SPARSE_TILES=(16, 16, 64, 128, 4, 4)", str(script), "--", "-x", "1")
    assert p.returncode == 0, p.stderr
    assert "tiles (16, 16, 64, 128, 4, 4) ['-x', '1']" in p.stdout
    p = run_script(probe, "--set", "engine.kernels.fused_moe.SPARSE_TILE=(1,)", str(script))
    assert p.returncode != 0 and "has no SPARSE_TILE" in p.stderr
