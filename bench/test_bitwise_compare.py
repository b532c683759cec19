"""bitwise_compare's rules on hand-made run folders: what it ignores (the wall clock, a run's id, numpy's global
RNG) and what it must catch (one flipped bit, a sign of zero, a missing step checkpoint, a changed metric).

    pytest -q bench/test_bitwise_compare.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bitwise_compare import compare_runs


def state(run_id: str = "a", saved_at: float = 1.0, numpy_key: list[int] | None = None) -> dict[str, Any]:
    return {
        "format": 3, "run_id": run_id, "saved_at": saved_at, "integrity": {"sha256": run_id * 8}, "step": 2,
        "policy": {"w": torch.tensor([1.0, -0.0, math.nan]), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "reward_ema": 0.25, "logs": {"metrics.jsonl": 1234 + len(run_id)},
        "rng": [{"python": [3, [1, 2, 3], None], "torch": torch.arange(4, dtype=torch.uint8),
                 "numpy": ["MT19937", numpy_key or [7, 8], 0]}],
    }  # fmt: skip


def write_run(folder: Path, metrics: list[dict[str, Any]], states: dict[str, dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    for name, value in states.items():
        (folder / name).parent.mkdir(exist_ok=True)
        torch.save(value, folder / name)
    return folder


METRICS = [{"step": 1, "loss": 0.5, "time": 1.0, "perf/step_s": 0.1}, {"step": 2, "loss": math.nan, "time": 2.0}]
NAMES = ("checkpoint.pt", "checkpoints/step-000001.pt")


@pytest.fixture
def before(tmp_path: Path) -> Path:
    return write_run(tmp_path / "before", METRICS, {n: state() for n in NAMES})


def test_two_runs_differing_only_in_clock_id_and_numpy_state_are_identical(before: Path, tmp_path: Path) -> None:
    metrics = [dict(m, time=m["time"] + 9) for m in METRICS]
    metrics[0]["perf/step_s"] = 0.7
    after = write_run(tmp_path / "after", metrics, {n: state("b", 5.0, [9, 9]) for n in NAMES})
    found = compare_runs(before, after)
    assert (found.problem, found.metric_lines, found.checkpoints) == (None, 2, 2)


def test_one_flipped_bit_in_a_step_checkpoint_is_found(before: Path, tmp_path: Path) -> None:
    flipped = state()
    flipped["policy"]["b"] = torch.tensor([0.0, 2.0**-133], dtype=torch.bfloat16)  # a subnormal: the lowest bit
    after = write_run(tmp_path / "after", METRICS, {"checkpoint.pt": state(), "checkpoints/step-000001.pt": flipped})
    assert compare_runs(before, after).problem == "checkpoints/step-000001.pt: tensor policy.b differs"


def test_zero_and_minus_zero_differ_bitwise(before: Path, tmp_path: Path) -> None:
    signed = state()
    signed["policy"]["w"] = torch.tensor([1.0, 0.0, math.nan])
    after = write_run(tmp_path / "after", METRICS, {"checkpoint.pt": signed, "checkpoints/step-000001.pt": state()})
    assert compare_runs(before, after).problem == "checkpoint.pt: tensor policy.w differs"


def test_a_plain_value_python_rng_and_the_metrics_are_compared(before: Path, tmp_path: Path) -> None:
    changed = state()
    changed["rng"][0]["python"][1] = [1, 2, 4]
    after = write_run(tmp_path / "after", METRICS, {"checkpoint.pt": changed, "checkpoints/step-000001.pt": state()})
    assert compare_runs(before, after).problem.startswith("checkpoint.pt: value rng[0].python[1] differs")
    metrics = [dict(METRICS[0], loss=0.5000001), METRICS[1]]
    after = write_run(tmp_path / "after2", metrics, {n: state() for n in NAMES})
    assert compare_runs(before, after).problem.startswith("metrics.jsonl line 1 differs at loss")


def test_a_missing_step_checkpoint_is_a_difference(before: Path, tmp_path: Path) -> None:
    after = write_run(tmp_path / "after", METRICS, {"checkpoint.pt": state()})
    assert compare_runs(before, after).problem.startswith("checkpoint files differ")


def mappo_state(layout: str) -> dict[str, Any]:
    """MAPPO's optimiser state as issue 12 left it ("new") or as it was before ("old")."""
    critic = {"w": torch.ones(2)}
    if layout == "old":
        return dict(
            state(), optimizer={"optimizers": {"shared": {"lr": 0.1}}, "critic": critic, "counters": {"steps": 3}}
        )
    schedulers = {"shared": {"last_epoch": 3}, "critic": {"last_epoch": 3}}
    return dict(
        state(),
        optimizer={"optimizers": {"shared": {"lr": 0.1}}, "extra": {"critic": critic}, "schedulers": schedulers},
    )


def test_mappo_checkpoints_of_one_layout_are_compared_key_by_key(tmp_path: Path) -> None:
    before = write_run(tmp_path / "before", METRICS, {"checkpoint.pt": mappo_state("new")})
    assert (
        compare_runs(before, write_run(tmp_path / "same", METRICS, {"checkpoint.pt": mappo_state("new")})).problem
        is None
    )
    other = mappo_state("new")
    other["optimizer"]["schedulers"]["critic"]["last_epoch"] = 2
    found = compare_runs(before, write_run(tmp_path / "other", METRICS, {"checkpoint.pt": other})).problem
    assert found == "checkpoint.pt: value optimizer.schedulers.critic.last_epoch differs: 3 vs 2"


def test_mappo_before_issue_12_is_compared_with_its_moved_keys(tmp_path: Path) -> None:
    before = write_run(tmp_path / "before", METRICS, {"checkpoint.pt": mappo_state("old")})
    assert (
        compare_runs(before, write_run(tmp_path / "after", METRICS, {"checkpoint.pt": mappo_state("new")})).problem
        is None
    )
    moved = mappo_state("new")
    moved["optimizer"]["extra"]["critic"]["w"] = torch.tensor([1.0, 2.0])
    found = compare_runs(before, write_run(tmp_path / "moved", METRICS, {"checkpoint.pt": moved})).problem
    assert found == "checkpoint.pt: tensor optimizer.critic.w differs"
