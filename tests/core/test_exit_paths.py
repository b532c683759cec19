"""Every exit path saves and says one line (issue 23, items 12 and 13, and unwritable destinations).

Full disks and read-only destinations are real small tmpfs mounts (mounted here as root, or in a user namespace of
their own where mounting is not permitted), never a mocked ``OSError``: torch's zip writer and safetensors wrap the
``OSError`` of a full disk in their own errors, which only a real file system shows. The signal cases send real
signals to real ``python -m palestra train`` processes, at a point each process announces on its stdout or in its
run folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from train_processes import clean_env, error_line, write_config

from palestra.engine import checkpoint as ckpt
from palestra.engine.watchdog import Interrupted, StopSignals


# ---- real small file systems ----------------------------------------------------------------------------------
@dataclass
class Tmpfs:
    """A tmpfs mounted at ``path``. ``view`` is where this process reads and writes it: ``path`` itself, or, when the
    mount lives in a user namespace of its own, the same folder seen through the namespace's holder process
    (``/proc/PID/root/...``). :meth:`command` is an argv that runs where the mount is seen."""

    path: Path
    view: Path
    holder: subprocess.Popen[str] | None = None

    def command(self, argv: list[str], cwd: Path) -> list[str]:
        if self.holder is None:
            return argv
        # entering a mount namespace moves to its root: --wd keeps the working folder
        return ["nsenter", "--preserve-credentials", "-U", "-m", "-t", str(self.holder.pid), f"--wd={cwd}", *argv]

    def free(self) -> int:
        stat = os.statvfs(self.view)
        return stat.f_bavail * stat.f_frsize

    def listing(self) -> list[str]:
        return sorted(str(p.relative_to(self.view)) for p in self.view.rglob("*"))


def mount_tmpfs(path: Path, options: str) -> Tmpfs:
    path.mkdir(parents=True)
    direct = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True, check=False
    )
    if direct.returncode == 0:
        return Tmpfs(path, path)
    # Not permitted (no CAP_SYS_ADMIN): a user and mount namespace of its own, held open by a sleeping process.
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" && echo mounted && exec sleep 3600'
    try:
        holder = subprocess.Popen(
            ["unshare", "-Urm", "sh", "-c", script, "sh", options, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except OSError as e:
        pytest.skip(f"no tmpfs: mount said {direct.stderr.strip()!r}, and unshare cannot run ({e})")
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "mounted":
        holder.kill()
        _, err = holder.communicate()
        pytest.skip(f"no tmpfs: mount said {direct.stderr.strip()!r}, unshare -Urm said {err.strip()!r}")
    return Tmpfs(path, Path(f"/proc/{holder.pid}/root") / path.relative_to("/"), holder)


def unmount(disk: Tmpfs) -> None:
    if disk.holder is not None:
        disk.holder.kill()  # the namespace, and its mount, end with their last process
        disk.holder.communicate()
    else:
        subprocess.run(["umount", "-l", str(disk.path)], check=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Tmpfs]]:
    """``tmpfs(name, size="1m", read_only=False)``: a real tmpfs at ``tmp_path/name``, unmounted after the test."""
    mounted: list[Tmpfs] = []

    def mount(name: str, size: str = "1m", read_only: bool = False) -> Tmpfs:
        disk = mount_tmpfs(tmp_path / name, f"size={size}" + (",ro" if read_only else ""))
        mounted.append(disk)
        return disk

    yield mount
    for disk in reversed(mounted):
        unmount(disk)


# ---- real processes --------------------------------------------------------------------------------------------
def spawn(args: list[str], cwd: Path, disk: Tmpfs | None = None) -> subprocess.Popen[str]:
    """``python -m palestra ARGS`` with unbuffered output (a test reads its lines as they are printed)."""
    argv = [sys.executable, "-m", "palestra", *args]
    return subprocess.Popen(
        disk.command(argv, cwd) if disk is not None else argv,
        cwd=cwd,
        env={**clean_env(), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a background job's SIGINT is ignored, and Palestra leaves an ignored signal ignored: a live one
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def palestra(args: list[str], cwd: Path, disk: Tmpfs | None = None) -> subprocess.CompletedProcess[str]:
    proc = spawn(args, cwd, disk)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_until(proc: subprocess.Popen[str], prefix: str, seen: list[str]) -> None:
    """Read the process's stdout line by line (into ``seen``) until one starts with ``prefix``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"the process ended before printing {prefix!r}: {proc.wait()}; {''.join(seen)[-2000:]}")


