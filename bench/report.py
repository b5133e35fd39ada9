"""The one way a benchmark prints its results: a markdown table under a `## title` line.

A suite's table holds targets: each row is a dict (metric, measured, reference, ratio, target,
ok, and a suite's own extra keys), the same dict its JSON keeps under "table". `Rows.add` builds
them, `print_targets` prints them (ok: PASS, FAIL or -; a note column when a row has a note).
Kernel benchmarks and probes print tables of their own columns with `print_table`. Every cell goes
through `cell`, so numbers read the same in every table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

TARGET_HEAD = ("metric", "measured", "reference", "ratio", "target", "ok")


def cell(x: Any) -> str:
    """None or NaN: '-'; text as it is; bools yes/no; ints whole; floats to 4 significant digits
    below 1, 3 decimals below 10, 1 decimal above (scientific below 0.01)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    a = abs(x)
    if a == 0:
        return "0"
    if a < 0.01:
        return f"{x:.3g}"
    return f"{x:.4f}" if a < 1 else f"{x:.3f}" if a < 10 else f"{x:.1f}"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else "PASS" if ok else "FAIL"


def over(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return a / b if a is not None and b else None


class Rows(list[dict[str, Any]]):
    """A suite's table rows, in the order they print."""

    def add(self, metric: str, measured: Any, reference: Any = None, ratio: float | None = None,
            target: str = "-", ok: bool | None = None, **extra: Any) -> dict[str, Any]:
        row = dict(metric=metric, measured=measured, reference=reference, ratio=ratio, target=target, ok=ok, **extra)
        self.append(row)
        return row


def print_table(title: str, head: Sequence[str], rows: Iterable[Sequence[Any]], footer: Iterable[str] = ()) -> None:
    """`## title`, then a markdown table of `head` and `rows` (each cell through `cell`), then
    `footer`'s lines."""
    lines = [f"\n## {title}", "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    print("\n".join([*lines, *footer]), flush=True)


def print_targets(title: str, rows: Sequence[dict[str, Any]], extra: Sequence[tuple[str, str]] = (),
                  footer: Iterable[str] = (), reference: str = "reference") -> None:
    """A suite's table: TARGET_HEAD (the reference column named `reference`), then each (header,
    key) of `extra`, then a note column if any row has a note."""
    notes = any(r.get("note") for r in rows)
    head = [*TARGET_HEAD[:2], reference, *TARGET_HEAD[3:], *(h for h, _ in extra), *(["note"] if notes else [])]
    cells = [[r["metric"], r["measured"], r["reference"], r["ratio"], r["target"], verdict(r["ok"]),
              *(r.get(key) for _, key in extra), *([r.get("note") or ""] if notes else [])] for r in rows]
    print_table(title, head, cells, footer)


def run_footer(res: dict[str, Any], total_s: float) -> list[str]:
    """The lines under a suite's table: each crashed section's last line, what was skipped, the
    run's time and its JSON file."""
    lines = [f"section {name} FAILED: {err.strip().splitlines()[-1] if err else ''}"
             for name, err in res.get("errors", {}).items()]
    if res.get("skipped"):
        lines.append(f"skipped (past --deadline-s or not possible here): {', '.join(res['skipped'])}")
    lines.append(f"total {total_s:.0f} s; JSON in {res['meta']['out']}")
    return lines
