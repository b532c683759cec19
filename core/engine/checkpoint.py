"""Checkpoint files: atomic writes, a checksum, ``step-NNNNNN.pt`` retention, RNG capture, and which file to resume.

Layout of a run directory::

    RUN_DIR/run.json                      which run owns the directory (its id; written by ``palestra train``)
    RUN_DIR/checkpoint.pt                 the final state (written when training ends)
    RUN_DIR/checkpoints/step-000040.pt    every train.save_every steps; the newest train.keep_checkpoints stay
    RUN_DIR/checkpoints/latest            the name of the newest step file (one line; for people and tools)

**Writing.** Every file is written to a temporary name in the same folder, flushed and fsynced, renamed over the
target with ``os.replace`` (atomic on POSIX), and the folder is fsynced so that the rename itself survives a power
cut. A process killed mid-write leaves at worst a ``.*.tmp`` file, which is never read and is removed by the next
save: a good checkpoint is never replaced by a partial one. A full disk (ENOSPC) is reported as :class:`DiskFull`,
one line saying how much was needed, and the previous file is untouched.

**Format 3.** A checkpoint is a ``torch.save`` archive of one dict holding only tensors and plain data (dicts,
lists, tuples, strings, numbers, None), so it loads with ``torch.load(weights_only=True)``: loading one never runs
code, and a file that holds anything else (a pickled call such as ``os.system``) is refused by name. Besides the
run's state (:func:`capture_state`: ``step``, ``policy``, ``optimizer``, ``config``
as plain data, ...) every checkpoint carries

* ``format``: 3;
* ``run_id``: the id of the run that wrote it (resume only continues that run's checkpoints);
* ``saved_at``: unix time of the write;
* ``integrity``: ``{"sha256": ...}`` over everything else: every tensor's dtype, shape and bytes, every plain value
  (:func:`content_digest`). A truncated, empty or random file fails to open; a damaged one fails the digest.

**Adapter checkpoints.** For a policy that trains adapters over frozen weights (LoRA:
:class:`palestra.types.AdapterPolicy`), ``policy`` holds only ``adapter_state_dict()`` (the adapters and a value
head) and ``policy_adapters`` is true; the optimiser state covers those tensors alone. The frozen base is not in the
file: resume rebuilds it from the model files the saved config names, then loads the adapters. Same format, same
safety (the adapters are tensors like any weights).

**Resuming** (:func:`resume_point`) takes the owning run's checkpoints (the id in ``run.json``; without one, the run
that saved last), newest step first, and falls back past a corrupt one with a warning. It never follows a link or
pointer out of the run directory and never takes another run's checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import io
import json
import os
import pickle
import random
import re
import shutil
import stat
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from palestra.engine.run_folder import (
    RunFolderLink,
    find_links,
    link_message,
    lstat_in,
    open_in,
    plain_relative,
    remove_file,
    unlink_entry,
    walk_names,
)
from palestra.engine.run_lock import LOCK_NAME, pid_alive
from palestra.types import AdapterPolicy, FileLogger, Stateful

if TYPE_CHECKING:
    from palestra.config import Config, RunComponents
    from palestra.engine.learner import Learner

__all__ = [
    "CHECKPOINT_DIR",
    "FINAL_NAME",
    "FORMAT",
    "RUN_FILE",
    "CheckpointError",
    "CheckpointWarning",
    "DiskFull",
    "Restored",
    "ResumePoint",
    "RunDirError",
    "RunFolderLink",
    "capture_rng",
    "capture_state",
    "check_log_keys",
    "check_new_run_dir",
    "check_run_folder",
    "clear_run_dir",
    "content_digest",
    "find_resume_checkpoint",
    "list_step_checkpoints",
    "load_checkpoint",
    "restore_logs",
    "restore_rng",
    "restore_state",
    "resume_point",
    "run_files",
    "save_checkpoint",
    "save_step_checkpoint",
    "write_atomic",
    "write_run_file",
]

FORMAT = 3
FINAL_NAME = "checkpoint.pt"
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
RUN_FILE = "run.json"
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, unsafe, another format, not its run's); one line, naming the file."""

    palestra_user_error = True


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (it holds another run, or it is not a run directory). One line."""

    palestra_user_error = True


class DiskFull(OSError):
    """The disk filled up while a checkpoint was written; the previous file is untouched. One line."""

    palestra_user_error = True


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt, another run's) or a run's log had to be repaired on resume."""


# ---- writing -------------------------------------------------------------------------------------------
def _fsync_dir(folder: Path) -> None:
    """Persist a rename: fsync the folder that holds the entry (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(target: str | Path, write: Callable[[Path], object], *, needs: int | None = None) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``target``, then fsync and rename it over ``target``.

    If ``write`` raises (or the process dies) ``target`` keeps its previous content; the temporary file is removed
    on an exception and ignored by readers otherwise. A full disk raises :class:`DiskFull`, which says how much the
    file needed (``needs``, bytes, when the caller knows) and how much was free.
    """
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)  # a full disk may refuse the folder itself
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        tmp.unlink(missing_ok=True)  # first, so that the free space the line reports counts the partial file's
        full = DiskFull(_disk_full_message(target, needs))
        full.errno = e.errno
        raise full from e
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _disk_full_message(target: Path, needs: int | None) -> str:
    try:
        free = f"{_human(shutil.disk_usage(target.parent).free)} free"
    except OSError:
        free = "free space unknown"
    need = f"needs at least {_human(needs)}" if needs is not None else "could not be written"
    kept = f"{target.name} keeps its previous content" if target.exists() else f"no {target.name} was written"
    return f"disk full: {target} {need} ({free} on {target.parent}); {kept}; free some space and resume"


