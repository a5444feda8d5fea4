"""Each bench figure against its goal and against the last committed result.

    .venv/bin/python bench/compare.py [NAME ...] [--tolerance 0.1] [--strict]
    .venv/bin/python bench/compare.py --record NAME ...   # after a run you accept

The benches write ``bench/results/<name>.json`` (ignored by git). ``--record`` copies one
into ``bench/baseline/<name>.json``, which is committed: the figures the READMEs quote. The
comparison reads the baseline as of ``HEAD`` (``git show HEAD:bench/baseline/<name>.json``;
the working-tree copy where git has none), so after ``--record`` the diff of the baseline
file shows in review, and this script's output says for every figure whether it moved.

A figure is a number at a path in the JSON (``tp1.bfloat16_p2.clip_nxd_over_torch``) with a
goal (``<= 1.0``) and a direction (lower or higher is better), listed in :data:`FIGURES`;
entries of a bench's own ``goals`` mapping are shown as well (numbers or pass/fail). A figure
is a regression when it is worse than the baseline by more than ``--tolerance`` (relative,
default 10 %: these are ratios measured side by side on a shared, noisy machine), or when a
goal the baseline met is now missed. ``--strict`` exits 1 on a regression (nothing runs it
in CI: timings are never asserted).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
BASELINE = BENCH / "baseline"


@dataclass(frozen=True)
class Figure:
    """One number of a bench's JSON and its goal."""

    path: str
    """Dotted keys into the JSON."""
    goal: float | None
    """The goal's bound (None: no goal, tracked for regressions only)."""
    lower_is_better: bool = True
    """Direction: the goal is ``value <= goal`` when True, ``value >= goal`` otherwise."""

    def meets(self, value: float) -> bool | None:
        if self.goal is None:
            return None
        return value <= self.goal if self.lower_is_better else value >= self.goal

    def goal_text(self) -> str:
        if self.goal is None:
            return "-"
        return f"{'<=' if self.lower_is_better else '>='} {self.goal:g}"


FIGURES: dict[str, list[Figure]] = {
    "grad_norm": [
        Figure("tp1.float32_p2.clip_nxd_over_torch", 1.0),
        Figure("tp1.bfloat16_p2.clip_nxd_over_torch", 1.0),
        Figure("tp1.float32_pinf.clip_nxd_over_torch", 1.0),
        Figure("tp1.bfloat16_pinf.clip_nxd_over_torch", 1.0),
        Figure("tp2_fp32_p2.clip_nxd_over_dtensor", 1.0),
    ],
    "checkpoint": [
        Figure("async_blocked_over_sync_save.median", 0.1),
        Figure("loop_blocked_over_sync_save.before_return.median", 0.1),
        Figure("async_before_step_blocked_over_sync_save.median", 0.1),
        Figure("loop_blocked_over_sync_save.before_step.median", 0.1),
        Figure("save_speed_vs_raw_write.median", 0.8, lower_is_better=False),
        Figure("save_speed_vs_dcp.median", 1.5, lower_is_better=False),
        Figure("load_speed_vs_dcp.median", None, lower_is_better=False),
        Figure("async_peak_extra_memory_over_state.median", 1.1),
    ],
    "gpu": [  # bench/gpu/main_job.py on one GPU (issue 28: MFU >= 55% for the 0.9B model)
        Figure("main_job.nxd.mfu.palm", 0.55, lower_is_better=False),
        Figure("main_job.ratio_vs_peer_amp", 1.0, lower_is_better=False),
        Figure("main_job.ratio_vs_peer_bf16_master", 1.0, lower_is_better=False),
        Figure("main_job.nxd.share_of_measured_matmul_rate.palm", None, lower_is_better=False),
        Figure("sweep.fp32_accum4.vs_fp32.loss_rel_max", 1e-4),
        Figure("sweep.resume.vs_fp32_after_resume.loss_rel_max", 1e-4),
    ],
    "pipeline": [  # issue 28: ZB-H1 within 0.02 of its bubble (theory 0.04 at p=2, m=8)
        Figure("results.hidden_512.nxd zb_h1.step_ratio_vs_torch.median", 0.95),
        Figure("results.hidden_512.nxd zb_h1.bubble_measured_median", 0.06),
        Figure("results.hidden_512.split_backward_cost.I+W over B median", None),
    ],
}