def finish(proc: subprocess.Popen[str], seen: list[str]) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    return "".join(seen) + out, err


def config(raw_config: Callable[..., dict[str, Any]], output_dir: str | Path = "runs", **train: Any) -> dict[str, Any]:
    """The test run (conftest's raw_config) logged to metrics.jsonl, so that it ends with a dashboard."""
    raw = raw_config(output_dir, **train)
    raw["loggers"] = [{"name": "jsonl"}]
    return raw


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, raw_config: Callable[..., dict[str, Any]]) -> Path:
    """A finished 2-step run (``runs/r``, a step checkpoint kept) to export and plot; the folder holding it."""
    home = tmp_path_factory.mktemp("trained")
    write_config(home, config(raw_config, steps=2, save_every=1, keep_checkpoints=1))
    result = palestra(["train", "--config", "config.yaml"], home)
    assert result.returncode == 0, result.stderr[-3000:]
    return home


def step_checkpoint_bytes(home: Path) -> int:
    (_, path), *_ = ckpt.list_step_checkpoints(home / "runs" / "r")
    return path.stat().st_size


# ---- 12. a full disk while a checkpoint is written --------------------------------------------------------------
def test_a_checkpoint_that_fills_a_real_disk_raises_disk_full_and_keeps_the_previous_file(
    tmpfs: Callable[..., Tmpfs],
) -> None:
    # In this process, on a real tmpfs: torch's zip writer meets ENOSPC and reports "unexpected pos"; the writer
    # says what filled up instead, and leaves the previous checkpoint and no temporary file.
    disk = tmpfs("disk", "1m")
    good = ckpt.save_checkpoint({"step": 1, "w": torch.zeros(16)}, disk.view / "checkpoint.pt")
    before = good.read_bytes()
    with pytest.raises(ckpt.DiskFull) as info:
        ckpt.save_checkpoint({"step": 2, "w": torch.zeros(2 << 18)}, good)  # 2 MiB of weights on a 1 MiB disk
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert message.startswith(f"disk full: {good} needs at least 2.0 MiB (")
    assert message.endswith(
        f"free on {disk.view}); checkpoint.pt keeps its previous content; free some space and resume"
    )
    assert good.read_bytes() == before
    assert disk.listing() == ["checkpoint.pt"]


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes_once_space_is_freed(
    tmp_path: Path, tmpfs: Callable[..., Tmpfs], raw_config: Callable[..., dict[str, Any]], trained: Path
) -> None:
    # Room for one step checkpoint and a half: step 2 is written, step 4 fills the disk (the metrics log, a few
    # KiB, still fits once the partial file is gone).
    size = step_checkpoint_bytes(trained)
    disk = tmpfs("disk", "2m")
    filler = disk.view / "filler"
    filler.write_bytes(b"\0" * (disk.free() - size * 3 // 2))
    write_config(tmp_path, config(raw_config, disk.path, steps=8, save_every=2, keep_checkpoints=2))
    run_dir, shown = disk.view / "r", disk.path / "r" / "checkpoints"

    full = palestra(["train", "--config", "config.yaml"], tmp_path, disk)
    assert full.returncode == 2, full.stderr[-3000:]
    line = error_line(full)  # not torch's "RuntimeError: [enforce fail at inline_container.cc] unexpected pos"
    assert line.startswith(f"palestra train: error: disk full: {shown}/step-000004.pt needs at least ")
    assert line.endswith(f"free on {shown}); no step-000004.pt was written; free some space and resume")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-000002.pt"]
    assert ckpt.load_checkpoint(run_dir / "checkpoints" / "step-000002.pt")["step"] == 2  # intact

    filler.unlink()
    resumed = palestra(["train", "--resume", str(disk.path / "r")], tmp_path, disk)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from {shown}/step-000002.pt at step 2 of 8" in resumed.stdout
    assert ckpt.load_checkpoint(run_dir / ckpt.FINAL_NAME)["step"] == 8


# ---- a full disk, or a read-only one, under palestra export and palestra plot ---------------------------------
def test_a_full_disk_during_export_is_one_line_and_leaves_no_partial_export(
    tmpfs: Callable[..., Tmpfs], trained: Path
) -> None:
    disk = tmpfs("disk", "32k")  # the tiny model's weights alone are 45 KB
    out = disk.path / "export"
    result = palestra(["export", "runs/r", "--out", str(out)], trained, disk)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result).startswith(
        f"palestra export: error: disk full: writing the export {out} ran out of space ("
    )
    assert error_line(result).endswith(f" free on {disk.path}); nothing was written to {out}")
    assert disk.listing() == []  # no .export.export-PID.tmp folder, no half an export


@pytest.mark.slow
def test_a_full_disk_during_train_export_is_one_line_naming_the_command_that_exports_the_saved_run(
    tmp_path: Path, tmpfs: Callable[..., Tmpfs], raw_config: Callable[..., dict[str, Any]]
) -> None:
    disk = tmpfs("disk", "32k")
    out = disk.path / "export"
    write_config(tmp_path, config(raw_config, steps=2, save_every=0, export=True, export_dir=str(out)))
    result = palestra(["train", "--config", "config.yaml"], tmp_path, disk)
    assert result.returncode == 2, result.stderr[-3000:]
    line = error_line(result)
    assert line.startswith(f"palestra train: error: train.export: disk full: writing the export {out} ran out of ")
    assert line.endswith(
        f" free on {disk.path}); nothing was written to {out}; the trained run is saved in runs/r: "
        f"palestra export runs/r --out {out} writes it"
    )
    assert disk.listing() == []
    assert ckpt.load_checkpoint(tmp_path / "runs" / "r" / ckpt.FINAL_NAME)["step"] == 2


def test_export_and_plot_onto_a_read_only_mount_are_one_line_each(tmpfs: Callable[..., Tmpfs], trained: Path) -> None:
    disk = tmpfs("ro", read_only=True)
    export = palestra(["export", "runs/r", "--out", str(disk.path / "x")], trained, disk)
    assert export.returncode == 2, export.stderr[-3000:]
    assert error_line(export) == (
        f"palestra export: error: --out: '{disk.path / 'x'}' cannot be written: '{disk.path}' is on a read-only "
        "file system; name a folder on a writable one"
    )
    plot = palestra(["plot", "runs/r", "--out", str(disk.path / "d" / "dashboard.png")], trained, disk)
    assert plot.returncode == 2, plot.stderr[-3000:]
    assert error_line(plot) == (
        f"palestra plot: error: --out: '{disk.path / 'd' / 'dashboard.png'}' cannot be written: '{disk.path}' is "
        "on a read-only file system; name a file on a writable one"
    )
    assert disk.listing() == []


# ---- 13. a signal after the last step, during start-up; what a killed export leaves -----------------------------
@pytest.mark.slow
def test_a_signal_after_the_last_step_lets_the_dashboard_and_export_finish_then_exits_130(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, config(raw_config, steps=2, save_every=0, export=True))
    run_dir = tmp_path / "runs" / "r"
    proc, seen = spawn(["train", "--config", "config.yaml"], tmp_path), []
    read_until(proc, "trained 2 steps", seen)  # the last phase: the table, the dashboard, the export
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc, seen)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == [
        "palestra train: stopped by SIGINT after the last step, once everything was written: the run is complete "
        "and saved in runs/r"
    ]
    assert f"plot: {run_dir.relative_to(tmp_path) / 'dashboard.png'}" in out and (run_dir / "dashboard.png").is_file()
    assert (run_dir / "export" / "config.json").is_file()
    assert ckpt.load_checkpoint(run_dir / ckpt.FINAL_NAME)["step"] == 2