def _human(n: int) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _write_state(state: Mapping[str, Any], tmp: Path) -> None:
    """Serialise ``state`` into ``tmp``: the one place a checkpoint's bytes reach the disk.

    torch's zip writer turns a failed write (a full disk) into ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``, which names no cause: the file it writes to keeps the ``OSError`` the
    disk raised, and that is what this raises.
    """
    with _KeepsWriteErrors(io.FileIO(tmp, "wb")) as f:
        try:
            torch.save(state, f)
        except Exception as e:
            if f.error is None or e is f.error:
                raise
            raise f.error from None  # the cause, not torch's account of it


class _KeepsWriteErrors(io.BufferedWriter):
    """A buffered binary file that records the first ``OSError`` a write or a flush raised."""

    error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as e:
            self.error = self.error or e
            raise


def save_checkpoint(state: Mapping[str, Any], target: str | Path) -> Path:
    """Seal ``state`` (format, time, checksum) and write it to ``target`` atomically.

    ``state`` must be tensors and plain data (see the module docstring); anything else is refused here, before a
    byte is written, rather than at resume.
    """
    sealed = seal(state)
    return write_atomic(target, lambda tmp: _write_state(sealed, tmp), needs=payload_bytes(sealed))


def seal(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with ``format``, ``saved_at`` and the ``integrity`` digest of everything else."""
    body = {k: v for k, v in state.items() if k != "integrity"}
    body.update(format=FORMAT, saved_at=time.time())
    return {**body, "integrity": {"sha256": content_digest(body)}}


def payload_bytes(state: Any) -> int:
    """The bytes of every distinct tensor storage in ``state``: a lower bound on the file's size."""
    sizes: dict[tuple[str, int], int] = {}
    for t in map(_local, _tensors(state)):
        storage = t.untyped_storage()
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def step_name(step: int) -> str:
    return f"step-{step:06d}.pt"


def list_step_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step checkpoint file in ``RUN_DIR/checkpoints``, oldest first (none when
    ``checkpoints`` is a link: nothing is listed, read or deleted through it; a step file that is a link is listed,
    for :func:`_candidate_paths` to say where it leads)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    out = []
    for name, st in walk_names(folder):
        m = _STEP_FILE.match(name)
        if m and (stat.S_ISREG(st.st_mode) or (stat.S_ISLNK(st.st_mode) and (folder / name).is_file())):
            out.append((int(m.group(1)), folder / name))
    return sorted(out)


def save_step_checkpoint(run_dir: str | Path, state: Mapping[str, Any], step: int, keep: int) -> Path:
    """Write ``checkpoints/step-NNNNNN.pt`` and point ``latest`` at it.

    Keeps the newest ``keep`` step checkpoints and clears stale temporaries: only regular files in the real
    ``checkpoints`` folder are deleted, never through a link (a ``checkpoints`` link, to another run's folder say,
    is refused before anything is written).
    """
    folder = Path(run_dir) / CHECKPOINT_DIR
    if folder.is_symlink():
        raise RunFolderLink(link_message(folder))
    path = save_checkpoint(state, folder / step_name(step))
    write_atomic(folder / LATEST, lambda tmp: tmp.write_text(path.name + "\n", encoding="utf-8"))
    steps = sorted(
        (int(m.group(1)), name)
        for name, st in walk_names(folder)
        if (m := _STEP_FILE.match(name)) and stat.S_ISREG(st.st_mode)
    )
    for _, name in steps[:-keep]:
        unlink_entry(folder, name)
    sweep_stale_temporaries(folder)
    return path


def sweep_stale_temporaries(folder: Path) -> None:
    """Delete the ``.NAME.PID.tmp`` files in ``folder`` left by processes killed mid-write; a live process's
    temporary (another writer's, or ours) is left alone, and nothing is deleted when ``folder`` is a link."""
    for name, st in walk_names(folder):
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        pid = name.rsplit(".", 2)[-2] if name.count(".") >= 3 else ""
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):  # a link is removed itself, never followed
            unlink_entry(folder, name)


# ---- the checksum --------------------------------------------------------------------------------------
_PLAIN = (bool, int, float, str, bytes, type(None))


def content_digest(state: Mapping[str, Any]) -> str:
    """sha256 of ``state``'s content: each tensor's dtype, shape and bytes, each plain value, in order.

    Computed over the objects rather than the file, so that it can live inside the file it checks; a value that
    is not plain data raises :class:`CheckpointError` naming where it is (``weights_only`` could not load it).
    """
    h = hashlib.sha256()
    _feed(h, state, "state")
    return h.hexdigest()


def _feed(h: Any, value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"T{type(value).__name__}{value.dtype}{tuple(value.shape)}".encode())
        h.update(_local_bytes(value))
    elif isinstance(value, Mapping):
        h.update(b"{%d" % len(value))
        for k, v in value.items():
            _feed(h, k, where)
            _feed(h, v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        h.update(b"[%d" % len(value))
        for i, v in enumerate(value):
            _feed(h, v, f"{where}[{i}]")
    elif type(value) in _PLAIN:  # exact types: a numpy float64 is a float but would not load with weights_only
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (torch.dtype, torch.device)):
        h.update(f"{type(value).__name__}:{value};".encode())
    else:
        text = repr(value)
        raise CheckpointError(
            f"checkpoint {where} is {type(value).__module__}.{type(value).__qualname__} "
            f"{text if len(text) <= 60 else text[:57] + '...'}, which cannot be saved: a checkpoint holds only "
            "tensors and plain data (dicts, lists, strings, numbers), so that loading it never runs code "
            "(a plugin's state_dict or on_checkpoint_save hook must store plain data)"
        )