def lookup(document: Any, path: str) -> Any:
    """The value at dotted ``path`` (None where a key is missing)."""
    value = document
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def load_baseline(name: str, ref: str = "HEAD") -> dict[str, Any] | None:
    """``bench/baseline/<name>.json`` as committed at ``ref``; the working-tree file where git
    has none (not a repository, or not committed yet); None where neither exists."""
    relative = f"{BASELINE.relative_to(BENCH.parent).as_posix()}/{name}.json"
    try:
        shown = subprocess.run(
            ["git", "show", f"{ref}:{relative}"],
            cwd=BENCH.parent,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        shown = None
    if shown is not None and shown.returncode == 0:
        return json.loads(shown.stdout)
    path = BASELINE / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class Row:
    """One line of the report."""

    bench: str
    figure: str
    value: Any
    goal: str
    met: bool | None
    baseline: Any
    change: float | None
    """value / baseline - 1 (numbers only)."""
    regression: bool


def compare(
    name: str, current: dict[str, Any], baseline: dict[str, Any] | None, tolerance: float
) -> list[Row]:
    """Rows for the registered figures of ``name`` and every entry of its ``goals``."""
    rows = []
    for figure in FIGURES.get(name, []):
        value = _number(lookup(current, figure.path))
        old = _number(lookup(baseline, figure.path)) if baseline else None
        met = None if value is None else figure.meets(value)
        change = None if value is None or not old else value / old - 1.0
        worse = change is not None and (
            change > tolerance if figure.lower_is_better else change < -tolerance
        )
        lost_goal = met is False and old is not None and figure.meets(old) is True
        rows.append(
            Row(name, figure.path, value, figure.goal_text(), met, old, change, worse or lost_goal)
        )
    goals = current.get("goals", {})
    old_goals = (baseline or {}).get("goals", {})
    for key, value in goals.items() if isinstance(goals, dict) else []:
        old = old_goals.get(key) if isinstance(old_goals, dict) else None
        met = value if isinstance(value, bool) else None
        regression = value is False and old is True
        rows.append(Row(name, f"goals[{key}]", value, "", met, old, None, regression))
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value)[:40]


def render(rows: list[Row]) -> str:
    """A plain-text table, one row per figure; regressions marked ``REGRESSION``."""
    header = ["bench", "figure", "value", "goal", "met", "baseline", "change", ""]
    lines = [header]
    for row in rows:
        change = "-" if row.change is None else f"{row.change:+.1%}"
        verdict = "REGRESSION" if row.regression else ""
        met = "-" if row.met is None else ("yes" if row.met else "NO")
        lines.append(
            [
                row.bench,
                row.figure,
                _cell(row.value),
                row.goal,
                met,
                _cell(row.baseline),
                change,
                verdict,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benches (default: every results/*.json)")
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--strict", action="store_true", help="exit 1 on a regression")
    parser.add_argument(
        "--record", action="store_true", help="copy the results into bench/baseline/"
    )
    parser.add_argument("--ref", default="HEAD", help="git revision of the baseline")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.stem for p in RESULTS.glob("*.json"))
    missing = [n for n in names if not (RESULTS / f"{n}.json").exists()]
    if missing:
        parser.error(f"no results for {missing} in {RESULTS} (run the bench first)")
    if args.record:
        BASELINE.mkdir(exist_ok=True)
        for name in names:
            shutil.copyfile(RESULTS / f"{name}.json", BASELINE / f"{name}.json")
            print(f"recorded {BASELINE / name}.json (commit it)")
        return 0
    rows = []
    for name in names:
        current = json.loads((RESULTS / f"{name}.json").read_text())
        rows += compare(name, current, load_baseline(name, args.ref), args.tolerance)
    print(render(rows))
    regressions = [r for r in rows if r.regression]
    if regressions:
        print(f"\n{len(regressions)} regression(s) against {args.ref}")
    return 1 if regressions and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
