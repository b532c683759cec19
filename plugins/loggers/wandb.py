"""The ``wandb`` logger: Weights & Biases, offline by default.

``mode: offline`` (the default) writes the run under ``<run_dir>/wandb/offline-run-*`` and touches no
network and no login; upload it later with ``wandb sync <run_dir>/wandb/offline-run-*``. ``mode: online``
streams to the server and needs credentials already set up (``wandb login`` or ``WANDB_API_KEY``).
Needs the ``wandb`` package (the ``palestra[wandb]`` extra); without it ``palestra plugins --all`` lists the logger as
unavailable, and a config naming it fails before any model is loaded, with a one-line error that says how to install it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from palestra import hookimpl
from palestra.config import OptionError, check_options
from palestra.registry import MissingDependency, Requires

INSTALL_HINT = 'pip install "palestra[wandb]"'

# Settings that keep an offline run quiet and self-contained: no console capture, no system-metrics sampler
# thread, no git or pip inspection. Only those the installed wandb knows are passed (names changed over releases).
_QUIET_SETTINGS = {
    "silent": True,
    "console": "off",
    "x_disable_stats": True,
    "disable_git": True,
    "save_code": False,
    "x_save_requirements": False,
    "x_disable_machine_info": True,
}


class WandbInitError(RuntimeError):
    """wandb.init failed (credentials, server); one line for the command line."""

    palestra_user_error = True


@dataclass
class WandbOptions:
    project: str = "palestra"
    name: str | None = None  # the run's display name; default: the run directory's name
    mode: Literal["offline", "online", "disabled"] = "offline"
    entity: str | None = None  # team or user (online mode)
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.project.strip():
            raise OptionError("project", "must be a project name such as 'palestra', got an empty string")


class WandbLogger:
    """Logs metrics with ``wandb.log(metrics, step=step)``; the resolved config is the run's config."""

    def __init__(self, **options: Any) -> None:
        self.options: WandbOptions = check_options(WandbOptions, options, where="wandb")
        try:  # imported here so a missing package is reported when the logger is built, not at the first log
            import wandb
        except ImportError as e:  # installed, but fails to import (a missing dependency of its own)
            raise MissingDependency("the wandb logger", "wandb", INSTALL_HINT, cause=e) from None
        self._wandb = wandb
        self.run: Any = None

    def open(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        o = self.options
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = self._wandb.init(
                project=o.project,
                name=o.name or run_dir.name,
                mode=o.mode,
                entity=o.entity,
                group=o.group,
                tags=list(o.tags) or None,
                dir=str(run_dir),
                config=dict(config),
                settings=self._settings(),
            )
        except Exception as e:  # wandb's errors span lines (retry logs, hints); the first says what went wrong
            first = (str(e).strip().splitlines() or [""])[0]
            hint = (
                " (online mode needs `wandb login` or WANDB_API_KEY "
                "and a reachable server; mode: offline needs neither)"
                if o.mode == "online"
                else ""
            )
            raise WandbInitError(
                f"wandb logger: wandb.init(mode={o.mode!r}) failed: {type(e).__name__}: {first}{hint}"
            ) from e

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.run is None:
            raise RuntimeError("wandb logger: log() was called before open() (or after close())")
        # wandb keeps NaN/inf as they are and accepts numbers of any kind; a copy, since it may add keys.
        self.run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def _settings(self) -> Any:
        known = getattr(self._wandb.Settings, "model_fields", None)
        wanted: dict[str, Any] = {
            k: v
            for k, v in _QUIET_SETTINGS.items()
            if (known is None and k in ("silent", "console")) or (known is not None and k in known)
        }
        return self._wandb.Settings(**wanted)


@hookimpl
def register_loggers(register: Any) -> None:
    register(
        "wandb",
        Requires(WandbLogger, module="wandb", install=INSTALL_HINT),
        options=WandbOptions,
        description="Weights & Biases (offline by default: files under <run_dir>/wandb, no network)",
    )
