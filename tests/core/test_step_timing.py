"""Where a training step's time goes: the trainer's ``perf/*_s`` parts and ``palestra bench --e2e``.

No timing thresholds: the parts must be there, be non-negative, and add up to the step time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from palestra.checked_reward import CheckedReward
from palestra.cli import main
from palestra.config import build_run, validate_config
from palestra.engine.trainer import NonFiniteStepWarning, Trainer
from palestra.scale.distributed import DistributedContext

PARTS = ("perf/generate_s", "perf/reward_s", "perf/score_s", "perf/update_s", "perf/overhead_s")


# GRPO with a reference (beta > 0): the score part does work
TIMING = {
    "environment": {"name": "arithmetic", "options": {"difficulty": 1, "prompt": "{question} ="}},
    "reward": {"name": "format", "options": {"tag": "answer"}},
    "policy": {"name": "tiny", "options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}},
    "optimizer": {"name": "grpo", "options": {"beta": 0.05}},
    "kernels": {"backend": "auto"},
    "loggers": [],
    "train": {"steps": 3, "batch_size": 2, "group_size": 4, "max_new_tokens": 4, "device": "cpu", "eval_size": 2},
}


def check_breakdown(metrics: dict[str, float]) -> None:
    for key in (*PARTS, "perf/step_s"):
        assert key in metrics, key
        assert math.isfinite(metrics[key]) and metrics[key] >= 0, (key, metrics[key])
    total = sum(metrics[k] for k in PARTS)
    assert total == pytest.approx(metrics["perf/step_s"], rel=1e-9, abs=1e-9), {
        k: metrics[k] for k in (*PARTS, "perf/step_s")
    }


def test_every_step_reports_its_parts_and_they_sum_to_the_step_time(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    trainer = Trainer(validate_config(raw_config(tmp_path, name="timing", sections=TIMING)), run_dir=tmp_path / "run")
    for _ in range(2):
        metrics = trainer.step()
        check_breakdown(metrics)
        # the phases that ran took time; the reference scoring ran because beta > 0
        assert metrics["perf/generate_s"] > 0 and metrics["perf/update_s"] > 0 and metrics["perf/score_s"] > 0


def test_a_skipped_step_reports_the_parts_it_never_reached_as_zero(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    config = validate_config(raw_config(tmp_path, name="timing", sections=TIMING))
    built = build_run(config, DistributedContext.from_config(config, config.train.device))
    nan = CheckedReward(lambda p, c, m: [math.nan] * len(c), name="nan_reward")  # skipped after the rollout
    trainer = Trainer(config, run_dir=tmp_path / "run", components=dataclasses.replace(built, reward=nan))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteStepWarning)
        metrics = trainer.step()
    assert metrics["train/skipped"] == 1.0
    check_breakdown(metrics)
    assert metrics["perf/score_s"] == 0 and metrics["perf/update_s"] == 0


def test_bench_e2e_prints_the_breakdown_and_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], raw_config: Callable[..., dict[str, Any]]
) -> None:
    out = tmp_path / "steps.json"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw_config(tmp_path, name="timing", sections=TIMING)))
    assert (
        main(["bench", "--e2e", "--config", str(config), "--steps", "2", "train.max_new_tokens=3", "--out", str(out)])
        == 0
    )
    table = capsys.readouterr().out
    for part in ("generate", "reward", "score", "update", "overhead", "step", "completions/s", "tokens/s"):
        assert any(line.split()[0] == part for line in table.splitlines() if line.strip()), (part, table)
    data = json.loads(out.read_text())
    assert data["meta"]["overrides"] == ["train.max_new_tokens=3"] and len(data["steps"]) == 2
    for step in data["steps"]:
        check_breakdown(step)
        assert step["response/length"] <= 3
    rows = {r["part"]: r for r in data["rows"]}
    assert sum(rows[p]["share"] for p in ("generate", "reward", "score", "update", "overhead")) == pytest.approx(1.0)


def test_bench_e2e_flags_are_checked_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--e2e", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "palestra bench: error: --steps: expected at least 1 measured step, got 0"
    assert main(["bench", "--e2e", "--quick"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "palestra bench: error: --quick: only for the kernel benchmark, not with --e2e"
    )
    assert main(["bench", "train.lr=0.1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "palestra bench: error: key=value: only with --e2e (the kernel benchmark takes --ops, --quick and --min-time)"
    )
