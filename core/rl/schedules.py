"""Learning-rate schedules, as the multiplier ``torch.optim.lr_scheduler.LambdaLR`` takes."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["LR_SCHEDULES", "lr_factor"]

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier after ``s`` completed updates (LambdaLR's argument).

    Warm-up rises linearly ``1/w, 2/w, ..., 1`` over the first ``w`` updates (never a zero-lr step);
    then ``constant`` stays at 1, ``linear`` falls towards 0 at ``total_steps``, ``cosine`` follows half a
    cosine to 0 at ``total_steps``. Neither decay reaches 0 within ``total_steps`` updates.
    """

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (s - warmup_steps) / span)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r}; choose constant, linear or cosine")

    return factor
