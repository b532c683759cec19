"""palestra.cli.dashboard (reading metrics.jsonl, planning and drawing the dashboard) and `palestra plot`."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from palestra.cli.dashboard import MetricsFileWarning, MetricsNotFoundError, plan_panels, plot_dashboard, read_metrics


def training_records(steps: int = 12) -> list[dict[str, Any]]:
    """What a PPO run on a two-component reward logs, with held-out eval every 4 steps and per-agent entropy."""
    records = []
    for s in range(1, steps + 1):
        r: dict[str, Any] = {
            "step": s,
            "time": 1.7e9 + s,
            "reward/mean": s / steps,
            "reward/ema": s / (2 * steps),
            "reward/format": min(1.0, 2 * s / steps),
            "reward/correctness": s / steps / 2,
            "reward/max": 2.0,
            "policy/entropy": 2.0 - s / steps,
            "policy/entropy/responder": 1.5,
            "policy/kl": s / 1000,
            "policy/clip_frac": 0.1,
            "value/loss": 1.0 / s,
            "value/explained_var": None if s == 3 else 1 - 1.0 / s,  # a NaN that the jsonl logger wrote as null
            "grad/norm": 1.0 + 1 / s,
            "grad/update_ratio": 1e-3 / s,
            "response/length": 10.0 + s,
            "perf/tokens_per_s": 900.0 + s,
            "perf/gen_tokens_per_s": 2000.0 + s,
            "perf/step_s": 0.5,
            "loss": 0.25 - s / 100,
            "lr": 1e-4,
            "note": "warmup" if s < 3 else "main",  # not a number: never plotted
            "diverged/x": None,  # never finite: no panel
        }
        if s % 4 == 0:
            r["eval/reward"] = s / steps
            r["eval/format"] = 1.0
        records.append(r)
    return records


def write_run(run_dir: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


# ---- reading -----------------------------------------------------------------------------------------
def test_read_metrics_tolerates_a_truncated_last_line_and_reads_null_as_nan(tmp_path: Path) -> None:
    records = training_records(5)
    run = write_run(tmp_path / "run", records, tail='{"step": 6, "reward/mean": 0.')
    # a cut-short last line is expected after a crash: read past it, but say that a record was left out
    with pytest.warns(MetricsFileWarning, match=r"\(first at line 6\): the last line is cut short"):
        got = read_metrics(run)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert math.isnan(got[2]["value/explained_var"]) and got[1]["value/explained_var"] == pytest.approx(0.5)
    assert got[0]["reward/mean"] == records[0]["reward/mean"] and got[0]["note"] == "warmup"
    with pytest.warns(MetricsFileWarning):
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]  # a file path works too


def test_read_metrics_warns_about_unreadable_lines_in_the_middle(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1}\nnot json\n[1, 2]\n\n{"step": 2, "x": 2}\n')
    with pytest.warns(MetricsFileWarning, match=r"skipped 2 unreadable line\(s\) \(first at line 2\)"):
        got = read_metrics(run)
    assert got == [{"step": 1, "x": 1}, {"step": 2, "x": 2}]


def test_read_metrics_names_the_missing_path(tmp_path: Path) -> None:
    with pytest.raises(MetricsNotFoundError, match=f"run directory '{tmp_path / 'nope'}' does not exist"):
        read_metrics(tmp_path / "nope")
    with pytest.raises(MetricsNotFoundError, match=f"'{tmp_path}' has no metrics.jsonl"):
        read_metrics(tmp_path)


# ---- planning ----------------------------------------------------------------------------------------
def test_plan_panels_groups_the_metrics_that_exist() -> None:
    panels = plan_panels(training_records())  # None (JSON null) counts as NaN, as read_metrics returns it
    assert [p.title for p in panels] == [
        "reward",
        "policy entropy",
        "KL to reference",
        "value loss",
        "explained variance",
        "grad norm",
        "update ratio",
        "response length",
        "tokens/s",
        "loss",
        "eval",  # eval/<component>, an extra group (its points are never folded)
        "constants",  # clip fraction, learning rate and perf/step_s never changed: one line each
    ]
    by_title = {p.title: p for p in panels}
    reward = by_title["reward"]
    assert [(s.label, s.style) for s in reward.series] == [
        ("mean", "line"),
        ("ema", "line"),
        ("format", "line"),
        ("correctness", "line"),
        ("eval", "points"),
        ("max", "hline"),
    ]
    assert reward.series[4].steps == [4.0, 8.0, 12.0] and reward.series[4].values == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert [s.label for s in by_title["policy entropy"].series] == ["entropy", "responder"]  # a per-agent variant joins
    assert [s.label for s in by_title["tokens/s"].series] == ["tokens_per_s", "gen_tokens_per_s"]
    assert by_title["constants"].text == ["clip fraction: 0.1", "learning rate: 0.0001", "perf/step_s: 0.5"]
    assert by_title["grad norm"].robust and by_title["tokens/s"].robust and not by_title["reward"].robust
    assert by_title["update ratio"].log_y and not by_title["grad norm"].log_y
    assert [(s.label, s.style) for s in by_title["eval"].series] == [("format", "points")] and by_title["eval"].legend
    ev = by_title["explained variance"].series[0]
    assert len(ev.values) == 12 and math.isnan(ev.values[2])  # a gap in the line, not a dropped point


def test_plan_panels_skips_groups_without_data() -> None:
    panels = plan_panels(
        [
            {"step": 1, "reward/mean": 0.5, "agent/responder/reward": 0.25, "x": math.nan},
            {"step": 2, "reward/mean": 0.75, "agent/responder/reward": 0.5},
        ]
    )
    assert [p.title for p in panels] == ["reward", "agent"]
    assert [s.label for s in panels[1].series] == ["responder/reward"]
    assert plan_panels([]) == []


# ---- drawing -----------------------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_plot_dashboard_writes_a_png_grid_into_the_run_dir(tmp_path: Path) -> None:
    run = write_run(tmp_path / "my-run", training_records())
    out = plot_dashboard(run)
    assert out == run / "dashboard.png"
    width, height = png_size(out)
    # 12 panels in 3 columns of 6.4 inches (the axes and their legend) at 100 dpi: 1920 pixels wide, 4 rows tall
    assert width == 1920 and height > 4 * 300 and out.stat().st_size > 20_000
    custom = plot_dashboard(run, tmp_path / "elsewhere" / "d.png", columns=2)
    assert png_size(custom)[0] == 1280


def test_plot_dashboard_refuses_a_file_without_numbers(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [{"step": 1, "note": "hi"}])
    with pytest.raises(ValueError, match="no numeric metrics to plot"):
        plot_dashboard(run)


# ---- the command -------------------------------------------------------------------------------------
def palestra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "palestra", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.slow
def test_palestra_plot_writes_the_png_and_prints_its_path(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", training_records(4))
    out = tmp_path / "figs" / "dash.png"
    done = palestra("plot", str(run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out) and png_size(out)[0] == 1920


def test_palestra_plot_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    done = palestra("plot", str(missing))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"palestra plot: error: run directory '{missing}' does not exist"
    empty = tmp_path / "empty-run"
    empty.mkdir()
    done = palestra("plot", str(empty))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and f"'{empty}' has no metrics.jsonl" in done.stderr
