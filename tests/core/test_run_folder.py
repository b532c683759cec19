"""The run folder's rules (docs/reliability.md, "Run folder rules and answers"): one writer, nothing written outside
it, every exit path saved and said in one line.

The writer cases run real ``python -m palestra train`` processes side by side (the lock is a kernel ``flock``, so
only real processes can test it); the signal case sends a real SIGHUP; the temporary-file sweep is tested against
a real live process and a real dead one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from train_processes import clean_env, error_line, palestra, start, write_config

from palestra import cli
from palestra.engine import checkpoint as ckpt
from palestra.engine.run_lock import LOCK_NAME, RunLock, RunLocked

ERROR = "palestra train: error: "


def wait_for(proc: subprocess.Popen[str], path: Path, lines: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= lines:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run ended (or stalled) before {path} had {lines} line(s): {proc.poll()}")


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "log.jsonl").read_text().splitlines()]


# ---- one writer per run ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_writer_of_a_live_run_is_refused_naming_the_process_and_a_kill_leaves_no_stale_lock(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, raw_config(steps=5000, save_every=5))  # long enough to outlive the three refusals
    run_dir = tmp_path / "runs" / "r"
    live = start(["--config", "config.yaml"], tmp_path)
    try:
        wait_for(live, run_dir / "checkpoints" / "latest")
        for args in (
            ["--config", "config.yaml"],  # a second start
            ["--resume", "runs/r"],  # a resume of the live run
            ["--config", "config.yaml", "--overwrite"],  # an overwrite under it
        ):
            result = palestra(args, tmp_path)
            assert result.returncode == 2, result.stderr[-3000:]
            line = error_line(result)
            assert line.startswith(f"{ERROR}runs/r is in use by process {live.pid} (a palestra train writing this run)")
            assert live.poll() is None, "the live run died under a refused second writer"
        steps = logged_steps(run_dir)
        assert steps == list(range(len(steps))), "the live run's log was cut or written by another process"
    finally:
        live.kill()  # SIGKILL: the kernel drops the lock with the process
        live.communicate(timeout=60)
    assert (run_dir / LOCK_NAME).exists()  # the file stays; the lock does not
    again = palestra(["--config", "config.yaml", "--overwrite", "train.steps=2"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert logged_steps(run_dir) == [0, 1, 2, 2]


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    # A real second process holds the lock; this process is refused while it lives and gets it once it is killed.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from palestra.engine.run_lock import RunLock; "
         "RunLock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(600)", str(tmp_path / "r")],
        stdout=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(RunLocked, match=f"is in use by process {holder.pid} .*choose another run.name$"):
            RunLock.acquire(tmp_path / "r")
    finally:
        holder.kill()
        holder.wait(timeout=60)
    RunLock.acquire(tmp_path / "r").release()


def test_a_lock_file_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / LOCK_NAME).symlink_to(victim)
    with pytest.raises(RunLocked, match=r"r: cannot lock the run folder \(it is a link\)$"):
        RunLock.acquire(tmp_path / "r")
    assert victim.read_text() == "keep me\n"


def test_a_start_that_fails_before_writing_leaves_no_folder(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path / "runs" / "new")
    lock.release(tidy=True)
    assert list(tmp_path.iterdir()) == []  # runs/ too: this start made it


def test_the_temporary_file_sweep_spares_a_live_process_and_clears_a_dead_ones(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    try:
        live_tmp = tmp_path / f".step-000004.pt.{live.pid}.tmp"
        dead_tmp = tmp_path / f".step-000002.pt.{dead.pid}.tmp"
        for path in (live_tmp, dead_tmp):
            path.write_bytes(b"partial")
        ckpt.sweep_stale_temporaries(tmp_path)
        assert live_tmp.exists() and not dead_tmp.exists()
    finally:
        live.kill()
        live.wait(timeout=60)


# ---- run.name is one path component -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../escaped", "holds a path separator or NUL"),
        ("TMP/absname", "holds a path separator or NUL"),  # TMP: this test's own folder, an absolute path
        ("a/b", "holds a path separator or NUL"),
        ("..", "names the output folder or its parent"),
        (".", "names the output folder or its parent"),
        ("x" * 300, "is longer than a file name may be (255 bytes)"),
    ],
)
def test_a_run_name_that_is_not_one_folder_name_is_one_line_and_writes_nothing(
    name: str,
    why: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raw_config: Callable[..., dict[str, Any]],
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    write_config(work, raw_config())
    monkeypatch.chdir(work)
    name = name.replace("TMP", str(tmp_path))
    code = cli.main(["train", "--config", "config.yaml", f"run.name={name}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"{ERROR}run.name: {why}, got {name[:80]!r}; a run name is one folder name inside run.output_dir"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.yaml", "work"]  # no absname, no escaped


# ---- every exit saves and says one line --------------------------------------------------------------------------
@pytest.mark.slow
def test_sighup_saves_at_a_step_boundary_and_exits_129_with_error_line(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, raw_config(steps=400, save_every=0))
    run_dir = tmp_path / "runs" / "r"
    proc = start(["--config", "config.yaml"], tmp_path)
    wait_for(proc, run_dir / "log.jsonl", 3)  # training, the handlers in place
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 129, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    saved = int(lines[0].split("saved step ")[1].split(";")[0])
    assert (
        lines[0] == f"palestra train: stopped by SIGHUP: saved step {saved}; resume with palestra train --resume runs/r"
    )
    assert ckpt.load_checkpoint(run_dir / "checkpoints" / ckpt.step_name(saved))["step"] == saved
    assert 0 < saved < 400


@pytest.mark.slow
def test_resuming_a_finished_run_logs_no_step_again(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    write_config(tmp_path, raw_config(steps=4))
    run_dir = tmp_path / "runs" / "r"
    first = palestra(["--config", "config.yaml"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    finished = (run_dir / "log.jsonl").read_text()
    assert logged_steps(run_dir) == [0, 1, 2, 3, 4, 4]  # step 4's metrics, then the held-out evaluation at 4
    for _ in range(2):
        again = palestra(["--resume", "runs/r"], tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resuming runs/r from runs/r/checkpoint.pt at step 4 of 4" in again.stdout
    assert (run_dir / "log.jsonl").read_text() == finished


# ---- inputs that blow up ------------------------------------------------------------------------------------------
def config_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = cli.main(["config", "show", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err[:5]
    return err[0]


def test_an_override_nested_5000_deep_is_one_line_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    line = config_error(capsys, "environment.options.x=" + "[" * 5000)
    assert line == (
        f"palestra config: error: override 'environment.options.x={'[' * 78}... (5,022 characters)': "
        "cannot parse the value: nested deeper than 100 levels"
    )


@pytest.mark.parametrize(
    ("text", "where"), [("run:\n  name: " + "[" * 20000, "2:107"), ("a: " + "{a: " * 3000, "1:397")]
)
def test_a_yaml_file_nested_thousands_deep_is_one_line_naming_the_file(
    text: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text + "\n")
    assert (
        config_error(capsys, str(path))
        == f"palestra config: error: {path}:{where}: invalid YAML: nested deeper than 100 levels"
    )


def billion_laughs(levels: int) -> str:
    """A YAML alias bomb in an option value: each level an anchor holding ten aliases of the level below."""
    lines = [
        "environment:",
        "  name: arithmetic",
        "  options:",
        "    prompt:",
        "      - &l0 [" + ", ".join(["lol"] * 10) + "]",
    ]
    lines += [f"      - &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join([*lines, f"    difficulty: *l{levels - 1}", ""])


def test_a_yaml_alias_bomb_is_refused_at_once_in_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(9))  # 10**9 values once expanded: 93 s and 6.3 GB before the bound
    started = time.monotonic()
    line = config_error(capsys, str(path))
    assert time.monotonic() - started < 5
    assert line == (
        f"palestra config: error: {path}:1:1: invalid YAML: its aliases expand it to 2,345,679,020 values "
        "(at most 100,000 more than the text writes out are allowed)"
    )


def test_a_few_aliases_still_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("run: {name: &n aliased, output_dir: *n}\n")
    assert cli.main(["config", "show", str(path)]) == 0
    assert "output_dir: aliased" in capsys.readouterr().out


def test_a_huge_value_in_an_error_is_shown_in_80_characters_without_being_expanded() -> None:
    from palestra.config.validation import _show

    bomb: list[Any] = ["lol"] * 10
    for _ in range(8):
        bomb = [bomb] * 10  # shared, as YAML aliases build it: 10**9 strings once expanded
    started = time.monotonic()
    shown = _show(bomb)
    assert time.monotonic() - started < 1
    assert len(shown) == 80 and shown.startswith("[[[[[") and shown.endswith("...")


# ---- a run that fails before its first checkpoint is no run ------------------------------------------------------
FAILING_PLUGIN = """
from dataclasses import dataclass

