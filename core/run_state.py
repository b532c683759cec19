"""What a lifecycle hook sees of the run: a read-only :class:`RunState`, not the trainer.

A plugin observing training (a profiler, a fault injector, a custom logger) needs where the run is and what it
measured, never the components themselves: the trainer hands each hook a fresh, frozen snapshot, so nothing a
plugin does can change what the loop does next.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palestra.config import Config

__all__ = ["RunState"]


@dataclass(frozen=True)
class RunState:
    """The run as a lifecycle hook sees it.

    * ``step``: the steps completed so far (``on_step_start``: the 0-based index of the step about to run;
      ``on_optimizer_step``: the step just taken, counted from 1);
    * ``metrics``: the latest step's metrics (empty before the first step), a read-only mapping;
    * ``config``: the validated run config;
    * ``run_dir``: the run folder (logs, checkpoints);
    * ``rank``, ``world_size``: this process among the ranks of a torchrun job (0 and 1 in one process).
    """

    step: int
    config: Config
    run_dir: Path
    metrics: Mapping[str, float] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        # a copy behind a read-only view: the trainer's own dict stays the trainer's
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))
