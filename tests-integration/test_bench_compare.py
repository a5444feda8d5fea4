"""bench/compare.py: figures against their goals and the committed baseline (no timing)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "compare.py"
_SPEC = importlib.util.spec_from_file_location("bench_compare", _PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
compare = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = compare  # dataclasses look their module up there
_SPEC.loader.exec_module(compare)


def _grad_norm(ratio: float, goal_met: bool) -> dict:
    return {
        "tp1": {"bfloat16_p2": {"clip_nxd_over_torch": ratio}},
        "goals": {"tp1 bfloat16_p2 clip nxd/torch <= 1.0": goal_met},
    }


def test_a_slower_figure_is_a_regression_and_a_lost_goal_too() -> None:
    rows = compare.compare("grad_norm", _grad_norm(1.3, False), _grad_norm(0.9, True), 0.1)
    row = next(r for r in rows if r.figure == "tp1.bfloat16_p2.clip_nxd_over_torch")
    assert (row.value, row.baseline, row.met, row.regression) == (1.3, 0.9, False, True)
    assert row.change == pytest.approx(1.3 / 0.9 - 1)
    goal = next(r for r in rows if r.figure.startswith("goals["))
    assert goal.regression  # met at the baseline, missed now
    table = compare.render(rows)
    assert "REGRESSION" in table
    assert "<= 1" in table


def test_noise_within_tolerance_and_improvements_are_not_regressions() -> None:
    rows = compare.compare("grad_norm", _grad_norm(0.95, True), _grad_norm(0.9, True), 0.1)
    assert not any(r.regression for r in rows)  # +5.6 %, inside 10 %
    rows = compare.compare("grad_norm", _grad_norm(0.5, True), _grad_norm(0.9, True), 0.1)
    assert not any(r.regression for r in rows)
    missing = compare.compare("grad_norm", {}, None, 0.1)  # no figure, no baseline: shown as "-"
    assert all(r.value is None and not r.regression for r in missing)


def test_higher_is_better_figures_regress_downwards() -> None:
    old = {"save_speed_vs_dcp": {"median": 2.0}}
    new = {"save_speed_vs_dcp": {"median": 1.4}}
    row = next(
        r
        for r in compare.compare("checkpoint", new, old, 0.1)
        if r.figure == "save_speed_vs_dcp.median"
    )
    assert row.regression
    assert row.met is False


def test_main_reads_results_and_the_committed_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results, baseline = tmp_path / "results", tmp_path / "baseline"
    results.mkdir()
    (results / "grad_norm.json").write_text(json.dumps(_grad_norm(1.5, False)))
    monkeypatch.setattr(compare, "RESULTS", results)
    monkeypatch.setattr(compare, "BASELINE", baseline)
    monkeypatch.setattr(compare, "load_baseline", lambda name, ref="HEAD": _grad_norm(1.0, True))
    assert compare.main(["grad_norm", "--strict"]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert compare.main(["grad_norm", "--record"]) == 0
    assert json.loads((baseline / "grad_norm.json").read_text()) == _grad_norm(1.5, False)
