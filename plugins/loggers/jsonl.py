"""The ``jsonl`` logger: one JSON object per ``log`` call, appended to ``<run_dir>/metrics.jsonl``.

Each line is ``{"step": int, "time": unix seconds, **metrics}`` and is flushed as soon as it is written, so a
run that crashes keeps everything it logged (at worst the last line is cut short, which
:func:`palestra.cli.dashboard.read_metrics` tolerates). JSON has no NaN or infinity: non-finite numbers are
written as ``null``. ``palestra plot RUN_DIR`` draws this file.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO, Any

from palestra import hookimpl
from palestra.config import OptionError, check_options

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


def _ends_mid_line(path: Path) -> bool:
    """True when ``path`` exists, is not empty and its last byte is not a newline."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


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
    """Appends metrics to ``<run_dir>/<filename>``; a resumed run continues the same file."""

    def __init__(self, **options: Any) -> None:
        self.options: JsonlOptions = check_options(JsonlOptions, options, where="jsonl")
        self.path: Path | None = None
        self._file: IO[str] | None = None

    def open(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        self.path = Path(run_dir) / self.options.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A crash can leave the last line cut short; start on a fresh line so the first new record stays readable.
        needs_newline = _ends_mid_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            raise RuntimeError("jsonl logger: log() was called before open() (or after close())")
        line = json.dumps(json_record(metrics, step, time.time()), allow_nan=False, ensure_ascii=False)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@hookimpl
def register_loggers(register: Any) -> None:
    register(
        "jsonl",
        JsonlLogger,
        options=JsonlOptions,
        description="append one JSON line of metrics per step to <run_dir>/metrics.jsonl",
    )