@pytest.mark.slow
def test_a_second_signal_after_the_last_step_stops_at_once_naming_what_is_missing(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, config(raw_config, steps=2, save_every=0, export=True))
    run_dir = tmp_path / "runs" / "r"
    proc, seen = spawn(["train", "--config", "config.yaml"], tmp_path), []
    read_until(proc, "trained 2 steps", seen)
    proc.send_signal(signal.SIGTERM)  # the first: everything is to be written
    read_until(proc, "plot: ", seen)  # the dashboard is written; the export starts (importing transformers)
    proc.send_signal(signal.SIGTERM)  # the second: at once
    _, err = finish(proc, seen)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines() == [
        "palestra train: stopped at once by a second SIGTERM after the last step: the run is complete and saved in "
        "runs/r (checkpoint.pt, step 2); not written: the export runs/r/export "
        "(palestra export runs/r --out runs/r/export)"
    ]
    assert sorted(p.name for p in run_dir.iterdir() if "export" in p.name) == []  # no .export.export-PID.tmp
    again = palestra(["export", "runs/r", "--out", "runs/r/export"], tmp_path)  # the command the line names
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run_dir / "export" / "config.json").is_file()


@pytest.mark.slow
def test_sigterm_while_the_run_starts_is_one_line_and_exits_143(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, config(raw_config, steps=2))
    run_dir = tmp_path / "runs" / "r"
    proc = spawn(["train", "--config", "config.yaml"], tmp_path)
    deadline = time.monotonic() + 120
    # the run folder is locked just before the models are built: the signal comes while they are
    while not (run_dir / ".lock").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines() == ["palestra train: stopped by SIGTERM before training started; nothing was saved"]
    assert "trained" not in out
    assert not (run_dir / ckpt.FINAL_NAME).exists() and not (run_dir / ckpt.CHECKPOINT_DIR).exists()


