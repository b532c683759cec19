"""Nothing is followed out of a run folder (docs/reliability.md, "Run folder rules and answers", issue 23 items 2,
3, 4 and 6): a forged checkpoint's log names, a link planted as any file or folder Palestra writes, an
``--overwrite`` of a folder holding someone else's files, and a full disk under the metrics log.

The cases run real ``python -m palestra train`` processes on copies of one real trained run, plant real links, and
check the bytes of every file outside the folder afterwards; the full disk is a real 3 MiB tmpfs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_processes import error_line, palestra, start, write_config

from palestra.engine import checkpoint as ckpt
from palestra.engine.run_folder import RunFolderLink
from palestra.plugins.loggers.jsonl import JsonlLogger

ERROR = "palestra train: error: "
NEVER = "Palestra never follows a link in a run folder: remove it and run again"
VICTIM = b"the victim's own bytes, which no run may cut or extend\n" * 3


def sl_config(raw_config: Callable[..., dict[str, Any]], **train: Any) -> dict[str, Any]:
    """The run the issue calls sl, with two logs."""
    return two_logs(raw_config(name="sl", **train))


def two_logs(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` logging to metrics.jsonl (the default name) and to log.jsonl (a jsonl logger of another name)."""
    raw["loggers"] = [{"name": "jsonl"}, {"name": "jsonl", "options": {"filename": "log.jsonl"}}]
    return raw


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory, raw_config: Callable[..., dict[str, Any]]) -> Path:
    """A finished 4-step run (checkpoints/step-000002.pt, checkpoint.pt, metrics.jsonl, log.jsonl, dashboard.png)."""
    folder = tmp_path_factory.mktemp("base")
    result = palestra(["--config", str(write_config(folder, sl_config(raw_config)))], folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "runs" / "sl"


@pytest.fixture
def run_copy(base_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "sl"
    shutil.copytree(base_run, run_dir, symlinks=True)
    return run_dir


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return path


def digest_tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and the sha256 of its bytes (links listed by where they lead); not ``.lock``,
    which holds the PID of the last process that locked the folder, a refused one included."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if rel == ".lock":
            continue
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def forge_logs(run_dir: Path, logs: dict[str, int]) -> None:
    """Forge: load the final checkpoint, add ``logs`` entries, save it again (its sha256 is a digest, not a
    signature, so the forged file passes)."""
    state = ckpt.load_checkpoint(run_dir / ckpt.FINAL_NAME)
    state["logs"] = {**state["logs"], **logs}
    ckpt.save_checkpoint(state, run_dir / ckpt.FINAL_NAME)


# ---- 2. a forged checkpoint's log names --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("key", ["ABSOLUTE", "../victim.txt", "../../../victim.txt", "checkpoint.pt", "a\0b"])
def test_a_forged_logs_key_that_is_not_a_log_in_the_folder_is_refused_naming_checkpoint_and_key(
    key: str, run_copy: Path, victim: Path, tmp_path: Path
) -> None:
    key = str(victim) if key == "ABSOLUTE" else key  # /tmp/.../victim.txt: the issue's /tmp/victim.txt
    forge_logs(run_copy, {key: 15})
    before = digest_tree(run_copy)
    result = palestra(["--resume", "runs/sl"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == (
        f"{ERROR}checkpoint runs/sl/checkpoint.pt: logs key {key!r} is not the name of a log file inside the run "
        "folder; refused, nothing was cut (a checkpoint names only its run's own log files)"
    )
    assert victim.read_bytes() == VICTIM
    assert digest_tree(run_copy) == before  # nothing in the run cut either (checkpoint.pt was a key)


@pytest.mark.slow
def test_a_forged_logs_key_naming_a_link_is_refused_naming_checkpoint_and_key(
    run_copy: Path, victim: Path, tmp_path: Path
) -> None:
    (run_copy / "sub").mkdir()
    (run_copy / "sub" / "m.jsonl").symlink_to(victim)  # below the top level, where only the key leads
    forge_logs(run_copy, {"sub/m.jsonl": 15})
    result = palestra(["--resume", "runs/sl"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == (
        f"{ERROR}checkpoint runs/sl/checkpoint.pt: logs key 'sub/m.jsonl': runs/sl/sub/m.jsonl is a link "
        f"(to {victim}); {NEVER}"
    )
    assert victim.read_bytes() == VICTIM


def test_restore_logs_checks_every_key_before_cutting_any(tmp_path: Path, victim: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "m.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "out.jsonl").symlink_to(victim)
    for sizes in ({"m.jsonl": 12, "/abs": 3}, {"m.jsonl": 12, "out.jsonl": 3}, {"m.jsonl": 12, "x": -1}):
        with pytest.raises(ckpt.CheckpointError, match=r"^checkpoint CK: logs key "):
            ckpt.restore_logs(run_dir, sizes, 2, source="CK")
        assert (run_dir / "m.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # nothing cut before the refusal
    assert victim.read_bytes() == VICTIM
    ckpt.restore_logs(run_dir, {"m.jsonl": 12}, 2)
    assert (run_dir / "m.jsonl").read_text() == '{"step": 1}\n'


# ---- 3. a link planted as a file the run writes ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("planted", ["metrics.jsonl", "log.jsonl", "run.json", "checkpoints/step-000002.pt"])
def test_resume_refuses_a_link_planted_as_a_run_file_and_never_touches_its_target(
    planted: str, run_copy: Path, victim: Path, tmp_path: Path
) -> None:
    (run_copy / planted).unlink()
    (run_copy / planted).symlink_to(victim)
    result = palestra(["--resume", "runs/sl", "train.steps=6"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == f"{ERROR}runs/sl/{planted} is a link (to {victim}); {NEVER}"
    assert victim.read_bytes() == VICTIM  # neither truncated nor appended to


@pytest.mark.slow
def test_a_new_run_whose_metrics_file_is_a_dangling_link_is_refused_and_creates_nothing(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, sl_config(raw_config))
    (tmp_path / "runs" / "sl").mkdir(parents=True)
    nowhere = tmp_path / "nowhere.txt"
    (tmp_path / "runs" / "sl" / "metrics.jsonl").symlink_to(nowhere)
    result = palestra(["--config", "config.yaml"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == f"{ERROR}runs/sl/metrics.jsonl is a link (to {nowhere}); {NEVER}"
    assert not nowhere.exists()
    assert sorted(p.name for p in (tmp_path / "runs" / "sl").iterdir()) == ["metrics.jsonl"]


def test_the_jsonl_logger_opens_its_file_without_following_a_link(tmp_path: Path, victim: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(RunFolderLink, match=r"run/metrics\.jsonl is a link"):
        JsonlLogger().open(run_dir, {})
    (tmp_path / "elsewhere").mkdir()
    (run_dir / "logs").symlink_to(tmp_path / "elsewhere")  # a folder on the way to the file
    with pytest.raises(RunFolderLink, match=r"run/logs is a link"):
        JsonlLogger(filename="logs/new/m.jsonl").open(run_dir, {})
    assert victim.read_bytes() == VICTIM
    assert list((tmp_path / "elsewhere").iterdir()) == []  # not even the folder new/ was made through it
    logger = JsonlLogger(filename="deep/m.jsonl")  # the ordinary case: folders made inside, one line per log
    logger.open(run_dir, {})
    logger.log({"x": 1.0}, 3)
    logger.close()
    assert json.loads((run_dir / "deep" / "m.jsonl").read_text())["x"] == 1.0


# ---- 4. a checkpoints/ link to another run -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoints_link_to_another_run_is_refused_and_that_run_is_untouched(base_run: Path, tmp_path: Path) -> None:
    other, x = tmp_path / "runs" / "other", tmp_path / "runs" / "x"
    shutil.copytree(base_run, other)
    shutil.copytree(base_run, x)
    shutil.rmtree(x / "checkpoints")
    (x / "checkpoints").symlink_to(Path("..") / "other" / "checkpoints")
    before = digest_tree(other)
    result = palestra(
        ["--resume", "runs/x", "train.steps=8", "train.save_every=1", "train.keep_checkpoints=2"], tmp_path
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == f"{ERROR}runs/x/checkpoints is a link (to ../other/checkpoints); {NEVER}"
    assert digest_tree(other) == before


def fake_state(step: int) -> dict[str, Any]:
    return {"run_id": "A", "step": step, "policy": {"w": torch.full((3,), float(step))}}


def test_retention_and_the_sweep_never_delete_through_a_link(tmp_path: Path) -> None:
    other = tmp_path / "other"
    for step in (1, 2, 3):
        ckpt.save_step_checkpoint(other, fake_state(step), step, keep=5)
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=60)
    (other / "checkpoints" / f".step-000009.pt.{dead.pid}.tmp").write_bytes(b"another run's partial file")
    before = digest_tree(other)
    run_dir = tmp_path / "x"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(other / "checkpoints")
    with pytest.raises(RunFolderLink, match=r"x/checkpoints is a link"):
        ckpt.save_step_checkpoint(run_dir, fake_state(4), 4, keep=1)
    ckpt.sweep_stale_temporaries(run_dir / "checkpoints")
    assert digest_tree(other) == before
    # step files that are links: retention deletes neither them nor what they lead to, only its own old files
    (run_dir / "checkpoints").unlink()
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-000001.pt").symlink_to(other / "checkpoints" / "step-000001.pt")
    for step in (5, 6, 7):
        ckpt.save_step_checkpoint(run_dir, fake_state(step), step, keep=1)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-000001.pt", "step-000007.pt"]
    assert digest_tree(other) == before


# ---- 6. --overwrite and a new run delete (or write beside) only what Palestra wrote ----------------------------
def foreign_folder(root: Path) -> dict[str, str]:
    v = root / "v"
    (v / "sub").mkdir(parents=True)
    (v / "thesis.tex").write_text("x\n")
    (v / "sub" / "d.csv").write_text("x\n")
    (v / "metrics.jsonl").write_text("{}\n")
    return digest_tree(v)


@pytest.mark.slow
def test_overwrite_of_a_folder_holding_files_palestra_did_not_write_deletes_nothing(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    before = foreign_folder(tmp_path)
    write_config(tmp_path, raw_config())
    result = palestra(["--config", "config.yaml", "run.output_dir=.", "run.name=v", "--overwrite"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == (
        f"{ERROR}--overwrite: refusing to clear v: it holds sub/, thesis.tex, which Palestra did not write; "
        "move them away or choose another run.name"
    )
    assert digest_tree(tmp_path / "v") == before
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["metrics.jsonl", "sub", "thesis.tex"]


@pytest.mark.slow
def test_a_new_run_into_a_folder_holding_other_files_is_refused(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    (tmp_path / "runs" / "n").mkdir(parents=True)
    (tmp_path / "runs" / "n" / "notes.txt").write_text("mine\n")
    write_config(tmp_path, raw_config(name="n"))
    result = palestra(["--config", "config.yaml"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result) == (
        f"{ERROR}runs/n holds notes.txt, which Palestra did not write; a run folder holds one run's files only: "
        "choose another run.name (or move it away)"
    )
    assert sorted(p.name for p in (tmp_path / "runs" / "n").iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_overwrite_of_a_whole_run_deletes_its_files_and_refuses_a_stranger_in_checkpoints(
    run_copy: Path, tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, sl_config(raw_config))
    (run_copy / "checkpoints" / "notes.txt").write_text("mine\n")
    refused = palestra(["--config", "config.yaml", "--overwrite"], tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert error_line(refused) == (
        f"{ERROR}--overwrite: refusing to clear runs/sl: it holds checkpoints/notes.txt, which Palestra did not "
        "write; move it away or choose another run.name"
    )
    assert (run_copy / "checkpoints" / "notes.txt").read_text() == "mine\n"
    (run_copy / "checkpoints" / "notes.txt").unlink()
    old_id = json.loads((run_copy / "run.json").read_text())["run_id"]
    again = palestra(["--config", "config.yaml", "--overwrite", "train.steps=2", "train.save_every=0"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_copy / "run.json").read_text())["run_id"] != old_id
    assert not (run_copy / "checkpoints").exists()  # the old run's step files went with it
    for name in ("metrics.jsonl", "log.jsonl"):  # both logs start again: one run's lines
        assert [json.loads(line)["step"] for line in (run_copy / name).read_text().splitlines()] == [0, 1, 2, 2]


def test_the_names_palestra_writes_agree_with_their_writers() -> None:
    from palestra.cli.dashboard import DASHBOARD_FILE
    from palestra.engine.run_lock import LOCK_NAME

    assert {DASHBOARD_FILE, LOCK_NAME, ckpt.RUN_FILE, ckpt.FINAL_NAME, ckpt.CHECKPOINT_DIR} <= set(ckpt.RUN_NAMES)


# ---- a re-run over a failed run that saved no checkpoint starts every log clean ----------------------------------
def wait_for_lines(proc: subprocess.Popen[str], path: Path, lines: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= lines:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run ended (or stalled) before {path} had {lines} line(s): {proc.poll()}")


@pytest.mark.slow
def test_a_rerun_over_a_run_that_saved_nothing_starts_every_log_of_any_name_clean(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    write_config(tmp_path, sl_config(raw_config, steps=400, save_every=0))
    run_dir = tmp_path / "runs" / "sl"
    killed = start(["--config", "config.yaml"], tmp_path)
    wait_for_lines(killed, run_dir / "log.jsonl", 3)  # trained steps, saved no checkpoint
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert not ckpt.holds_checkpoint(run_dir) and (run_dir / "log.jsonl").stat().st_size > 0
    write_config(tmp_path, sl_config(raw_config, steps=2, save_every=0))
    rerun = palestra(["--config", "config.yaml"], tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for name in ("metrics.jsonl", "log.jsonl"):
        assert [json.loads(line)["step"] for line in (run_dir / name).read_text().splitlines()] == [0, 1, 2, 2]


# ---- a full disk under the metrics log ---------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB tmpfs (root: mount; else skipped with the reason), filled to leave about 12 KiB free."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()[:200]}")
    try:
        free = shutil.disk_usage(mount).free
        (mount / "filler").write_bytes(b"\0" * (free - 12 * 1024))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_while_the_metrics_log_is_written_is_one_line_and_keeps_the_lines_written(
    small_disk: Path, tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(output_dir=str(small_disk), name="full", steps=300, save_every=0)
    write_config(tmp_path, raw)
    result = palestra(["--config", "config.yaml"], tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    log = small_disk / "full" / "log.jsonl"
    line = error_line(result)
    step = int(line.split("writing step ")[1].split("'s metrics")[0])
    assert line == (
        f"{ERROR}jsonl logger: writing step {step}'s metrics to {log} failed: no space left on device; "
        "the lines before it are kept"
    )
    complete = log.read_bytes().rsplit(b"\n", 1)[0].decode().splitlines()  # the last line may be cut short
    assert [json.loads(text)["step"] for text in complete] == list(range(len(complete)))
    assert 0 < len(complete) <= step + 1