from palestra import hookimpl
from palestra.plugins.envs.arithmetic import ArithmeticEnv, ArithmeticOptions


@dataclass
class OutOfTasksOptions(ArithmeticOptions):
    pass


class OutOfTasks(ArithmeticEnv):
    def reset(self, batch_size, *, seed=None, group_size=1):
        raise ValueError("the task server is down")


@hookimpl
def register_environments(register):
    register("out_of_tasks", OutOfTasks, options=OutOfTasksOptions, description="fails on its first reset")
"""


@pytest.fixture(scope="module")
def failing_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("failing-plugin")
    (site / "palestra_out_of_tasks.py").write_text(FAILING_PLUGIN)
    info = site / "palestra_out_of_tasks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: palestra-out-of-tasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[palestra]\nout_of_tasks = palestra_out_of_tasks\n")
    return site


@pytest.mark.slow
def test_a_run_that_fails_at_step_0_leaves_no_run_and_the_rerun_starts(
    tmp_path: Path, failing_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(steps=2)
    raw["loggers"].append({"name": "jsonl"})  # metrics.jsonl too, as the default config writes
    failing = {**raw, "environment": {**raw["environment"], "name": "out_of_tasks"}}
    write_config(tmp_path, failing)
    failed = palestra(["--config", "config.yaml"], tmp_path, site=failing_site)
    assert failed.returncode == 2
    assert "the task server is down" in error_line(failed)
    assert not (tmp_path / "runs").exists(), sorted(p.name for p in (tmp_path / "runs").rglob("*"))

    # A start killed before its first checkpoint leaves run.json and an empty log: still no run to protect.
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"run_id": "killed", "name": "r"}\n')
    (run_dir / "metrics.jsonl").write_text("")
    write_config(tmp_path, raw)
    rerun = palestra(["--config", "config.yaml"], tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert logged_steps(run_dir) == [0, 1, 2, 2]
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != "killed"


@pytest.mark.slow
def test_under_torchrun_rank_0_holds_the_lock(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    write_config(tmp_path, raw_config(steps=5000, save_every=5))  # outlives the refused resume below
    env = clean_env()
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "palestra", "train", "--config", "config.yaml"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "r"
    try:
        wait_for(job, run_dir / "checkpoints" / "latest")  # both ranks past start-up: neither locked out the other
        result = palestra(["--resume", "runs/r"], tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        holder = int(error_line(result).split("in use by process ")[1].split(" ")[0])
        environ = Path(f"/proc/{holder}/environ").read_bytes().split(b"\0")
        assert b"RANK=0" in environ and b"WORLD_SIZE=2" in environ  # a torchrun worker, rank 0
    finally:
        kill_tree(job.pid)
        job.communicate(timeout=60)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s children (torchrun's ranks run in sessions of their own), then ``pid``."""
    children = [
        int(child) for task in Path(f"/proc/{pid}/task").glob("*") for child in (task / "children").read_text().split()
    ]
    for child in children:
        os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


def test_a_folder_with_a_metrics_file_but_no_run_record_stays_protected(tmp_path: Path) -> None:
    # anyone's metrics.jsonl: only a run.json of palestra's, with no checkpoint, marks a run that saved nothing
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ckpt.RunDirError, match=r"already holds a run \(metrics\.jsonl\)"):
        ckpt.check_new_run_dir(tmp_path, overwrite=False)
    (tmp_path / "run.json").write_text('{"run_id": "a1", "name": "r"}\n')
    ckpt.check_new_run_dir(tmp_path, overwrite=False)  # palestra's run, no checkpoint: nothing to protect
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ckpt.RunDirError, match="already holds a run"):
        ckpt.check_new_run_dir(tmp_path, overwrite=False)
