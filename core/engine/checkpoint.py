"""Checkpoint files: atomic writes, ``step-NNNNNN.pt`` retention with a ``latest`` pointer, RNG capture, resume lookup.

Layout of a run directory::

    RUN_DIR/checkpoint.pt                 the final state (written when training ends)
    RUN_DIR/checkpoints/step-000040.pt    every train.save_every steps; the newest train.keep_checkpoints stay
    RUN_DIR/checkpoints/latest            the name of the newest step file (one line)

Every file is written to a temporary name in the same folder, flushed and fsynced, renamed over the target with
``os.replace`` (atomic on POSIX), and the folder is fsynced so that the rename itself survives a power cut. A
process killed mid-write leaves at worst a ``.*.tmp`` file, which is never read and is removed by the next save:
a good checkpoint is never replaced by a partial one. The ``latest`` pointer is written the same way, after the
file it names, so it never points at a file that is not complete.

What a checkpoint holds is assembled by :meth:`palestra.engine.trainer.Trainer.state_dict`; this module only moves
bytes and RNG states.
"""

from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from palestra.types import FileLogger

__all__ = [
    "CHECKPOINT_DIR",
    "FINAL_NAME",
    "capture_rng",
    "find_resume_checkpoint",
    "list_step_checkpoints",
    "restore_rng",
    "save_step_checkpoint",
    "write_atomic",
]

FINAL_NAME = "checkpoint.pt"
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


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


def write_atomic(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``target``, then fsync and rename it over ``target``.

    If ``write`` raises (or the process dies) ``target`` keeps its previous content; the temporary file is removed
    on an exception and ignored by readers otherwise.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def save_torch(state: Any, target: str | Path) -> Path:
    """``torch.save(state)`` to ``target`` atomically."""
    return write_atomic(target, lambda tmp: torch.save(state, tmp))


def step_name(step: int) -> str:
    return f"step-{step:06d}.pt"


def list_step_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete step checkpoint in ``RUN_DIR/checkpoints``, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _STEP_FILE.match(p.name)
        if m and p.is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_step_checkpoint(run_dir: str | Path, state: Any, step: int, keep: int) -> Path:
    """Write ``checkpoints/step-NNNNNN.pt``, point ``latest`` at it, keep the newest ``keep`` and clear stale temporaries."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    path = save_torch(state, folder / step_name(step))
    write_atomic(folder / LATEST, lambda tmp: tmp.write_text(path.name + "\n", encoding="utf-8"))
    for _, old in list_step_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    for stale in folder.glob(".*.tmp"):  # left by a process killed mid-write (ours is already renamed)
        stale.unlink(missing_ok=True)
    return path


def _peek_step(path: Path) -> int:
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return int(state["step"])


def find_resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint ``--resume RUN_DIR`` continues from: the newest of ``checkpoints/latest`` (or the newest step
    file) and ``checkpoint.pt``, by step. Raises a one-line FileNotFoundError when the run has none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume: run directory {str(run_dir)!r} does not exist")
    candidates: list[Path] = []
    latest = run_dir / CHECKPOINT_DIR / LATEST
    named = run_dir / CHECKPOINT_DIR / latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
    if named is not None and named.is_file():
        candidates.append(named)
    elif steps := list_step_checkpoints(run_dir):
        candidates.append(steps[-1][1])
    if (run_dir / FINAL_NAME).is_file():
        candidates.append(run_dir / FINAL_NAME)
    if not candidates:
        raise FileNotFoundError(
            f"--resume: {str(run_dir)!r} holds no checkpoint ({FINAL_NAME} or {CHECKPOINT_DIR}/step-*.pt); "
            "set train.save_every to write them during training"
        )
    return max(candidates, key=_peek_step) if len(candidates) > 1 else candidates[0]


# ---- random number generators ------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """This process's global RNG states: python ``random``, torch CPU, every CUDA device (if initialised), numpy (if imported)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Undo :func:`capture_rng` (entries this process cannot use, such as CUDA on a CPU machine, are skipped)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def log_sizes(loggers: list[Any], run_dir: Path) -> dict[str, int]:
    """Size in bytes of each file-backed logger's file (the jsonl logger's ``path``), keyed by path relative to the run."""
    out: dict[str, int] = {}
    for logger in loggers:
        path = logger.path if isinstance(logger, FileLogger) else None
        if isinstance(path, Path) and path.is_file():
            try:
                out[str(path.relative_to(run_dir))] = path.stat().st_size
            except ValueError:
                continue
    return out


def truncate_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Cut each logged file back to its size at the checkpoint: lines a killed run wrote after it are dropped,
    and the resumed run writes them again (no step appears twice in metrics.jsonl)."""
    for rel, size in sizes.items():
        path = run_dir / rel
        if path.is_file() and path.stat().st_size > size:
            with open(path, "r+b") as f:
                f.truncate(size)
