"""One writer per run folder: an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` for as long as a run trains.

Two ``palestra train`` processes writing one folder interleave their metrics and delete each other's checkpoints
and temporary files, so a run takes the lock before it reads or writes anything in its folder and keeps it until the
process ends. The kernel releases a ``flock`` when its holder dies, SIGKILL included, so a dead run never leaves a
stale lock behind: the file may stay, the lock does not. The file holds the holder's PID, so that a second writer
(a second start, a ``--resume`` of a live run, a second ``--overwrite``) is told which process to wait for.
Under torchrun only rank 0 writes the folder, so only rank 0 takes the lock.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
from pathlib import Path

__all__ = ["LOCK_NAME", "RunLock", "RunLocked", "left_by_dead", "pid_alive"]

LOCK_NAME = ".lock"


class RunLocked(ValueError):
    """Another live process holds the run folder's lock (or the lock file cannot be made): one line."""


def left_by_dead(folder: Path, prefix: str, suffix: str) -> list[Path]:
    """The entries of ``folder`` named ``PREFIX<pid>SUFFIX`` whose process is gone: what writers killed mid-write
    left (a live process's, another writer's or ours, are not listed; nor are links, which are never followed)."""
    found = []
    for entry in folder.glob(f"{glob.escape(prefix)}*{glob.escape(suffix)}"):
        pid = entry.name[len(prefix) : len(entry.name) - len(suffix)]
        if pid.isdigit() and not pid_alive(int(pid)) and not entry.is_symlink():
            found.append(entry)
    return found


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a process of another user counts: it is alive, just not ours)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The held lock on one run folder; :meth:`acquire` takes it or raises :class:`RunLocked`."""

    def __init__(self, run_dir: Path, fd: int, *, made: list[Path]) -> None:
        self.run_dir, self._fd, self._made = run_dir, fd, made

    @classmethod
    def acquire(cls, run_dir: str | Path, *, key: str | None = "run.name") -> RunLock:
        """Create ``run_dir`` if needed and lock it; ``key`` is the config key a refusal names as the way out
        (None for a resume, whose only way is to wait)."""
        run_dir = Path(run_dir)
        made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # the folders mkdir will make
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: a link planted as the lock file must not make us create or truncate a file elsewhere
            fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            why = "it is a link" if e.errno == errno.ELOOP else e.strerror
            raise RunLocked(f"{run_dir}: cannot lock the run folder ({why})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLocked(f"{run_dir}: cannot lock the run folder ({e.strerror})") from None
            raise RunLocked(_in_use(run_dir, holder, key)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(run_dir, fd, made=made)

    @staticmethod
    def check_free(run_dir: str | Path, *, key: str | None = "run.name") -> None:
        """Raise :class:`RunLocked` if a live process holds ``run_dir``'s lock; changes nothing in the folder (a
        refused start must leave it as it was, so this probes with a shared lock on the existing file)."""
        try:
            fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # no lock file (or not one to open): acquire() answers what is wrong with it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise RunLocked(_in_use(Path(run_dir), _read_pid(fd), key)) from None
        finally:
            os.close(fd)

    def release(self, *, tidy: bool = False) -> None:
        """Let the lock go (the process ending does the same). ``tidy``: a start that failed before writing
        anything removes the folders it made (the run folder, and output_dir when it was made too), so that it
        leaves nothing behind."""
        if self._fd < 0:
            return
        if tidy and self._made:
            try:
                if [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]:
                    (self.run_dir / LOCK_NAME).unlink()
                    for folder in self._made:  # innermost first; rmdir refuses one that is no longer empty
                        folder.rmdir()
            except OSError:
                pass  # someone else is using the folder now: leave it to them
        os.close(self._fd)
        self._fd = -1


def _in_use(run_dir: Path, holder: int | None, key: str | None) -> str:
    who = f"process {holder}" if holder is not None else "another process"
    other = f", or choose another {key}" if key is not None else ""
    return f"{run_dir} is in use by {who} (a palestra train writing this run); wait for it to end{other}"


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
