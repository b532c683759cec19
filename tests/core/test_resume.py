"""Checkpoint and resume: a run SIGKILLed mid-training and resumed with ``palestra train --resume`` ends with the
same parameters, bitwise, as one that never stopped; the newest K step checkpoints are kept; a partial write never
replaces a good checkpoint; a non-finite reward skips the step and K in a row abort the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from palestra.checked_reward import CheckedReward
from palestra.config import ConfigError, build_run, validate_config
from palestra.engine import checkpoint as ckpt
from palestra.engine.trainer import Trainer, TrainingAborted
from palestra.scale.distributed import DistributedContext

STEPS, SAVE_EVERY, KEEP = 12, 3, 2
# conftest's raw_config (reinforce with replay and running normalisation, a layered reward: every kind of state a
# resume must carry), longer, with held-out evaluations on the way
RESUME = {"steps": STEPS, "eval_every": 6, "save_every": SAVE_EVERY, "keep_checkpoints": KEEP}


def palestra(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALESTRA_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "palestra", "train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]


def metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith("perf/")} for m in lines]


def killed_and_resumed(
    config: Path, tmp_path: Path, *, steps: int, save_every: int, timeout: float = 120, again: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """Run ``config`` twice (in ``tmp_path/a`` and ``tmp_path/b``); SIGKILL the second once its second step
    checkpoint exists and resume it to ``steps`` (``again``: the saved values the resume passes again, such as a
    model folder outside the run). Returns the two run directories, both finished."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = palestra(["--config", str(config)], tmp_path / "a")
    killed = palestra(["--config", str(config)], tmp_path / "b")
    run_a, run_b = tmp_path / "a" / "runs" / "r", tmp_path / "b" / "runs" / "r"
    wanted = run_b / "checkpoints" / ckpt.step_name(2 * save_every)
    deadline = time.monotonic() + timeout
    while not wanted.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (run_b / ckpt.FINAL_NAME).exists(), "the run finished before the kill; nothing was resumed"
    finish(whole, timeout=timeout)

    resumed = palestra(["--resume", str(run_b), f"train.steps={steps}", *again], tmp_path / "b")
    out, err = resumed.communicate(timeout=timeout)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming {run_b}" in out
    return run_a, run_b


@pytest.mark.slow  # two training runs in subprocesses, one killed and resumed: 10-14 s
def test_a_run_killed_mid_training_resumes_to_the_same_parameters_bitwise(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw_config(Path("runs"), **RESUME)))
    run_a, run_b = killed_and_resumed(config, tmp_path, steps=STEPS, save_every=SAVE_EVERY)

    a = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME)  # weights_only, checksum verified
    b = ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert a["step"] == b["step"] == STEPS
    assert a["policy"].keys() == b["policy"].keys()
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    opt_a, opt_b = a["optimizer"]["optimizer"]["state"], b["optimizer"]["optimizer"]["state"]
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    assert a["reward"] == b["reward"] and a["reward_ema"] == b["reward_ema"]
    # metrics.jsonl: the killed run's lines after its checkpoint were cut, so every step appears once, as in run a
    assert metric_lines(run_a) == metric_lines(run_b)
    # keep-last-K, and `latest` names the newest
    kept = [p.name for _, p in ckpt.list_step_checkpoints(run_b)]
    steps = list(range(SAVE_EVERY, STEPS, SAVE_EVERY))
    assert kept == [ckpt.step_name(s) for s in steps[-KEEP:]]
    assert (run_b / "checkpoints" / "latest").read_text().strip() == kept[-1]
    assert not list((run_b / "checkpoints").glob(".*"))


@pytest.mark.slow
def test_a_dapo_run_with_refill_resumes_bitwise(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    """DAPO's refill rounds sample from seeds derived from the step and the round: the resumed run draws the same."""
    raw = raw_config(Path("runs"), **RESUME)
    raw["optimizer"] = {"name": "dapo", "options": {"dynamic_sampling": True, "refill_rounds": 2, "entropy_coef": 0.01}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    run_a, run_b = killed_and_resumed(config, tmp_path, steps=STEPS, save_every=SAVE_EVERY)
    a, b = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME), ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    lines = metric_lines(run_b)
    assert lines == metric_lines(run_a)
    assert any(m.get("rollout/refill_rounds", 0) > 0 for m in lines)  # the refills happened


def test_a_partial_write_never_replaces_a_good_checkpoint(tmp_path: Path) -> None:
    good = {"step": 3, "policy": {"w": torch.arange(4.0)}}
    path = ckpt.save_step_checkpoint(tmp_path, good, 3, keep=2)
    before = path.read_bytes()

    def dies_half_way(tmp: Path) -> None:
        tmp.write_bytes(before[: len(before) // 2])
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.write_atomic(path, dies_half_way)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step-000003.pt"]
    # A SIGKILL mid-write leaves a temporary file (and perhaps no pointer update): it is never read, and the next
    # save clears it.
    (path.parent / ".step-000006.pt.12345.tmp").write_bytes(before[:10])
    assert ckpt.find_resume_checkpoint(tmp_path) == path
    ckpt.save_step_checkpoint(tmp_path, {**good, "step": 6}, 6, keep=2)
    ckpt.save_step_checkpoint(tmp_path, {**good, "step": 9}, 9, keep=2)
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step-000006.pt", "step-000009.pt"]
    assert ckpt.find_resume_checkpoint(tmp_path).name == "step-000009.pt"
    # the final checkpoint.pt wins when it is newer
    ckpt.save_checkpoint({**good, "step": 12}, tmp_path / ckpt.FINAL_NAME)
    assert ckpt.find_resume_checkpoint(tmp_path).name == ckpt.FINAL_NAME
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        ckpt.find_resume_checkpoint(tmp_path / "checkpoints")


def test_resume_allows_only_run_length_and_bookkeeping_overrides(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    from palestra.cli.train import resume_config

    raw = raw_config(tmp_path, **RESUME)
    ckpt.save_checkpoint({"step": 3, "config": validate_config(raw).to_dict()}, tmp_path / ckpt.FINAL_NAME)
    config, _ = resume_config(str(tmp_path), ["train.steps=40", "train.save_every=5"])
    assert (config.train.steps, config.train.save_every, config.train.lr) == (40, 5, 5e-3)
    with pytest.raises(ConfigError, match=r"^train\.lr: cannot be changed with --resume"):
        resume_config(str(tmp_path), ["train.lr=1"])


def test_a_non_finite_reward_skips_the_step_and_k_in_a_row_abort(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(tmp_path, **RESUME)
    raw["train"].update(max_bad_steps=2, save_every=0)
    config = validate_config(raw)
    built = build_run(config, DistributedContext.from_config(config, config.train.device))
    nan = CheckedReward(lambda p, c, m: [float("nan")] * len(c), name="nan_reward")
    trainer = Trainer(config, run_dir=tmp_path / "run", components=dataclasses.replace(built, reward=nan))
    weights = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.step()
    assert metrics["train/skipped"] == 1.0 and trainer.step_index == 1 and trainer.bad_steps == 1
    assert any("step 1 skipped: the reward is not finite" in str(w.message) for w in caught)
    assert all(torch.equal(v, weights[k]) for k, v in trainer.policy.state_dict().items())  # no update
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TrainingAborted, match=r"^train\.max_bad_steps: 2 steps in a row were skipped"):
            trainer.step()
