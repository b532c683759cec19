"""Opening and deleting files in a run folder without ever following a link out of it.

A run folder belongs to one run, and whoever can write into it (a copied folder, a shared disk, a forged checkpoint)
must not be able to make Palestra open, truncate or delete a file elsewhere. Palestra never makes a link in a run
folder, so a link there is refused, and every open below the folder goes component by component with ``O_NOFOLLOW``
(``openat`` on the directory opened just before): the check is the open itself, so nothing can be swapped in
between a check and the use. The run folder itself is the user's word (``run.output_dir/run.name`` or
``--resume DIR``) and may be reached through a link; only what is inside it is held to this rule.

This module depends on nothing else in Palestra, so the loggers (``palestra.plugins.loggers``) use it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePath

__all__ = [
    "RunFolderLink",
    "find_links",
    "link_message",
    "lstat_in",
    "open_in",
    "plain_relative",
    "remove_file",
    "unlink_entry",
    "walk_names",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RunFolderLink(ValueError):
    """A link inside a run folder, where Palestra was about to read, write or delete: refused, in one line."""

    palestra_user_error = True


def link_message(path: Path) -> str:
    """The one line for a link at ``path`` (its target shown, cut to 80 characters)."""
    try:
        target = os.readlink(path)
        shown = f" (to {target[:77] + '...' if len(target) > 80 else target})"
    except OSError:
        shown = ""
    return f"{path} is a link{shown}; Palestra never follows a link in a run folder: remove it and run again"


def plain_relative(name: object) -> bool:
    """Whether ``name`` is a plain relative path inside a folder: a non-empty string, not absolute, no ``..`` or
    ``.`` part, no NUL, no empty part (``a//b``), no trailing slash."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name or name.startswith("/"):
        return False
    parts = name.split("/")
    return all(part not in ("", ".", "..") for part in parts)


def _parts(rel: str | PurePath) -> list[str]:
    text = str(rel)
    if not plain_relative(text):
        raise ValueError(f"{text!r} is not a plain path inside the run folder")
    return text.split("/")


def _open_dirs(run_dir: Path, parts: list[str], *, make: bool) -> int:
    """A descriptor of the folder holding ``parts[-1]``, reached without following a link (made when ``make``)."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts[:-1]):
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                _raise_if_link(e, run_dir.joinpath(*parts[: i + 1]))
                raise
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _raise_if_link(e: OSError, path: Path) -> None:
    # O_NOFOLLOW answers a link with ELOOP (ENOTDIR with O_DIRECTORY on some systems): say it is a link
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and path.is_symlink():
        raise RunFolderLink(link_message(path)) from None


def open_in(run_dir: str | Path, rel: str | PurePath, flags: int, mode: int = 0o644, *, make_dirs: bool = False) -> int:
    """``os.open`` of ``run_dir/rel`` with ``O_NOFOLLOW`` at every part below ``run_dir`` (a link raises
    :class:`RunFolderLink`); ``make_dirs`` makes the missing folders on the way, inside the run folder."""
    run_dir, parts = Path(run_dir), _parts(rel)
    folder = _open_dirs(run_dir, parts, make=make_dirs)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
    except OSError as e:
        _raise_if_link(e, run_dir.joinpath(*parts))
        raise
    finally:
        os.close(folder)


def lstat_in(run_dir: str | Path, rel: str | PurePath) -> os.stat_result | None:
    """``lstat`` of ``run_dir/rel`` reached without following a link (None when it does not exist); a link on the
    way raises :class:`RunFolderLink`."""
    run_dir, parts = Path(run_dir), _parts(rel)
    try:
        folder = _open_dirs(run_dir, parts, make=False)
    except FileNotFoundError:
        return None
    try:
        return os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(folder)


def remove_file(run_dir: str | Path, rel: str | PurePath) -> bool:
    """Delete ``run_dir/rel`` if it is a regular file reached without a link (a link, a folder or anything else is
    left alone); whether it was deleted."""
    run_dir, parts = Path(run_dir), _parts(rel)
    try:
        folder = _open_dirs(run_dir, parts, make=False)
    except (FileNotFoundError, NotADirectoryError, RunFolderLink):
        return False
    try:
        st = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(parts[-1], dir_fd=folder)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(folder)


def walk_names(folder: str | Path) -> Iterator[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of each entry of ``folder``, when ``folder`` is itself a folder and not a link (else
    nothing): what may be deleted in it is decided by name and kind, never through a link."""
    try:
        fd = os.open(folder, _DIR_FLAGS)
    except OSError:
        return
    try:
        for name in sorted(os.listdir(fd)):
            try:
                yield name, os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
    finally:
        os.close(fd)


def unlink_entry(folder: str | Path, name: str) -> None:
    """Delete the entry ``name`` of ``folder`` (a link itself, never its target), through a descriptor of the folder
    opened without following a link: a folder swapped for a link meanwhile is not deleted through."""
    fd = os.open(folder, _DIR_FLAGS)
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def find_links(run_dir: str | Path, folders: tuple[str, ...] = ()) -> list[Path]:
    """The links directly in ``run_dir`` and in its sub-folders ``folders`` (each only when it is a real folder)."""
    run_dir = Path(run_dir)
    found = [run_dir / name for name, st in walk_names(run_dir) if stat.S_ISLNK(st.st_mode)]
    for sub in folders:
        found += [run_dir / sub / name for name, st in walk_names(run_dir / sub) if stat.S_ISLNK(st.st_mode)]
    return found