def _local(value: torch.Tensor) -> torch.Tensor:
    """This process's plain copy of ``value``: a DTensor's local shard (an optimiser's sharded state under FSDP;
    gathering it would take every rank)."""
    t = value.detach()
    return t.to_local() if type(t) is not torch.Tensor and hasattr(t, "to_local") else t


def _local_bytes(value: torch.Tensor) -> Any:
    t = _local(value)
    t = t.to_dense() if t.layout != torch.strided else t
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


# ---- reading -------------------------------------------------------------------------------------------
def load_checkpoint(path: str | Path, *, verify: bool = True, mmap: bool = False) -> dict[str, Any]:
    """The state in checkpoint ``path``, loaded with ``torch.load(weights_only=True)`` on the CPU.

    Raises one-line :class:`CheckpointError` for a file that is empty, truncated or not a torch archive, that holds
    something other than tensors and plain data (nothing in it is run), that has another format, or (``verify``)
    whose content does not match its recorded sha256.
    """
    path = Path(path)
    _check_archive(path)
    if (
        torch.distributed.is_available()
    ):  # registers DTensor (an FSDP optimiser's state), which weights_only loads as data
        importlib.import_module("torch.distributed.tensor")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"checkpoint {path} is refused: {_unpickling_reason(e)}") from None
    except Exception as e:  # noqa: BLE001 - torch reports a damaged archive with RuntimeError, EOFError, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(
            f"checkpoint {path} is not a palestra checkpoint (it holds {type(state).__name__}, not a state with a step)"
        )
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {state.get('format')!r}; this palestra reads format {FORMAT} "
            "(older checkpoints were pickled objects that cannot be loaded safely)"
        )
    if verify:
        _verify(path, state)
    return state


def _check_archive(path: Path) -> None:
    """Reject what cannot be a torch archive before torch sees it: missing, empty, truncated, random bytes."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is corrupt: it is empty (0 bytes)")
    if not zipfile.is_zipfile(path):  # a torch archive is a zip whose directory is at its end
        raise CheckpointError(
            f"checkpoint {path} is corrupt: truncated or not a torch.save "
            f"archive ({size} bytes, no zip directory at its end)"
        )


def _unpickling_reason(e: pickle.UnpicklingError) -> str:
    """What ``weights_only`` refused, in a few words (torch's message is a page long)."""
    text = str(e)
    culprit = re.search(r"GLOBAL ([\w.]+)", text)
    if culprit:
        return (
            f"it holds a pickled reference to {culprit.group(1)}, which is code, not data; "
            "palestra loads checkpoints with torch.load(weights_only=True) and ran nothing"
        )
    detail = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), type(e).__name__)
    return f"it does not unpickle as tensors and plain data ({detail[:200]}); nothing in it was run"


def _verify(path: Path, state: dict[str, Any]) -> None:
    recorded = state.get("integrity")
    if not (isinstance(recorded, dict) and isinstance(recorded.get("sha256"), str)):
        raise CheckpointError(f"checkpoint {path} is corrupt: it has no integrity checksum")
    body = {k: v for k, v in state.items() if k != "integrity"}
    try:
        actual = content_digest(body)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None
    if actual != recorded["sha256"]:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its content does not match the sha256 recorded when it was written"
        )


# ---- which checkpoint --resume continues -------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    path: Path
    run_id: str | None
    step: int
    saved_at: float


