"""train.async: a rollout worker process sampling `lag` steps ahead, as real `palestra train` processes.

What must hold: the same seed gives the same run; the first `lag + 1` steps train on batches sampled with the starting
weights (so step 1 is the synchronous run's step 1); a run killed mid-way resumes bitwise (the batches in flight are
sampled again with the weights its checkpoint kept); and the worker's faults are the run's: a dead worker is one
line and a saved step, a hung one is named by the watchdog, SIGTERM and SIGKILL end both processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_resume import killed_and_resumed, metric_lines
from train_processes import error_line, install_plugin, palestra, start

from palestra.engine import checkpoint as ckpt
from palestra.engine.rollout_worker import RolloutWorkerError, WeightRing

RUN = {"steps": 8, "save_every": 2, "keep_checkpoints": 4}
WORKER_LINE = re.compile(r"rollout worker pid (\d+)")


def _config(tmp_path: Path, raw: dict[str, Any], name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status  # a zombie has ended; its parent just has not reaped it


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _worker_pid(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> int:
    """Read the run's stderr up to the line naming its rollout worker."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        found = WORKER_LINE.search(line)
        if found:
            return int(found.group(1))
    raise AssertionError("the run never named its rollout worker")


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists(), f"{path.name} was never written"


# ---- the schedule -------------------------------------------------------------------------------------------
@pytest.mark.slow  # three short runs in subprocesses: ~15 s
def test_an_async_run_is_the_same_every_time_and_its_first_step_is_the_synchronous_one(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    runs = {}
    for name, lag in (("a", 1), ("b", 1), ("sync", None)):
        raw = raw_config(Path("runs"), name=name, **RUN)
        raw["train"]["async"] = None if lag is None else {"lag": lag}
        result = palestra(["--config", str(_config(tmp_path, raw, f"{name}.yaml"))], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = metric_lines(tmp_path / "runs" / name)
    a, b, sync = runs["a"], runs["b"], runs["sync"]
    assert a == b  # the lag is fixed, not "whatever arrived"
    # metrics[0] is the evaluation before training; [1] step 1: sampled with the starting weights on both sides
    assert {k: v for k, v in a[1].items() if k != "rollout/policy_lag"} == sync[1]
    assert a[1]["rollout/policy_lag"] == 0.0
    assert all(m["rollout/policy_lag"] == 1.0 for m in a[2:-1])  # step t trains on version t - 1
    assert a[2]["loss"] != sync[2]["loss"]  # and that batch is not the synchronous run's


def test_the_weight_ring_hands_out_only_the_version_it_holds() -> None:
    ring = WeightRing({"w": torch.zeros(3)}, slots=2)
    ring.publish(4, {"w": torch.full((3,), 4.0)})
    ring.publish(5, {"w": torch.full((3,), 5.0)})
    assert torch.equal(ring.read(4)["w"], torch.full((3,), 4.0))
    ring.publish(6, {"w": torch.full((3,), 6.0)})  # slot 0: version 4 is gone
    assert torch.equal(ring.read(6)["w"], torch.full((3,), 6.0))
    with pytest.raises(RolloutWorkerError, match="version 4 wanted, the ring holds 6"):
        ring.read(4)


# ---- resume -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_async_run_killed_mid_way_resumes_bitwise(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    """SIGKILL after the second step checkpoint, resume: the same weights, optimiser and metrics as a run never
    stopped. The checkpoint kept the `lag` versions its batches in flight were sampled with. Lag 2: two versions in
    flight (the DAPO and LoRA resume tests run lag 1)."""
    lag = 2
    raw = raw_config(Path("runs"), **RUN)
    raw["train"]["async"] = {"lag": lag}
    run_a, run_b = killed_and_resumed(_config(tmp_path, raw), tmp_path, steps=RUN["steps"], save_every=2)
    a, b = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME), ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    assert metric_lines(run_a) == metric_lines(run_b)
    saved = ckpt.load_checkpoint(run_b / "checkpoints" / ckpt.step_name(4))
    assert saved["async"]["lag"] == lag
    assert sorted(saved["async"]["versions"], key=int) == [str(v) for v in range(max(0, 4 - lag), 4)]


@pytest.mark.slow
def test_an_async_dapo_run_with_refill_resumes_bitwise(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    """Refills are requested from the worker when a batch lacks signal, sampled with that batch's weights."""
    raw = raw_config(Path("runs"), **RUN)
    raw["optimizer"] = {"name": "dapo", "options": {"dynamic_sampling": True, "refill_rounds": 2, "entropy_coef": 0.01}}
    raw["train"]["async"] = {"lag": 1}
    run_a, run_b = killed_and_resumed(_config(tmp_path, raw), tmp_path, steps=RUN["steps"], save_every=2)
    lines = metric_lines(run_b)
    assert lines == metric_lines(run_a)
    assert any(m.get("rollout/refill_rounds", 0) > 0 for m in lines)


# ---- faults -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_dead_worker_is_one_line_and_a_saved_step_that_resumes_bitwise(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(Path("runs"), **{**RUN, "save_every": 0})
    raw["train"]["async"] = {"lag": 1}
    config = _config(tmp_path, raw)
    (tmp_path / "whole").mkdir()
    whole = palestra(["--config", str(config)], tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]

    proc = start(["--config", str(config)], tmp_path)
    pid = _worker_pid(proc)
    run_dir = tmp_path / "runs" / "r"
    log = run_dir / "log.jsonl"
    deadline = time.monotonic() + 60
    while (not log.exists() or len(log.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err[-3000:]
    said = [x for x in err.strip().splitlines() if not WORKER_LINE.search(x)]
    assert len(said) == 1, err[-3000:]  # the line that named the worker at the start, then this one
    line = said[0]
    assert f"rollout worker (pid {pid}) died while it sampled step" in line
    assert "killed by SIGKILL" in line and "palestra train --resume runs/r continues it" in line
    assert "Traceback" not in err
    saved = int(re.search(r"the run saved step (\d+)", line).group(1))  # type: ignore[union-attr]
    assert (run_dir / "checkpoints" / ckpt.step_name(saved)).exists()

    resumed = palestra(["--resume", str(run_dir)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metric_lines(run_dir) == metric_lines(tmp_path / "whole" / "runs" / "r")


@pytest.mark.slow
def test_sigterm_stops_the_learner_at_a_step_boundary_and_ends_the_worker(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(Path("runs"), **{**RUN, "steps": 400, "save_every": 0})
    raw["train"]["async"] = {"lag": 2}
    proc = start(["--config", str(_config(tmp_path, raw))], tmp_path)
    pid = _worker_pid(proc)
    _wait_for(tmp_path / "runs" / "r" / "log.jsonl", proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err
    assert _gone(pid), "the rollout worker outlived the run"
    saved = ckpt.list_step_checkpoints(tmp_path / "runs" / "r")
    assert saved, "nothing was saved"


@pytest.mark.slow
def test_a_killed_learner_takes_its_worker_with_it(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    raw = raw_config(Path("runs"), **{**RUN, "steps": 400, "save_every": 0})
    raw["train"]["async"] = {"lag": 1}
    proc = start(["--config", str(_config(tmp_path, raw))], tmp_path)
    pid = _worker_pid(proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert _gone(pid), "the rollout worker outlived a killed learner"


HANG_PLUGIN = "palestra_async_hang_plugin"
HANG_SOURCE = textwrap.dedent(
    '''
    """Installed by test_async_rollouts.py: arithmetic whose training instance hangs at its third reset."""
    import time
    from dataclasses import dataclass

    from palestra import hookimpl
    from palestra.plugins.envs.arithmetic import ArithmeticEnv, ArithmeticOptions


    @dataclass
    class HangingOptions(ArithmeticOptions):
        hang_at: int = 3
        fail: bool = False  # raise instead of hanging


    class Hanging(ArithmeticEnv):
        def __init__(self, hang_at=3, fail=False, **options):
            super().__init__(**options)
            self.hang_at, self.fail, self.resets = hang_at, fail, 0

        def reset(self, batch_size, *, seed=None, group_size=1):
            self.resets += 1
            if group_size > 1 and self.resets >= self.hang_at:  # training resets only (evaluation uses groups of 1)
                if self.fail:
                    raise ValueError("this reset fails")
                time.sleep(3600)
            return super().reset(batch_size, seed=seed, group_size=group_size)


    @hookimpl
    def register_environments(register):
        register("hanging", Hanging, options=HangingOptions, description="arithmetic that hangs at a reset")
    '''
)


def _hanging_run(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]], **train: Any
) -> tuple[Path, dict[str, Any]]:
    """The plugin above installed, and an async run of its environment: (the plugin's folder, the raw config)."""
    (tmp_path / "site").mkdir()
    site = install_plugin(tmp_path / "site", HANG_PLUGIN, HANG_SOURCE, "async_hang")
    raw = raw_config(Path("runs"), **{**RUN, "save_every": 0, **train})
    raw["environment"]["name"] = "hanging"
    raw["train"]["async"] = {"lag": 1}
    return site, raw


def _the_one_line(tmp_path: Path, raw: dict[str, Any], site: Path) -> str:
    """Run ``raw`` to its failure (exit 2) and return the one line it said, besides naming its worker."""
    result = palestra(["--config", str(_config(tmp_path, raw))], tmp_path, site=site)
    assert result.returncode == 2, result.stderr[-3000:]
    said = [x for x in result.stderr.strip().splitlines() if not WORKER_LINE.search(x)]
    assert len(said) == 1, result.stderr[-3000:]
    return said[0]


@pytest.mark.slow
def test_a_hung_worker_is_named_by_the_watchdog_and_ends_with_the_run(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    site, raw = _hanging_run(tmp_path, raw_config, step_timeout_s=3, data_timeout_s=None)
    proc = start(["--config", str(_config(tmp_path, raw))], tmp_path, site=site)
    pid = _worker_pid(proc)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 70, err[-3000:]
    assert f"phase 'rollout worker (pid {pid})' of step" in err
    assert _gone(pid), "the hung worker outlived the run"


@pytest.mark.slow
def test_an_error_inside_the_worker_is_one_line_with_its_message_and_a_saved_step(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    site, raw = _hanging_run(tmp_path, raw_config)
    raw["environment"]["options"]["fail"] = True
    said = _the_one_line(tmp_path, raw, site)
    # resets 1 and 2 sample steps 1 and 2; the third, step 3's batch, fails; the learner has trained steps 1 and 2
    assert re.fullmatch(
        r"palestra train: error: rollout worker \(pid \d+\) failed while it sampled step 3's batch: "
        r"EnvironmentProtocolError: environment 'hanging': reset raised ValueError: this reset fails; "
        r"the run saved step 2: palestra train --resume runs/r continues it",
        said,
    ), said


@pytest.mark.slow
def test_a_worker_that_fails_during_a_refill_names_the_checkpoint_to_resume_from(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    """The step has scored its batch (the reward's state has moved), so its boundary is not saved: the newest
    checkpoint is where a resume starts, and the run says which one."""
    site, raw = _hanging_run(tmp_path, raw_config, save_every=1)
    raw["environment"]["options"].update(fail=True, hang_at=4)
    raw["reward"] = {"name": "correctness"}  # the untrained policy scores 0 everywhere: every group asks a refill
    raw["optimizer"] = {"name": "dapo", "options": {"dynamic_sampling": True, "refill_rounds": 1}}
    said = _the_one_line(tmp_path, raw, site)
    # resets 1 and 2 sample steps 1 and 2, 3 step 1's refill; 4, step 3's batch (asked after step 1), fails while
    # the learner awaits step 2's refill, having scored step 2's batch
    assert re.fullmatch(
        r"palestra train: error: rollout worker \(pid \d+\) failed while it sampled step 3's batch: "
        r"EnvironmentProtocolError: .*this reset fails; "
        r"palestra train --resume runs/r continues from step 1, its newest checkpoint",
        said,
    ), said
    assert ckpt.list_step_checkpoints(tmp_path / "runs" / "r")[-1][0] == 1


# ---- what async cannot run with -----------------------------------------------------------------------------
def test_async_refuses_a_multi_agent_run_in_one_line(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    raw = raw_config(Path("runs"))
    raw["environment"] = {"name": "relay"}
    raw["agents"] = {}
    raw["train"]["async"] = {"lag": 1}
    result = palestra(["--config", str(_config(tmp_path, raw))], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result).startswith("palestra train: error: train.async: multi-agent runs")


def test_a_negative_lag_names_its_key(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    raw = raw_config(Path("runs"))
    raw["train"]["async"] = {"lag": -1}
    result = palestra(["--config", str(_config(tmp_path, raw))], tmp_path)
    assert result.returncode == 2
    assert "train.async.lag: must be >= 0, got -1" in error_line(result)


def test_lag_zero_is_the_synchronous_run(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    lines = {}
    for name, section in (("zero", {"lag": 0}), ("none", None)):
        raw = raw_config(Path("runs"), name=name, steps=2)
        raw["train"]["async"] = section
        result = palestra(["--config", str(_config(tmp_path, raw, f"{name}.yaml"))], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "rollout worker" not in result.stderr
        lines[name] = [json.dumps(m, sort_keys=True) for m in metric_lines(tmp_path / "runs" / name)]
    assert lines["zero"] == lines["none"]


@pytest.mark.slow
def test_an_async_lora_run_sends_only_the_adapters_and_resumes_bitwise(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    pytest.importorskip("peft")
    import tiny_hf
    from test_resume_lora import lora_sections

    model_dir = tiny_hf.build_qwen2(tmp_path / "model")
    raw = raw_config(sections=lora_sections(model_dir), steps=8, batch_size=2, lr=1e-2, eval_size=2, save_every=2)
    raw["train"]["async"] = {"lag": 1}
    again = (f"policy.options.path={model_dir}",)  # the model lies outside the run: named again to resume
    run_a, run_b = killed_and_resumed(_config(tmp_path, raw), tmp_path, steps=8, save_every=2, timeout=180, again=again)
    a, b = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME), ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "adapters differ after resume"
    assert metric_lines(run_a) == metric_lines(run_b)
    kept = a["async"]["versions"]["7"]  # the version step 8's batch was sampled with: the adapters alone
    assert kept.keys() == a["policy"].keys() and len(kept) == 8
    assert any(not torch.equal(kept[k], a["policy"][k]) for k in kept)  # one update older than the final adapters


def test_the_async_section_is_spelled_async_in_a_config() -> None:
    from palestra.config import load_config

    config = load_config(None, ["train.async.lag=2"])
    assert config.train.async_ is not None and config.train.async_.lag == 2
    assert config.to_dict()["train"]["async"] == {"lag": 2, "threads": 1, "start_timeout_s": 600.0}
    assert load_config(None).to_dict()["train"]["async"] is None  # synchronous unless asked
    with pytest.raises(Exception, match=r"train.async_: unknown key; did you mean 'async'\?"):
        load_config(None, ["train.async_={lag: 1}"])


def test_an_async_run_leaves_the_workers_cores_to_it() -> None:
    from palestra.scale.cpu_threads import ThreadChoice, leave_cores_to_the_worker

    found = ThreadChoice(4, "free cores", "palestra: 4 CPU threads (4 cores, 0.0 busy with other work); set ...")
    choice = leave_cores_to_the_worker(found, 1)
    assert choice.threads == 3
    assert choice.line.startswith("palestra: 4 CPU threads (4 cores, 0.0 busy with other work): 3 for the learner, 1")
    assert leave_cores_to_the_worker(ThreadChoice(1, "free cores", "x; y"), 2).threads == 1  # never none


def test_the_gpu_training_script_asks_for_a_valid_config() -> None:
    """bench/gpu_train.py runs once a GPU is lent, for a few minutes: a config error must not spend them."""
    import gpu_train
    from palestra.config import load_config

    for lora in (False, True):
        config = load_config(gpu_train.CONFIG, gpu_train.overrides("cuda", lora, quick=False))
        assert config.train.device == "cuda" and config.train.precision == "bf16"
        assert config.generator.name == "static_kv" and config.optimizer.options.beta == 0.04
        assert (config.policy.options.lora is not None) == lora
        assert config.train.batch_size * config.train.group_size == 64 and config.train.max_new_tokens == 64
