"""The ``jsonl`` logger: one JSON object per ``log`` call, appended to ``<run_dir>/metrics.jsonl``.

Each line is ``{"step": int, "time": unix seconds, **metrics}`` and is flushed as soon as it is written, so a
run that crashes keeps everything it logged (at worst the last line is cut short, which
:func:`palestra.cli.dashboard.read_metrics` tolerates). JSON has no NaN or infinity: non-finite numbers are
written as ``null``. ``palestra plot RUN_DIR`` draws this file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import numbers
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from palestra import hookimpl
from palestra.config import OptionError, check_options
from palestra.engine.run_folder import open_in

RESERVED_KEYS = ("step", "time")  # the columns every line starts with


def scalar_value(key: str, value: Any) -> float | int | bool | str | None:
    """``value`` as a JSON-ready scalar: ints, bools and strings as they are, other numbers as float, NaN/inf as None.

    Accepts anything with ``.item()`` (a one-element tensor or a numpy scalar) so a stray tensor does not
    break logging; anything else is a bug in whoever produced the metric, reported with its name.
    """
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"metric {key!r} must be a scalar, got {type(value).__name__} {getattr(value, 'shape', '')}".rstrip()
            ) from None
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def json_record(metrics: Mapping[str, Any], step: int, wall_time: float) -> dict[str, Any]:
    """The object one line holds: step and time first, then the metrics in the order they were given."""
    record: dict[str, Any] = {"step": int(step), "time": wall_time}
    for key, value in metrics.items():
        if key in RESERVED_KEYS:
            raise ValueError(
                f"metric name {key!r} is reserved by the jsonl logger (every "
                f"line has {' and '.join(RESERVED_KEYS)}); rename the metric"
            )
        record[str(key)] = scalar_value(key, value)
    return record


def _ends_mid_line(fd: int) -> bool:
    """True when the open file ``fd`` is not empty and its last byte is not a newline."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


class LogWriteError(OSError):
    """The log file could not be written (a full disk, say): one line naming the file; what was logged is kept."""

    palestra_user_error = True


@dataclass
class JsonlOptions:
    filename: str = "metrics.jsonl"  # relative to the run directory

    def __post_init__(self) -> None:
        path = PurePath(self.filename)
        if not self.filename or path.is_absolute() or ".." in path.parts or self.filename.endswith(("/", "\\")):
            raise OptionError(
                "filename",
                f"must be a file name inside the run directory such as 'metrics.jsonl', got {self.filename!r}",
            )


class JsonlLogger:
    """Appends metrics to ``<run_dir>/<filename>``; a resumed run continues the same file.

    The file is opened without following a link at any part below the run folder (a link there is refused in one
    line: a run never writes outside its folder), and each line is one unbuffered ``write``: nothing waits in a
    buffer for ``close``, and a full disk is one line naming the file, raised by the ``log`` that met it.
    """

    def __init__(self, **options: Any) -> None:
        self.options: JsonlOptions = check_options(JsonlOptions, options, where="jsonl")
        self.path: Path | None = None
        self._fd: int | None = None

    def open(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        self.path = Path(run_dir) / self.options.filename
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK  # O_NONBLOCK: a FIFO planted there never hangs
        try:
            # The run folder itself may not exist yet (a logger opened outside palestra train): make it, then open
            # inside it without following any link.
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            fd = open_in(run_dir, PurePath(self.options.filename).as_posix(), flags, make_dirs=True)
        except OSError as e:
            raise LogWriteError(f"jsonl logger: cannot open {self.path}: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LogWriteError(f"jsonl logger: {self.path} is not a regular file; remove it and run again")
        self._fd = fd
        # A crash can leave the last line cut short; start on a fresh line so the first new record stays readable.
        if _ends_mid_line(fd):
            self._write(b"\n", None)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._fd is None:
            raise RuntimeError("jsonl logger: log() was called before open() (or after close())")
        line = json.dumps(json_record(metrics, step, time.time()), allow_nan=False, ensure_ascii=False)
        self._write((line + "\n").encode("utf-8"), step)

    def _write(self, data: bytes, step: int | None) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            what = f"step {step}'s metrics" if step is not None else "a newline"
            kept = "the lines before it are kept" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "nothing more"
            raise LogWriteError(
                f"jsonl logger: writing {what} to {self.path} failed: {(e.strerror or str(e)).lower()}; {kept}"
            ) from None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):  # every line was written (or reported) by its own write
                os.close(fd)


@hookimpl
def register_loggers(register: Any) -> None:
    register(
        "jsonl",
        JsonlLogger,
        options=JsonlOptions,
        description="append one JSON line of metrics per step to <run_dir>/metrics.jsonl",
    )