@dataclass
class ResumePoint:
    """The checkpoint a resumed run continues from, already loaded and verified."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def find_resume_checkpoint(run_dir: str | Path) -> Path:
    """The path :func:`resume_point` would continue from."""
    return resume_point(run_dir).path


def resume_point(run_dir: str | Path) -> ResumePoint:
    """The newest intact checkpoint of the run that owns ``run_dir``, loaded and verified.

    The owner is the run named in ``RUN_DIR/run.json`` (else the run whose checkpoint was saved last); its
    checkpoints are tried by step, newest first. A corrupt or unsafe one is skipped with a :class:`CheckpointWarning`
    naming it; another run's checkpoints are never taken. One-line errors when there is nothing to resume.
    """
    run_dir = existing_run_dir(run_dir)
    paths = _candidate_paths(run_dir)
    if not paths:
        raise FileNotFoundError(
            f"--resume: {str(run_dir)!r} holds no checkpoint ({FINAL_NAME} or {CHECKPOINT_DIR}/step-*.pt); "
            "set train.save_every to write them during training"
        )
    headers: list[_Header] = []
    broken: dict[Path, str] = {}
    for path in paths:
        try:
            headers.append(_peek(path))
        except CheckpointError as e:
            broken[path] = str(e)
    owner = read_run_id(run_dir)
    if owner is None and headers:
        owner = max(headers, key=lambda h: h.saved_at).run_id
    ours = sorted((h for h in headers if h.run_id == owner), key=lambda h: (h.step, h.saved_at), reverse=True)
    others = [h for h in headers if h.run_id != owner]
    if others:
        names = ", ".join(str(h.path.relative_to(run_dir)) for h in others)
        warnings.warn(
            f"{run_dir}: ignoring {len(others)} checkpoint(s) of another run ({names}); "
            f"resume continues only run {owner}",
            CheckpointWarning,
            stacklevel=2,
        )
    for header in ours:
        try:
            state = load_checkpoint(header.path)
        except CheckpointError as e:
            broken[header.path] = str(e)
            continue
        for why in broken.values():
            warnings.warn(f"{why}; resuming from {header.path} (step {header.step})", CheckpointWarning, stacklevel=2)
        return ResumePoint(header.path, state)
    whose = f" of run {owner}" if owner is not None and others else ""
    reasons = "; ".join(broken.values()) or "every checkpoint there belongs to another run"
    raise CheckpointError(f"--resume: {run_dir} holds no intact checkpoint{whose}: {reasons}")


def existing_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` if it is a directory; one line otherwise (a checkpoint file is answered with its run directory)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        owner = run_dir.parent.parent if run_dir.parent.name == CHECKPOINT_DIR else run_dir.parent
        raise RunDirError(
            f"--resume takes the run directory, not a file: {str(run_dir)!r} is a file; "
            f"use --resume {owner} (it picks the newest intact checkpoint)"
        )
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume: run directory {str(run_dir)!r} does not exist")
    return run_dir


def _candidate_paths(run_dir: Path) -> list[Path]:
    """``checkpoint.pt`` and every step file, inside ``run_dir`` (a step file linking out of it is skipped with a
    warning; a ``checkpoints`` link is refused: resume would write its new step files there)."""
    if (run_dir / CHECKPOINT_DIR).is_symlink():
        raise RunFolderLink(link_message(run_dir / CHECKPOINT_DIR))
    _check_latest(run_dir)
    paths = [p for _, p in list_step_checkpoints(run_dir)]
    if stat.S_ISREG(getattr(lstat_in(run_dir, FINAL_NAME), "st_mode", 0)):
        paths.append(run_dir / FINAL_NAME)
    inside = []
    root = run_dir.resolve()
    for p in paths:
        if root in p.resolve().parents:
            inside.append(p)
        else:
            warnings.warn(
                f"{p} links to {p.resolve()}, outside the run directory; ignored", CheckpointWarning, stacklevel=3
            )
    return inside


def _check_latest(run_dir: Path) -> None:
    """Warn about a ``checkpoints/latest`` that names anything but a step file beside it (it is never followed:
    resume orders the run's own files by step)."""
    latest = run_dir / CHECKPOINT_DIR / LATEST
    if not latest.is_file() and not latest.is_symlink():
        return
    try:
        name = latest.read_text(encoding="utf-8").strip() if not latest.is_symlink() else str(os.readlink(latest))
    except (OSError, UnicodeDecodeError):
        name = "(unreadable)"
    if not _STEP_FILE.match(name):
        warnings.warn(
            f"{latest} names {name[:80]!r}, not a step file in {latest.parent}; ignored",
            CheckpointWarning,
            stacklevel=4,
        )


def _peek(path: Path) -> _Header:
    """Run id, step and save time of ``path`` (memory-mapped, not verified: cheap enough to read every candidate)."""
    state = load_checkpoint(path, verify=False, mmap=True)
    run_id = state.get("run_id")
    saved_at = state.get("saved_at")
    return _Header(
        path,
        run_id if isinstance(run_id, str) else None,
        int(state["step"]),
        float(saved_at) if isinstance(saved_at, (int, float)) else 0.0,
    )


# ---- the run directory ---------------------------------------------------------------------------------
# What makes a directory hold a run: palestra train refuses to start a new one over these without --overwrite.
RUN_MARKERS = (RUN_FILE, FINAL_NAME, CHECKPOINT_DIR, "metrics.jsonl")
# Every name Palestra itself writes directly in a run folder, and who writes it: this module (run.json, the
# checkpoints), run_lock (.lock), the jsonl logger (metrics.jsonl by default), palestra train's dashboard
# (palestra.cli.dashboard.DASHBOARD_FILE) and train.export (export/ by default), the tensorboard and wandb loggers
# (their default folders), and TensorBoard event files (a tensorboard log_dir of "."). A logger file or export
# folder named in the config is the config's (:func:`run_files`). --overwrite deletes these and nothing else.
RUN_NAMES = (
    *RUN_MARKERS,
    LOCK_NAME,
    "dashboard.png",
    "export",
    "tensorboard",
    "wandb",
)
# Temporaries: write_atomic's .NAME.PID.tmp, palestra export's .NAME.export-PID.tmp and .NAME.old-PID folders,
# and TensorBoard's event files.
_RUN_TEMPORARY = re.compile(r"^(\..+\.(\d+\.tmp|export-\d+\.tmp|old-\d+)|events\.out\.tfevents\..+)$")
# Names a checkpoint's "logs" may not give: Palestra's own files, which restore_logs would cut.
_NOT_LOGS = (RUN_FILE, FINAL_NAME, CHECKPOINT_DIR, LOCK_NAME, "dashboard.png", "export")


def run_files(config: Config, run_dir: str | Path) -> list[str]:
    """The files and folders, relative to ``run_dir``, that ``config``'s loggers and ``train.export`` write in the
    run folder besides :data:`RUN_NAMES` (a jsonl ``filename``, a tensorboard ``log_dir``, an export folder inside
    it); a path outside the folder is not listed."""
    names: list[str] = []
    for spec in config.loggers:
        value = {"jsonl": "filename", "tensorboard": "log_dir"}.get(spec.name)
        if value is not None and isinstance(getattr(spec.options, value, None), str):
            names.append(getattr(spec.options, value))
        elif spec.name == "wandb":
            names.append("wandb")
    if config.train.export:
        out = Path(config.train.export_dir) if config.train.export_dir is not None else Path(run_dir) / "export"
        with contextlib.suppress(ValueError, OSError):
            names.append(str(out.resolve().relative_to(Path(run_dir).resolve())))
    cleaned = [os.path.normpath(n) for n in names if not os.path.isabs(n)]
    return [n for n in cleaned if plain_relative(n)]


def write_run_file(run_dir: str | Path, run_id: str, name: str) -> Path:
    """``RUN_DIR/run.json``: the id of the run that owns the directory (resume continues only its checkpoints)."""
    path = Path(run_dir) / RUN_FILE
    if path.is_symlink():  # the rename below would replace the link, not follow it: still, no run takes a link
        raise RunFolderLink(link_message(path))
    record = {"run_id": run_id, "name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record) + "\n", encoding="utf-8"))


def _read_run_record(run_dir: Path) -> Any:
    """``run.json``'s parsed content (None when it is absent, not a regular file, unreadable or not JSON), read
    without following a link (a link raises :class:`RunFolderLink`) and without blocking on a FIFO."""
    try:
        fd = open_in(run_dir, RUN_FILE, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except RunFolderLink:
        raise
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        try:
            return json.loads(f.read(1 << 20).decode("utf-8"))
        except (OSError, ValueError):
            return None


def read_run_id(run_dir: str | Path) -> str | None:
    """The run id in ``RUN_DIR/run.json``, or None when there is none (or it is unreadable: warned). A ``run.json``
    that is a link is refused (:class:`RunFolderLink`)."""
    path = Path(run_dir) / RUN_FILE
    if not os.path.lexists(path):
        return None
    record = _read_run_record(Path(run_dir))
    run_id = record.get("run_id") if isinstance(record, dict) else None
    if not isinstance(run_id, str):
        warnings.warn(
            f"{path} is unreadable; taking the run that saved last as the owner", CheckpointWarning, stacklevel=3
        )
        return None
    return run_id


def run_markers(run_dir: str | Path) -> list[str]:
    """The run files ``run_dir`` holds (empty when it is free for a new run); a link counts, dangling or not."""
    run_dir = Path(run_dir)
    return [name for name in RUN_MARKERS if os.path.lexists(run_dir / name)] if run_dir.is_dir() else []


def holds_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint (final or step): without one, a run there saved nothing to resume."""
    final = os.lstat(Path(run_dir) / FINAL_NAME) if os.path.lexists(Path(run_dir) / FINAL_NAME) else None
    return (final is not None and stat.S_ISREG(final.st_mode)) or bool(list_step_checkpoints(run_dir))


def is_unsaved_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds what a palestra run wrote before its first checkpoint (its ``run.json``) and no
    checkpoint: a folder with a ``metrics.jsonl`` and no ``run.json`` may be anyone's, and stays protected."""
    try:
        record = _read_run_record(Path(run_dir))
    except RunFolderLink:
        return False
    return isinstance(record, dict) and isinstance(record.get("run_id"), str) and not holds_checkpoint(run_dir)


def foreign_entries(run_dir: str | Path, own: Sequence[str] = ()) -> list[str]:
    """What ``run_dir`` holds that Palestra did not write (not in :data:`RUN_NAMES`, not a temporary, not one of
    ``own``: the config's :func:`run_files`), a sub-folder shown with a ``/``; in ``checkpoints/`` too."""
    allowed = {*RUN_NAMES, *(name.split("/")[0] for name in own)}
    found = []
    for name, st in walk_names(run_dir):
        if name not in allowed and not _RUN_TEMPORARY.match(name):
            found.append(name + "/" if stat.S_ISDIR(st.st_mode) else name)
        elif name == CHECKPOINT_DIR and stat.S_ISDIR(st.st_mode):
            found += [
                f"{CHECKPOINT_DIR}/{inner}"
                for inner, _ in walk_names(Path(run_dir) / CHECKPOINT_DIR)
                if not (_STEP_FILE.match(inner) or inner == LATEST or _RUN_TEMPORARY.match(inner))
            ]
    return found


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_run_folder(run_dir: str | Path) -> None:
    """Refuse (:class:`RunFolderLink`, one line) a link directly in ``run_dir`` or in its ``checkpoints/``: Palestra
    never makes one there, and a run that wrote through one would write (or cut, or delete) outside its folder.
    (A ``.lock`` link is left to :class:`~palestra.engine.run_lock.RunLock`, whose own line names it.)"""
    links = [p for p in find_links(run_dir, (CHECKPOINT_DIR,)) if p.name != LOCK_NAME or p.parent != Path(run_dir)]
    if links:
        raise RunFolderLink(link_message(links[0]))


def check_new_run_dir(
    run_dir: str | Path, *, overwrite: bool, name_key: str = "run.name", own: Sequence[str] = ()
) -> None:
    """Refuse to start a new run in a directory that holds one, unless ``overwrite`` (one line with the ways out).

    A run that saved no checkpoint (it failed at step 0, or was killed first) is no run to protect: a new run may
    start over it (:func:`clear_unsaved_run`). A folder holding a link, or anything Palestra did not write (not a
    run's files: :data:`RUN_NAMES` and ``own``, the config's :func:`run_files`) is refused, with or without
    ``overwrite``: a run folder holds one run's files and nothing else."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    check_run_folder(run_dir)
    foreign = foreign_entries(run_dir, own)
    if foreign and overwrite:
        raise RunDirError(
            f"--overwrite: refusing to clear {run_dir}: it holds {_shown(foreign)}, which Palestra did not write; "
            f"move {'it' if len(foreign) == 1 else 'them'} away or choose another {name_key}"
        )
    if foreign:
        raise RunDirError(
            f"{run_dir} holds {_shown(foreign)}, which Palestra did not write; a run folder holds one run's files "
            f"only: choose another {name_key} (or move {'it' if len(foreign) == 1 else 'them'} away)"
        )
    found = run_markers(run_dir)
    if found and not overwrite and not is_unsaved_run(run_dir):
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}); continue it with --resume {run_dir}, "
            f"start another with a new {name_key}=..., or replace it with --overwrite"
        )


def clear_run_dir(run_dir: str | Path, *, keep: Path | None = None, own: Sequence[str] = ()) -> None:
    """Delete the run in ``run_dir`` (``--overwrite``): what Palestra wrote there (:data:`RUN_NAMES`, temporaries,
    ``own``: the config's :func:`run_files`), after checking that the folder holds nothing else.

    Refused (one line) when the directory is the working directory or one of its parents, holds other runs in
    sub-directories (an output_dir rather than a run), holds ``keep`` (the config file the run was started with),
    a link, or any file Palestra did not write. The lock file stays (this run holds it).
    """
    run_dir = Path(run_dir)
    if not run_markers(run_dir):
        return
    root, cwd = run_dir.resolve(), Path.cwd().resolve()
    why = None
    if root == cwd or root in cwd.parents:
        why = "it is the working directory or one of its parents"
    elif nested := sorted(
        name
        for name, st in walk_names(root)
        if stat.S_ISDIR(st.st_mode)
        and name != CHECKPOINT_DIR
        and any(os.path.lexists(root / name / m) for m in (RUN_FILE, FINAL_NAME, CHECKPOINT_DIR))
    ):
        why = f"it holds other runs ({', '.join(nested[:3])})"
    elif keep is not None and root in keep.resolve().parents:
        why = f"it holds the config file {keep}"
    if why:
        raise RunDirError(f"--overwrite: refusing to delete {run_dir}: {why}; choose a run.name of its own")
    check_new_run_dir(run_dir, overwrite=True, own=own)  # a link or a file of someone else's: nothing deleted
    for name, st in walk_names(root):
        if name == LOCK_NAME:
            continue  # held by this run: deleting it would let a second writer lock a new file beside ours
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(root / name)  # never follows a link inside it (the fd-based rmtree)
        else:
            unlink_entry(root, name)


def clear_unsaved_run(run_dir: str | Path, log_files: Sequence[str | Path] = ()) -> None:
    """Remove what a run that saved no checkpoint left in ``run_dir``: ``run.json``, ``metrics.jsonl``, the files
    ``log_files`` (its loggers', relative to ``run_dir`` or under it: :func:`run_files` of the config of the run
    that starts over it) and an empty ``checkpoints/``; only regular files inside the folder, never through a link."""
    run_dir = Path(run_dir)
    for name in [RUN_FILE, "metrics.jsonl", *log_files]:
        path = Path(name)
        with contextlib.suppress(ValueError):
            path = path.relative_to(run_dir)  # a logger's path, run_dir/filename
        if plain_relative(path.as_posix()):
            remove_file(run_dir, path.as_posix())
    with contextlib.suppress(OSError):
        (run_dir / CHECKPOINT_DIR).rmdir()  # only when empty (and not a link: rmdir refuses one)


# ---- random number generators ------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """This process's global RNG states as plain data: python ``random``, torch CPU, every CUDA device (if
    initialised), numpy (if imported; its key array stored as a list of ints, which ``weights_only`` loads)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Undo :func:`capture_rng` (entries this process cannot use, such as CUDA on a CPU machine, are skipped)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---- logged files --------------------------------------------------------------------------------------
def log_sizes(loggers: list[Any], run_dir: Path) -> dict[str, int]:
    """Bytes in each file-backed logger's file (the jsonl logger's ``path``), keyed by path relative to the run
    (a file that is not a regular file inside the run folder is not recorded)."""
    out: dict[str, int] = {}
    for logger in loggers:
        path = logger.path if isinstance(logger, FileLogger) else None
        if not isinstance(path, Path):
            continue
        try:
            rel = path.relative_to(run_dir).as_posix()
            st = lstat_in(run_dir, rel) if plain_relative(rel) else None
        except (ValueError, OSError):
            continue
        if st is not None and stat.S_ISREG(st.st_mode):
            out[rel] = st.st_size
    return out


def check_log_keys(run_dir: Path, sizes: Any, source: str | Path) -> dict[str, int]:
    """``sizes`` (a checkpoint's ``logs``), checked as data from the run folder: each key a plain relative name of
    a log file inside ``run_dir`` (not absolute, no ``..``, no NUL, not one of Palestra's own files, not a link on
    the way) and each size a number of bytes. One line naming ``source`` and the key otherwise; nothing is cut."""
    if not isinstance(sizes, Mapping):
        raise CheckpointError(f"checkpoint {source}: logs is {type(sizes).__name__}, not a mapping of log files")
    out: dict[str, int] = {}
    for key, size in sizes.items():
        where = f"checkpoint {source}: logs key {str(key)[:80]!r}"
        if not plain_relative(key) or key.split("/")[0] in _NOT_LOGS or _RUN_TEMPORARY.match(key.split("/")[0]):
            raise CheckpointError(
                f"{where} is not the name of a log file inside the run folder; refused, nothing was cut "
                "(a checkpoint names only its run's own log files)"
            )
        if type(size) is not int or size < 0:
            raise CheckpointError(f"{where} records {str(size)[:40]!r}, not a number of bytes; refused")
        try:
            st = lstat_in(run_dir, key)
        except (RunFolderLink, NotADirectoryError) as e:
            raise CheckpointError(f"{where}: {e}") from None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"{where}: {link_message(run_dir / key)}")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where} names {run_dir / key}, which is not a regular file; refused")
        out[key] = size
    return out


def restore_logs(run_dir: Path, sizes: Mapping[str, int], step: int, *, source: str | Path = "(state)") -> None:
    """Cut each logged file back to where it was at the checkpoint (``sizes``, recorded at ``step`` in ``source``).

    Lines a killed run wrote after its checkpoint are dropped, and the resumed run writes them again (no step
    appears twice). The cut always lands just after a complete line at or before the recorded size: a file that
    is shorter than recorded (lines lost) or would end mid-line is cut to its last complete line with a
    :class:`CheckpointWarning`, so the resumed run never appends after a fragment. The keys are checked first
    (:func:`check_log_keys`), and each file is opened without following a link.
    """
    for rel, size in check_log_keys(run_dir, sizes, source).items():
        path = run_dir / rel
        try:
            fd = open_in(run_dir, rel, os.O_RDWR | os.O_NONBLOCK)
        except FileNotFoundError:
            warnings.warn(
                f"{path} is missing (it had {size} bytes at step {step}); the resumed run starts a new one",
                CheckpointWarning,
                stacklevel=2,
            )
            continue
        except RunFolderLink as e:  # appeared since the check
            raise CheckpointError(f"checkpoint {source}: logs key {rel!r}: {e}") from None
        with os.fdopen(fd, "r+b") as f:
            _cut_log(f, path, size, step)


def _cut_log(f: Any, path: Path, size: int, step: int) -> None:
    """Cut the open log ``f`` (``path``) to its last complete line at or before ``size`` bytes (warned when short)."""
    actual = os.fstat(f.fileno()).st_size
    end = _line_end_at_or_before(f, min(size, actual))
    if actual < size:
        warnings.warn(
            f"{path} is {actual} bytes, shorter than the {size} recorded at step {step}: lines were "
            f"lost; cut to its last complete line ({end} bytes) before resuming",
            CheckpointWarning,
            stacklevel=3,
        )
    elif end < size:
        warnings.warn(
            f"{path} ends mid-line at the {size} bytes recorded at step {step}; cut to its last "
            f"complete line ({end} bytes) before resuming",
            CheckpointWarning,
            stacklevel=3,
        )
    if end < actual:
        f.truncate(end)


def _line_end_at_or_before(f: Any, limit: int, chunk: int = 1 << 16) -> int:
    """The offset just past the last newline in the first ``limit`` bytes of ``f`` (0 when there is none)."""
    pos = limit
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        block = f.read(pos - start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


# ---- a run's state -------------------------------------------------------------------------------------------------
def capture_state(
    run: RunComponents,
    learner: Learner,
    *,
    step: int,
    run_id: str,
    reward_ema: float | None,
    bad_steps: int,
    before: Mapping[str, Any] | None,
    run_dir: Path,
) -> dict[str, Any]:
    """Everything a run needs to continue bitwise: weights, optimiser (+ scaler, replay buffer, running reward
    statistics), every rank's RNG states, step, reward curriculum, reward EMA, environment state (when it has
    one), the held-out reward before training, and the logged files' sizes.

    Collective under torchrun (every rank must call it: RNG states are gathered, FSDP gathers full tensors);
    the complete state is meaningful on rank 0.
    """
    dist = run.dist
    algorithm = learner.state_dict()  # collective under FSDP: the full optimiser states
    adapters = isinstance(run.policy, AdapterPolicy)
    if adapters:  # LoRA: the trainable tensors only; resume rebuilds the frozen base from its model files
        policy = run.policy.adapter_state_dict()
    elif dist.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        policy = get_model_state_dict(run.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        policy = run.policy.state_dict()
    return {
        "format": FORMAT,
        "run_id": run_id,
        "step": step,
        "policy": policy,
        "policy_adapters": adapters,  # "policy" holds only the adapters (and value head) of a LoRA policy
        "optimizer": algorithm,
        "reward": run.reward.state_dict(),
        "reward_ema": reward_ema,
        "bad_steps": bad_steps,
        "before": dict(before) if before is not None else None,
        "env": run.env.state_dict() if isinstance(run.env, Stateful) else None,
        "rng": dist.all_gather_object(capture_rng()),
        "world_size": dist.world_size,
        "logs": log_sizes(run.loggers, run_dir),
        "config": run.config.to_dict(),
        "base_fingerprint": base_fingerprint(run.policy),  # a LoRA run's frozen base, checked when it is rebuilt
        "threads": torch.get_num_threads(),  # a resume takes the same count: reductions split by thread
    }


# Values sampled from each frozen base tensor for its fingerprint: enough that another model of the same shape
# differs, few enough that a 1.5 GB base costs milliseconds at every checkpoint.
FINGERPRINT_SAMPLE = 1024


def base_fingerprint(policy: Any) -> str | None:
    """sha256 over a fixed sample of the frozen base of a policy that trains adapters (None for one that trains every
    weight): each base tensor's name, dtype and shape, and up to :data:`FINGERPRINT_SAMPLE` values evenly spaced
    through it (the first and last included). Deterministic, reads no file, changes no random state."""
    if not isinstance(policy, AdapterPolicy):
        return None
    # By storage, not name: a policy may reach one tensor under two names (an adapter through an alias of its layers)
    seen = {v.data_ptr() for v in policy.adapter_state_dict().values() if isinstance(v, torch.Tensor)}
    h = hashlib.sha256()
    weights = policy.state_dict() if isinstance(policy, torch.nn.Module) else {}
    for name, value in sorted(weights.items()):
        if not isinstance(value, torch.Tensor) or value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)};".encode())
        flat = value.detach().reshape(-1)
        n = flat.numel()
        if n > FINGERPRINT_SAMPLE:
            at = torch.arange(FINGERPRINT_SAMPLE, dtype=torch.int64) * (n - 1) // (FINGERPRINT_SAMPLE - 1)
            flat = flat.index_select(0, at.to(flat.device))
        h.update(_local_bytes(flat))
    return h.hexdigest()


@dataclass(frozen=True)
class Restored:
    """The loop's own part of a restored checkpoint (the components restore theirs in :func:`restore_state`)."""

    step: int
    run_id: str | None  # None in a checkpoint that predates run ids
    reward_ema: float | None
    bad_steps: int
    before: dict[str, Any] | None  # the held-out reward before training, as EvalResult.to_dict() wrote it
    log_sizes: dict[str, int]


def restore_state(
    run: RunComponents, learner: Learner, state: Mapping[str, Any], *, source: str | Path = "(state)"
) -> Restored:
    """Restore the components from ``state`` (:func:`capture_state`'s, loaded with :func:`load_checkpoint` from
    ``source``): weights, optimiser, reward, environment, this rank's RNG streams. Returns the loop's part."""
    _check_policy_kind(run, bool(state.get("policy_adapters", False)), source)
    check_finite(state["policy"], source)
    _check_base(run, state.get("base_fingerprint"), source)
    try:
        _load_policy(run, state["policy"])
    except (RuntimeError, KeyError, ValueError) as e:  # torch reports a mismatch as a page of size mismatches
        mismatch = policy_mismatch(run, state["policy"], source)
        if mismatch is None:  # the names and shapes agree: not the user's checkpoint, a fault to show in full
            raise
        raise CheckpointError(mismatch) from e
    learner.load_state_dict(state["optimizer"])  # FSDP: the learner scatters the full optimiser states
    run.reward.load_state_dict(state["reward"])
    if state.get("env") is not None and isinstance(run.env, Stateful):
        run.env.load_state_dict(state["env"])
    dist = run.dist
    rng = state.get("rng") or []
    if len(rng) == dist.world_size:  # another world size: RNG streams cannot match anyway
        restore_rng(rng[dist.rank])
    elif dist.is_main:
        warnings.warn(
            f"checkpoint {source}: saved by {len(rng)} rank(s), resumed on {dist.world_size}; "
            "random states start fresh",
            stacklevel=3,
        )
    run_id = state.get("run_id")
    return Restored(
        step=int(state["step"]),
        run_id=run_id if isinstance(run_id, str) else None,
        reward_ema=state["reward_ema"],
        bad_steps=int(state.get("bad_steps", 0)),
        before=state.get("before"),
        log_sizes=dict(state.get("logs") or {}),
    )


def _check_policy_kind(run: RunComponents, saved_adapters: bool, source: str | Path) -> None:
    """One line when the checkpoint holds adapters only and the policy trains every weight, or the other way."""
    live_adapters = isinstance(run.policy, AdapterPolicy)
    if saved_adapters != live_adapters:
        saved, live = (
            ("only LoRA adapters", "trains every weight")
            if saved_adapters
            else ("every weight", "trains LoRA adapters")
        )
        raise CheckpointError(
            f"checkpoint {source} holds {saved} but the policy built from its config "
            f"(policy {run.config.policy.name!r}, policy.options.lora) {live}"
        )


def check_finite(weights: Mapping[str, Any], source: str | Path) -> None:
    """One line naming the first weight of ``weights`` holding a NaN or an infinity: nothing can continue from it
    (sampling from NaN logits fails deep inside, an export would write it silently)."""
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        finite = torch.isfinite(value)
        if bool(finite.all()):
            continue
        bad = value.numel() - int(finite.sum())
        raise CheckpointError(
            f"checkpoint {source} holds non-finite weights: {name} {list(value.shape)} has {bad} of "
            f"{value.numel()} values NaN or infinite; it can be neither resumed nor exported (move it out of the "
            "run folder to resume from the step file before it, or export that one with --checkpoint)"
        )


def _check_base(run: RunComponents, recorded: Any, source: str | Path) -> None:
    """One line when the frozen base the config rebuilt is not the one the checkpoint's adapters were trained on
    (another model of the same shape would take the adapters silently). A checkpoint without a fingerprint (older
    than it) is not checked."""
    if not isinstance(recorded, str):
        return
    if base_fingerprint(run.policy) == recorded:
        return
    options = run.config.policy.options
    where = repr(getattr(options, "path", "(policy.options)"))
    gguf = getattr(options, "gguf_file", None)
    where += f" (gguf_file {gguf!r})" if gguf else ""
    raise CheckpointError(
        f"checkpoint {source}: the base model at {where} is not the one its LoRA adapters were trained on (the "
        "fingerprint of its frozen weights differs from the one recorded in the checkpoint); point "
        "policy.options.path at the model the run was trained on"
    )


def _load_policy(run: RunComponents, weights: Mapping[str, Any]) -> None:
    if isinstance(run.policy, AdapterPolicy):  # the frozen base was loaded from its files when the policy was built
        run.policy.load_adapter_state_dict(weights)
    elif run.dist.fsdp:
        from palestra.scale.distributed import load_full_state_dict

        load_full_state_dict(run.policy, weights)
    else:
        run.policy.load_state_dict(weights)


def policy_mismatch(run: RunComponents, saved: Mapping[str, Any], source: str | Path) -> str | None:
    """One line naming the first parameter whose name or shape differs between the checkpoint and the policy its
    config built; None when they agree."""
    where = (
        f"checkpoint {source} does not fit the policy built from its config (policy {run.config.policy.name!r}, "
        "policy.options)"
    )
    # FSDP: DTensors, whose shapes are the full ones; LoRA: the adapters, all a checkpoint holds
    live = run.policy.adapter_state_dict() if isinstance(run.policy, AdapterPolicy) else run.policy.state_dict()
    for name, value in live.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name not in saved:
            return f"{where}: parameter {name!r} {list(value.shape)} is not in the checkpoint"
        stored = saved[name]
        if isinstance(stored, torch.Tensor) and stored.shape != value.shape:
            return (
                f"{where}: parameter {name!r} is {list(stored.shape)} in the checkpoint"
                f" and {list(value.shape)} in the policy"
            )
    extra = next((k for k in saved if k not in live), None)
    if extra is not None:
        return f"{where}: the checkpoint has parameter {extra!r}, which the policy does not"
    return None
