"""Bad input to a run, and runs that end badly: each case gets one line naming the culprit, and a run that is
stopped, crashes or fills the disk stays resumable.

Unsafe checkpoints (pickled code) are refused without running anything; a second run into a run directory is
refused with the ways out; resume never takes another run's checkpoint or follows a pointer out of the run; corrupt
checkpoints are named and skipped; weights that do not fit their config name the parameter; SIGINT/SIGTERM save at a
step boundary (bitwise resumable, on every rank under torchrun); a full disk keeps the previous checkpoint; rewards
near float32's limit never produce NaN; a broken environment is named by its registered name and the rule it broke.

The command-line cases run the real ``python -m palestra train`` in a subprocess (the full-disk case runs the same
entry point in-process, so that the write can be made to fail); the test components come from a small plugin
installed into a temporary folder (a module and its dist-info, on PYTHONPATH), as any user plugin would be.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from train_processes import clean_env, error_line, install_plugin, palestra, start, write_config

from palestra.engine import checkpoint as ckpt
from palestra.engine.checked_environment import check_reset, check_step
from palestra.engine.watchdog import Interrupted, StopSignals
from palestra.types import Observation, StepResult

MARKER = "code-ran"  # the file a malicious checkpoint tries to create


def metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith("perf/")} for m in lines]


def assert_same_final_state(a_dir: Path, b_dir: Path, steps: int) -> None:
    a = ckpt.load_checkpoint(a_dir / ckpt.FINAL_NAME)
    b = ckpt.load_checkpoint(b_dir / ckpt.FINAL_NAME)
    assert a["step"] == b["step"] == steps
    assert a["policy"].keys() == b["policy"].keys()
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    opt_a, opt_b = a["optimizer"]["optimizer"]["state"], b["optimizer"]["optimizer"]["state"]
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    assert a["reward"] == b["reward"] and a["reward_ema"] == b["reward_ema"]
    assert metric_lines(a_dir) == metric_lines(b_dir)


# ---- a test plugin: a rule-breaking environment and a reward near float32's limit -----------------------------
PLUGIN = "palestra_bad_input_plugin"
PLUGIN_SOURCE = textwrap.dedent(
    '''
    """Installed by test_bad_input_runs.py: an environment that breaks one protocol rule, a reward of +-value."""
    from dataclasses import dataclass

    from palestra import hookimpl
    from palestra.plugins.envs.arithmetic import ArithmeticEnv, ArithmeticOptions
    from palestra.types import StepResult


    @dataclass
    class RuleBreakerOptions(ArithmeticOptions):
        breaks: str = "nothing"


    class RuleBreaker(ArithmeticEnv):
        def __init__(self, breaks="nothing", **options):
            super().__init__(**options)
            self.breaks = breaks

        def reset(self, batch_size, *, seed=None, group_size=1):
            observations = super().reset(batch_size, seed=seed, group_size=group_size)
            return {
                "reset_none": None,
                "reset_strings": [o.prompt for o in observations],
                "reset_count": observations[:-1],
            }.get(self.breaks, observations)

        def step(self, actions):
            out = super().step(actions)
            if self.breaks == "step_tuple":
                return out.observations, out.done, out.info
            if self.breaks == "step_rows":
                return StepResult(out.observations[:-1], out.done[:-1], out.info[:-1])
            return out


    @dataclass
    class HugeOptions:
        value: float = 3e38
        alternate: bool = True


    class Huge:
        def __init__(self, value=3e38, alternate=True):
            self.value, self.alternate = value, alternate

        def __call__(self, prompts, completions, metadata):
            return [-self.value if self.alternate and i % 2 else self.value for i in range(len(completions))]


    @hookimpl
    def register_environments(register):
        register("rule_breaker", RuleBreaker, options=RuleBreakerOptions, description="arithmetic that breaks one rule")


    @hookimpl
    def register_rewards(register):
        register("huge", Huge, options=HugeOptions, description="+-value per row (value near float32's limit)")
    '''
)


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin above as an installed distribution: the module and a dist-info with its entry point."""
    return install_plugin(tmp_path_factory.mktemp("bad-input-plugin"), PLUGIN, PLUGIN_SOURCE, "bad_input")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory, raw_config: Callable[..., dict[str, Any]]) -> Path:
    """A finished 4-step run (checkpoints/step-000002.pt and checkpoint.pt at step 4); tests work on copies."""
    folder = tmp_path_factory.mktemp("base")
    result = palestra(["--config", str(write_config(folder, raw_config()))], folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "runs" / "r"


def copy_run(base: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "r"
    shutil.copytree(base, run_dir)
    return run_dir


# ---- 1. a checkpoint cannot run code -----------------------------------------------------------------------
class RunsCode:
    """Unpickled with weights_only=False, this would run ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_checkpoint_that_pickles_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    marker = tmp_path / MARKER
    torch.save({"format": ckpt.FORMAT, "step": 3, "config": RunsCode(marker)}, run_dir / ckpt.FINAL_NAME)
    result = palestra(["--resume", str(run_dir)], tmp_path)
    assert result.returncode == 2
    assert error_line(result) == (
        f"palestra train: error: --resume: {run_dir} holds no intact checkpoint: checkpoint {run_dir}/checkpoint.pt is "
        "refused: it holds a pickled reference to posix.system, which is code, not data; palestra loads checkpoints "
        "with torch.load(weights_only=True) and ran nothing"
    )
    assert not marker.exists(), "loading the checkpoint ran its code"


def test_load_checkpoint_refuses_pickled_code_however_it_is_wrapped(tmp_path: Path) -> None:
    marker = tmp_path / MARKER
    zipped, plain, nested = tmp_path / "zipped.pt", tmp_path / "plain.pkl", tmp_path / "nested.pt"
    torch.save({"step": 1, "format": ckpt.FORMAT, "config": RunsCode(marker)}, zipped)
    plain.write_bytes(pickle.dumps({"step": 1, "config": RunsCode(marker)}))
    torch.save(
        {"step": 1, "format": ckpt.FORMAT, "policy": {"w": torch.ones(2)}, "rng": [{"x": RunsCode(marker)}]}, nested
    )
    for path in (zipped, nested):
        with pytest.raises(
            ckpt.CheckpointError, match=r"holds a pickled reference to posix\.system, which is code"
        ) as info:
            ckpt.load_checkpoint(path)
        assert "\n" not in str(info.value)
    with pytest.raises(ckpt.CheckpointError, match=r"plain\.pkl is corrupt: truncated or not a torch\.save archive"):
        ckpt.load_checkpoint(plain)  # never handed to an unpickler at all
    assert not marker.exists()
    # and a checkpoint cannot be written with an object in it: refused before a byte hits the disk
    with pytest.raises(ckpt.CheckpointError, match=r"state\['config'\] is .*RunsCode .* which cannot be saved"):
        ckpt.save_checkpoint({"step": 1, "config": RunsCode(marker)}, tmp_path / "never.pt")
    assert not (tmp_path / "never.pt").exists()


# ---- 2. runs do not clobber each other, and resume takes only its own run's checkpoints ---------------------
@pytest.mark.slow
def test_a_second_run_into_a_run_directory_is_refused_with_the_ways_out(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    config = write_config(tmp_path, raw_config(name="base", steps=2, save_every=0))
    first = palestra(["--config", str(config)], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "base"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    second = palestra(["--config", str(config), "run.seed=1"], tmp_path)
    assert second.returncode == 2
    assert error_line(second) == (
        "palestra train: error: runs/base already holds a run (run.json, checkpoint.pt); continue it with "
        "--resume runs/base, start another with a new run.name=..., or replace it with --overwrite"
    )
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing touched
    # --overwrite deletes the old run first: one run's lines in the log, a new run id
    third = palestra(["--config", str(config), "run.seed=1", "--overwrite"], tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    steps = [m["step"] for m in metric_lines(run_dir)]
    assert steps == [0, 1, 2, 2]  # before, two steps, after: once
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != json.loads(before["run.json"])["run_id"]
    assert ckpt.load_checkpoint(run_dir / ckpt.FINAL_NAME)["config"]["run"]["seed"] == 1


def fake_state(run_id: str, step: int) -> dict[str, Any]:
    return {"run_id": run_id, "step": step, "policy": {"w": torch.full((3,), float(step))}}


def test_resume_takes_only_the_owning_runs_checkpoints(tmp_path: Path) -> None:
    # run A left a step-40 file; run B then used the directory and finished at step 20 (written later)
    ckpt.save_step_checkpoint(tmp_path, fake_state("A", 40), 40, keep=3)
    ckpt.save_checkpoint(fake_state("B", 20), tmp_path / ckpt.FINAL_NAME)
    with pytest.warns(
        ckpt.CheckpointWarning, match=r"ignoring 1 checkpoint\(s\) of another run \(checkpoints/step-000040\.pt\)"
    ):
        assert ckpt.find_resume_checkpoint(tmp_path).name == ckpt.FINAL_NAME  # B saved last: B owns it
    ckpt.write_run_file(tmp_path, "B", "r")
    with pytest.warns(ckpt.CheckpointWarning):
        point = ckpt.resume_point(tmp_path)
    assert (point.path.name, point.step, point.state["run_id"]) == (ckpt.FINAL_NAME, 20, "B")
    # B's only checkpoint broken: an error naming it, never A's checkpoint
    (tmp_path / ckpt.FINAL_NAME).write_bytes(b"")
    with pytest.warns(ckpt.CheckpointWarning), pytest.raises(ckpt.CheckpointError) as info:
        ckpt.resume_point(tmp_path)
    assert str(info.value) == (
        f"--resume: {tmp_path} holds no intact checkpoint of run B: checkpoint "
        f"{tmp_path}/checkpoint.pt is corrupt: it is empty (0 bytes)"
    )


def test_a_pointer_or_link_out_of_the_run_is_not_followed(tmp_path: Path) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ckpt.save_step_checkpoint(run_dir, fake_state("A", 2), 2, keep=3)
    ckpt.save_checkpoint(fake_state("A", 90), elsewhere / ckpt.FINAL_NAME)
    (run_dir / "checkpoints" / "latest").write_text("../../elsewhere/checkpoint.pt\n")
    (run_dir / "checkpoints" / "step-000099.pt").symlink_to(elsewhere / ckpt.FINAL_NAME)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = ckpt.resume_point(run_dir)
    assert (point.path.name, point.step) == ("step-000002.pt", 2)
    messages = [str(w.message) for w in caught]
    assert any("latest names '../../elsewhere/checkpoint.pt', not a step file" in m for m in messages), messages
    assert any("step-000099.pt links to" in m and "outside the run directory; ignored" in m for m in messages), messages


# ---- 3. corrupt checkpoints --------------------------------------------------------------------------------
CORRUPTIONS = {
    "truncated": lambda data: data[: len(data) // 2],
    "random": lambda data: os.urandom(len(data)),
    "empty": lambda data: b"",
}
CORRUPT_REASON = {
    "truncated": "is corrupt: truncated or not a torch.save archive",
    "random": "is corrupt: truncated or not a torch.save archive",
    "empty": "is corrupt: it is empty (0 bytes)",
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_named_and_resume_falls_back_to_the_newest_intact_one(
    damage: str, base_run: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(base_run, tmp_path)
    final = run_dir / ckpt.FINAL_NAME
    final.write_bytes(CORRUPTIONS[damage](final.read_bytes()))
    result = palestra(["--resume", str(run_dir)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    warning = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warning) == 1 and warning[0].startswith(
        f"palestra: warning: checkpoint {final} {CORRUPT_REASON[damage]}"
    )
    assert warning[0].endswith(f"; resuming from {run_dir}/checkpoints/step-000002.pt (step 2)")
    assert f"resuming {run_dir} from {run_dir}/checkpoints/step-000002.pt at step 2 of 4" in result.stdout
    assert ckpt.load_checkpoint(final)["step"] == 4  # rewritten whole
    # nothing intact at all: one line naming every corrupt file
    for path in (final, run_dir / "checkpoints" / "step-000002.pt"):
        path.write_bytes(CORRUPTIONS[damage](path.read_bytes()))
    failed = palestra(["--resume", str(run_dir)], tmp_path)
    assert failed.returncode == 2
    line = error_line(failed)
    assert line.startswith(f"palestra train: error: --resume: {run_dir} holds no intact checkpoint: checkpoint ")
    assert "step-000002.pt" in line and "checkpoint.pt" in line


def test_a_truncated_or_damaged_newest_step_file_falls_back_to_the_one_before(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ckpt.save_step_checkpoint(tmp_path, fake_state("A", step), step, keep=3)
    newest = tmp_path / "checkpoints" / "step-000003.pt"
    intact = newest.read_bytes()
    newest.write_bytes(intact[:-100])
    with pytest.warns(
        ckpt.CheckpointWarning,
        match=r"step-000003\.pt is corrupt: truncated .*; resuming from .*step-000002\.pt \(step 2\)",
    ):
        assert ckpt.resume_point(tmp_path).step == 2
    # a flipped byte inside a tensor: the archive opens, the checksum does not match
    data = bytearray(intact)
    at = data.find(torch.full((3,), 3.0).numpy().tobytes())
    assert at > 0
    data[at] ^= 0x01
    newest.write_bytes(bytes(data))
    with pytest.warns(
        ckpt.CheckpointWarning, match=r"step-000003\.pt is corrupt: its content does not match the sha256"
    ):
        assert ckpt.resume_point(tmp_path).step == 2


@pytest.mark.slow
def test_weights_that_do_not_fit_their_config_name_the_parameter_and_the_config_key(
    base_run: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(base_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    state = ckpt.load_checkpoint(run_dir / ckpt.FINAL_NAME)
    state["config"]["policy"]["options"]["d_model"] = 64  # the weights are d_model 32
    vocab = state["policy"]["embed.weight"].shape[0]
    ckpt.save_checkpoint(state, run_dir / ckpt.FINAL_NAME)  # a valid checksum: only the shapes disagree
    result = palestra(["--resume", str(run_dir)], tmp_path)
    assert result.returncode == 2
    assert error_line(result) == (
        f"palestra train: error: checkpoint {run_dir}/checkpoint.pt does not fit the policy built from its config "
        "(policy 'tiny', policy.options): parameter 'embed.weight' is "
        f"[{vocab}, 32] in the checkpoint and [{vocab}, 64] in the policy"
    )


# ---- 4. signals and full disks -------------------------------------------------------------------------------
def wait_for_lines(proc: subprocess.Popen[str], log: Path, lines: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and log.read_text().count("\n") >= lines:
            return
        time.sleep(0.002)
    raise AssertionError(f"the run ended (or stalled) before it could be signalled: {proc.poll()}")


SIGNAL_STEPS = 40


@pytest.mark.slow
def test_sigterm_saves_at_a_step_boundary_and_the_resumed_run_is_bitwise_the_same(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(steps=SIGNAL_STEPS, save_every=0, eval_every=10)  # no periodic checkpoints: the signal's alone
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_config(tmp_path / name, raw)
    whole = start(["--config", "config.yaml"], tmp_path / "a")
    stopped = start(["--config", "config.yaml"], tmp_path / "b")
    run_a, run_b = tmp_path / "a" / "runs" / "r", tmp_path / "b" / "runs" / "r"
    wait_for_lines(stopped, run_b / "log.jsonl", 3)  # training (the handlers are in place), a step or two in
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=120)
    assert stopped.returncode == 143, err[-3000:]
    line = err.strip().splitlines()[-1]
    saved = int(line.split("saved step ")[1].split(";")[0])
    assert line == f"palestra train: stopped by SIGTERM: saved step {saved}; resume with palestra train --resume runs/r"
    assert len(err.strip().splitlines()) == 1 and 0 < saved < SIGNAL_STEPS
    assert [p.name for _, p in ckpt.list_step_checkpoints(run_b)] == [ckpt.step_name(saved)]
    _, err_a = whole.communicate(timeout=180)
    assert whole.returncode == 0, err_a[-3000:]

    resumed = palestra(["--resume", "runs/r"], tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from runs/r/checkpoints/{ckpt.step_name(saved)} at step {saved} of {SIGNAL_STEPS}" in resumed.stdout
    assert_same_final_state(run_a, run_b, SIGNAL_STEPS)


@pytest.mark.slow
def test_sigint_saves_and_exits_130_with_error_line(tmp_path: Path, raw_config: Callable[..., dict[str, Any]]) -> None:
    write_config(tmp_path, raw_config(steps=SIGNAL_STEPS, save_every=0))
    proc = start(["--config", "config.yaml"], tmp_path)
    run_dir = tmp_path / "runs" / "r"
    wait_for_lines(proc, run_dir / "log.jsonl", 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    saved = int(lines[0].split("saved step ")[1].split(";")[0])
    assert (
        lines[0] == f"palestra train: stopped by SIGINT: saved step {saved}; resume with palestra train --resume runs/r"
    )
    assert ckpt.load_checkpoint(run_dir / "checkpoints" / ckpt.step_name(saved))["step"] == saved


def test_a_second_signal_stops_at_once() -> None:
    # A process started in the background by a non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and
    # StopSignals rightly leaves an ignored signal ignored: give this test the foreground's default handler.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        second_signal_stops_at_once()
    finally:
        signal.signal(signal.SIGINT, inherited)


def second_signal_stops_at_once() -> None:
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.001)  # the handler runs between bytecodes of the main thread
        assert stop.received == signal.SIGINT
        # the second SIGINT's handler raises during the sleep that follows the kill
        with pytest.raises(Interrupted) as info:  # noqa: PT012 - the kill and the wait are one act
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert info.value.at_once and info.value.exit_code == 130
    info.value.saved_step, info.value.run_dir = 6, "runs/r"
    assert (
        info.value.line()
        == "stopped at once by a second SIGINT: nothing saved after step 6; resume with palestra train --resume runs/r"
    )
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


@pytest.mark.slow
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_how_much_was_needed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raw_config: Callable[..., dict[str, Any]],
) -> None:
    from palestra import cli

    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, raw_config(steps=6, save_every=2))
    real_write, calls = ckpt._write_state, []

    def fills_the_disk(state: Any, tmp: Path) -> None:
        calls.append(tmp)
        if len(calls) == 1:
            return real_write(state, tmp)
        tmp.write_bytes(b"\0" * 1000)  # a partial file, as a real ENOSPC leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_state", fills_the_disk)
    code = cli.main(["train", "--config", "config.yaml"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    folder = Path("runs/r/checkpoints")
    assert lines[0].startswith(f"palestra train: error: disk full: {folder}/step-000004.pt needs at least ")
    assert lines[0].endswith(f"free on {folder}); no step-000004.pt was written; free some space and resume")
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-000002.pt"]  # no temporary file left
    assert (folder / "latest").read_text().strip() == "step-000002.pt"
    assert ckpt.load_checkpoint(folder / "step-000002.pt")["step"] == 2  # intact, and resumable
    assert ckpt.resume_point("runs/r").step == 2


def _workers(parent: int) -> dict[int, int]:
    """rank -> pid of the processes below ``parent`` that torchrun started (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    ranks, todo = {}, list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env = dict(
                v.split("=", 1)
                for v in (Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"))
                if "=" in v
            )
        except OSError:
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_at_the_same_step(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(steps=SIGNAL_STEPS, save_every=0, batch_size=8)
    raw["distributed"] = {"strategy": "ddp", "backend": "gloo", "timeout_s": 60}
    write_config(tmp_path, raw)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "palestra",
        "train",
    ]
    proc = subprocess.Popen(
        [*cmd, "--config", "config.yaml"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "runs" / "r"
    wait_for_lines(proc, run_dir / "log.jsonl", 3, timeout=180)
    ranks = _workers(proc.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGTERM)  # rank 1 alone: rank 0 must stop at the same step boundary and save
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("palestra train: stopped by SIGTERM: saved step ")]
    assert len(said) == 1, err[-3000:]  # rank 0 alone reports
    saved = int(said[0].split("saved step ")[1].split(";")[0])
    assert said[0].endswith("; resume with palestra train --resume runs/r")
    assert [p.name for _, p in ckpt.list_step_checkpoints(run_dir)] == [ckpt.step_name(saved)]
    state = ckpt.load_checkpoint(run_dir / "checkpoints" / ckpt.step_name(saved))
    assert state["step"] == saved and len(state["rng"]) == 2  # both ranks' states, gathered at that step
    resumed = subprocess.run(
        [*cmd, "--resume", "runs/r"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ckpt.load_checkpoint(run_dir / ckpt.FINAL_NAME)["step"] == SIGNAL_STEPS


# ---- 5. rewards near float32's limit, and environments that break the protocol ------------------------------------
@pytest.mark.slow
def test_rewards_near_the_float32_limit_never_log_or_print_nan(
    plugin_site: Path, tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(steps=3, save_every=0)
    raw["reward"] = {"name": "huge", "options": {"value": 3e38, "alternate": True}}
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, plugin_site)
    assert result.returncode == 0, result.stderr[-3000:]
    means = [m["reward/mean"] for m in metric_lines(tmp_path / "runs" / "r") if "reward/mean" in m]
    assert len(means) == 3 and all(m is not None for m in means), means  # jsonl writes NaN as null
    assert "nan" not in result.stdout.lower()
    # the same rows with an update that overflows: the steps are skipped, and max_bad_steps end the run in one line
    raw["optimizer"] = {"name": "reinforce", "options": {"normalize": False}}
    raw["train"]["max_bad_steps"] = 2
    aborted = palestra(["--config", str(write_config(tmp_path, raw)), "run.name=skipped"], tmp_path, plugin_site)
    assert aborted.returncode == 2
    assert "Traceback" not in aborted.stderr  # before it: each skipped step's warning (and the learner's log line)
    assert aborted.stderr.strip().splitlines()[-1] == (
        "palestra train: error: train.max_bad_steps: 2 steps in a row were skipped (non-finite reward, loss or "
        "gradient); the last, step 2: the loss or the gradient norm is not finite"
    )


def test_the_held_out_table_never_prints_a_bare_nan() -> None:
    from palestra.cli.train import format_before_after
    from palestra.engine.trainer import EvalResult

    before = EvalResult(0.5, {}, 4, None)
    after = EvalResult(float("inf"), {"format": 1.0}, 4, None)
    lines = format_before_after(before, after)
    assert lines[3] == f"  {'format':<14}  {'-':>8}  {1.0:>8.3f}"  # not reported before training: a dash, not nan
    assert lines[-1] == "  (a value above is not finite: the reward's held-out scores could not be averaged)"
    assert all("nan" not in line for line in lines)


BREAKS = {
    "reset_none": "reset returned None; it must return a list of batch_size*group_size = 4 Observation (4 tasks x 1)",
    "reset_strings": (
        "reset returned str '4 + 3 =' at row 0; every row must be a palestra.types.Observation (none is finished yet)"
    ),
    "reset_count": (
        "reset returned 3 observations; it must return a list of batch_size*group_size = 4 Observation (4 tasks x 1)"
    ),
    "step_tuple": "step returned tuple; it must return a StepResult(observations, done, info) with one entry per row",
    "step_rows": "step returned 3 rows for a batch of 4; it must return one entry per row (None for a finished row)",
}


@pytest.mark.slow
@pytest.mark.parametrize("breaks", list(BREAKS))
def test_an_environment_that_breaks_the_protocol_is_named_with_the_rule(
    breaks: str, plugin_site: Path, tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(steps=1, save_every=0)
    raw["environment"] = {"name": "rule_breaker", "options": {**raw["environment"]["options"], "breaks": breaks}}
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, plugin_site)
    assert result.returncode == 2
    line = error_line(result)
    assert line.startswith("palestra train: error: environment 'rule_breaker': "), line  # the registered name
    expected = BREAKS[breaks]
    if breaks == "reset_strings":  # the first held-out question depends on the seed: check the rule, not the sum
        assert line.endswith("at row 0; every row must be a palestra.types.Observation (none is finished yet)"), line
        assert "reset returned str '" in line
    else:
        assert line == f"palestra train: error: environment 'rule_breaker': {expected}"


def test_the_protocol_rules_as_plain_functions() -> None:
    obs = [Observation(prompt="1 + 1 =") for _ in range(4)]
    assert check_reset(obs, 2, 2) is None
    assert (
        check_reset(obs[:3], 2, 2)
        == "reset returned 3 observations; it must return a list of batch_size*group_size = 4 Observation (2 tasks x 2)"
    )
    assert check_reset([*obs[:3], None], 2, 2).startswith("reset returned None at row 3; every row must be")
    assert check_reset(obs, 4, 1, agents=("critic",)).startswith(
        "reset returned an Observation for agent 'assistant', not one of agent_ids ('critic',), at row 0"
    )
    done = StepResult([None] * 4, [True] * 4, [{}] * 4)
    assert check_step(done, ["a"] * 4, [True] * 4) is None
    again = StepResult([obs[0], None, None, None], [False, True, True, True], [{}] * 4)
    assert check_step(again, [None, "a", "a", "a"], [False, True, True, True]) == (
        "step returned an observation for row 0, which had already finished; a finished row stays None"
    )
    assert check_step(StepResult([None] * 4, [True] * 4, [None] * 4), ["a"] * 4, [True] * 4) == (
        "step returned info NoneType at row 0; info[i] must be a dict (agent id -> dict)"
    )


# ---- 6. --resume given a file, a shorter run, a damaged log ----------------------------------------------------
@pytest.mark.slow
def test_resume_given_a_checkpoint_file_or_fewer_steps_is_error_line(base_run: Path, tmp_path: Path) -> None:
    run_dir = copy_run(base_run, tmp_path)
    given_file = palestra(["--resume", str(run_dir / "checkpoints" / "step-000002.pt")], tmp_path)
    assert given_file.returncode == 2
    assert error_line(given_file) == (
        f"palestra train: error: --resume takes the run directory, not a file: '{run_dir}/checkpoints/step-000002.pt' "
        f"is a file; use --resume {run_dir} (it picks the newest intact checkpoint)"
    )
    shorter = palestra(["--resume", str(run_dir), "train.steps=3"], tmp_path)
    assert shorter.returncode == 2
    assert error_line(shorter) == (
        f"palestra train: error: train.steps: 3 is below step 4 of {run_dir}/checkpoint.pt; a resumed run cannot be "
        "shortened (pass train.steps=4 or more)"
    )


@pytest.mark.slow
def test_a_metrics_file_shorter_than_the_checkpoint_recorded_is_cut_to_a_complete_line(
    base_run: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(base_run, tmp_path)
    (run_dir / ckpt.FINAL_NAME).unlink()  # resume from step 2, whose log size is the first 3 lines
    log = run_dir / "log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    recorded = ckpt.load_checkpoint(run_dir / "checkpoints" / "step-000002.pt")["logs"]["log.jsonl"]
    assert recorded == len("".join(lines[:3]).encode())
    log.write_text("".join(lines[:2]) + lines[2][:10])  # lost the end: the third line is a fragment
    result = palestra(["--resume", str(run_dir)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    cut = len("".join(lines[:2]).encode())
    assert result.stderr.strip().splitlines() == [
        f"palestra: warning: {log} is {cut + 10} bytes, shorter "
        f"than the {recorded} recorded at step 2: lines were lost; "
        f"cut to its last complete line ({cut} bytes) before resuming"
    ]
    steps = [m["step"] for m in metric_lines(run_dir)]  # every line parses: nothing was appended after a fragment
    assert steps == [0, 1, 3, 4, 4]  # step 2's line was lost with the damage; the resumed run logs 3, 4 and the end


def test_restore_logs_cuts_what_followed_the_checkpoint_at_a_line_boundary(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ordinary case (a killed run wrote past its checkpoint) is silent
        ckpt.restore_logs(tmp_path, {"m.jsonl": 24}, 2)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    with pytest.warns(
        ckpt.CheckpointWarning,
        match=r"ends mid-line at the 18 bytes recorded at step 2; cut to its last complete line \(12 bytes\)",
    ):
        ckpt.restore_logs(tmp_path, {"m.jsonl": 18}, 2)
    assert log.read_text() == '{"step": 1}\n'
    with pytest.warns(ckpt.CheckpointWarning, match=r"gone\.jsonl is missing"):
        ckpt.restore_logs(tmp_path, {"gone.jsonl": 10}, 2)
