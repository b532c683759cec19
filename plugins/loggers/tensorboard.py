"""The ``tensorboard`` logger: every metric as a scalar in ``<run_dir>/tensorboard`` (``tensorboard --logdir runs``).

It writes through ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package (the
``palestra[tensorboard]`` extra). Without it ``palestra plugins --all`` lists the logger as unavailable, and a config
naming it fails before any model is loaded, with a one-line error that says how to install it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palestra import hookimpl
from palestra.config import OptionError, check_options, option
from palestra.registry import MissingDependency, Requires

INSTALL_HINT = 'pip install "palestra[tensorboard]"'


@dataclass
class TensorBoardOptions:
    log_dir: str = option("tensorboard", path="run")  # relative to the run directory (or an absolute path)
    flush_secs: int = option(30, ge=1)  # how often the writer flushes pending events to disk

    def __post_init__(self) -> None:
        if not self.log_dir.strip():
            raise OptionError("log_dir", "must be a folder name such as 'tensorboard', got an empty string")


class TensorBoardLogger:
    """Scalars to TensorBoard event files; a metric's key is its tag, so 'reward/mean' is in the 'reward' section."""

    def __init__(self, **options: Any) -> None:
        self.options: TensorBoardOptions = check_options(TensorBoardOptions, options, where="tensorboard")
        try:  # imported here so a missing package is reported when the logger is built, not at the first log
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # installed, but torch cannot use it (too old a version, a missing dependency)
            raise MissingDependency("the tensorboard logger", "tensorboard", INSTALL_HINT, cause=e) from None
        self._writer_cls = SummaryWriter
        self._writer: Any = None
        self.log_dir: Path | None = None

    def open(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        self.log_dir = Path(run_dir) / self.options.log_dir  # an absolute log_dir replaces run_dir
        self._writer = self._writer_cls(log_dir=str(self.log_dir), flush_secs=self.options.flush_secs)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            raise RuntimeError("tensorboard logger: log() was called before open() (or after close())")
        for key, value in metrics.items():
            if isinstance(value, (str, bytes)) or value is None:
                continue  # TensorBoard scalars are numbers only
            if hasattr(value, "item"):
                value = value.item()  # a one-element tensor or a numpy scalar
            if not isinstance(value, numbers.Real):
                raise TypeError(f"tensorboard logger: metric {key!r} must be a number, got {type(value).__name__}")
            # NaN/inf are written as they are: TensorBoard shows them, and a diverging run should be visible.
            self._writer.add_scalar(key, float(value), global_step=int(step))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


@hookimpl
def register_loggers(register: Any) -> None:
    register(
        "tensorboard",
        Requires(TensorBoardLogger, module="tensorboard", install=INSTALL_HINT),
        options=TensorBoardOptions,
        description="scalars to TensorBoard event files in <run_dir>/tensorboard",
    )