def test_a_killed_exports_folder_is_swept_by_the_next_export_and_a_live_ones_is_not(trained: Path) -> None:
    out = trained / "swept"
    killed = spawn(["export", "runs/r", "--out", str(out)], trained)
    deadline = time.monotonic() + 120
    while not (left := list(trained.glob(".swept.export-*.tmp"))) and time.monotonic() < deadline:
        assert killed.poll() is None, killed.communicate()
        time.sleep(0.002)
    killed.kill()  # SIGKILL mid-export: nothing runs to clean up
    killed.communicate(timeout=60)
    assert [p.name for p in left] == [f".swept.export-{killed.pid}.tmp"] and left[0].is_dir()
    with live_process() as pid:  # a folder of an export that is still writing
        live = trained / f".swept.export-{pid}.tmp"
        live.mkdir()
        result = palestra(["export", "runs/r", "--out", str(out)], trained)
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(p.name for p in trained.glob(".swept.*")) == [live.name]
    assert (out / "config.json").is_file()


@contextlib.contextmanager
def live_process() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_stop_signals_nest_and_keep_a_signal_for_the_outer_block() -> None:
    # palestra train holds the handlers for the whole command; the trainer's own block inside changes nothing, and
    # a signal that came inside it is still there after it (the command ends with that signal's status).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job inherits SIG_IGN
    try:
        with StopSignals() as outer:
            with outer:
                os.kill(os.getpid(), signal.SIGINT)
                deadline = time.monotonic() + 5
                while outer.received is None and time.monotonic() < deadline:
                    time.sleep(0.001)
            assert outer.received == signal.SIGINT
            assert signal.getsignal(signal.SIGINT) == outer._handle  # still installed
            outer.received, outer.immediate = None, True  # starting up: the first signal stops at once
            with pytest.raises(Interrupted) as info:  # noqa: PT012 - the kill and the wait are one act
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            assert info.value.at_once and info.value.exit_code == 143
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_killed_drawings_temporary_file_is_swept_by_the_next_plot_and_a_live_ones_is_not(tmp_path: Path) -> None:
    from palestra.cli.dashboard import plot_dashboard

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.1}\n{"step": 1, "reward/mean": 0.2}\n')
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".dashboard.png.{dead.pid}.tmp"
    left.write_bytes(b"\x89PNG half")
    with live_process() as pid:
        live = tmp_path / f".dashboard.png.{pid}.tmp"
        live.write_bytes(b"\x89PNG being written")
        assert plot_dashboard(tmp_path) == tmp_path / "dashboard.png"
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["metrics.jsonl", "dashboard.png", live.name])
