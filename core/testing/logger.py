"""``check_logger``: the logger contract the trainer relies on, rule by rule.

The trainer calls ``open(run_dir, config)`` once with the run directory and the whole config as plain data,
``log(metrics, step)`` every ``train.log_every`` steps with float metrics (NaN and inf included: a diverging run
must still log), and ``close()`` when training ends, also after a failure (so possibly more than once).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from palestra.testing.components import Subject, subject
from palestra.testing.errors import Contract

__all__ = ["RULES", "check_logger"]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the logger from the options given",
    "open, log, close": "open(run_dir, config), a few log(metrics, step) calls and close() run without raising",
    "non-finite values": "log accepts NaN and infinite values",
    "empty metrics": "log accepts an empty metrics dict",
    "close is idempotent": "a second close() does nothing (the trainer closes after a failure too)",
    "writes under the run directory": (
        "nothing appears in the working directory; a file logger's path lies inside the run directory"
    ),
}

CONFIG: dict[str, Any] = {"run": {"name": "contract", "seed": 0}, "train": {"steps": 3, "log_every": 1}}


def check_logger(
    logger: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Check a registered logger (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule.

    ``run_dir`` is where it may write (default: a temporary folder, removed afterwards); ``config`` is the plain
    config ``open`` receives (default: a small one with ``train.steps``).
    """
    subj = subject("logger", logger, options, name=name)
    c = Contract("logger", subj.label, RULES)
    with contextlib.ExitStack() as stack:
        root = Path(run_dir) if run_dir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir = root / "cwd"  # the process's working directory during the check: it must stay empty
        workdir.mkdir(parents=True, exist_ok=True)
        with _working_directory(workdir):
            _check(subj, c, root / "run", dict(config or CONFIG))
        left = sorted(p.name for p in workdir.iterdir())
        c.require(not left, "log", "writes under the run directory", f"wrote {left} into the working directory")


def _check(subj: Subject, c: Contract, run: Path, config: dict[str, Any]) -> None:
    with c.calling("build", "builds from its options"):
        logger = subj.make()
    with c.calling("open", "open, log, close"):
        logger.open(run, config)
    path = getattr(logger, "path", None)
    if isinstance(path, (str, os.PathLike)):
        inside = Path(path).resolve().is_relative_to(run.resolve())
        c.require(
            inside, "open", "writes under the run directory", f"its path {str(path)!r} is outside the run directory"
        )
    with c.calling("log", "open, log, close"):
        logger.log({"reward/mean": 0.5, "loss": 1.25, "lr": 0.001}, 1)
        logger.log({"reward/mean": 0.75, "loss": 0.5, "lr": 0.001}, 2)
    with c.calling("log", "non-finite values"):
        logger.log({"reward/mean": float("nan"), "loss": float("inf"), "grad/norm": float("-inf")}, 3)
    with c.calling("log", "empty metrics"):
        logger.log({}, 3)
    with c.calling("close", "open, log, close"):
        logger.close()
    with c.calling("close", "close is idempotent"):
        logger.close()


@contextlib.contextmanager
def _working_directory(path: Path) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)
