"""Built-in reward combinators: ``weighted_sum`` (a joint reward) and ``layered`` (a curriculum).

Their options hold nested reward nodes, built through the registry; see :mod:`palestra.rewards`.
"""

from __future__ import annotations

from typing import Any

from palestra import hookimpl
from palestra.rewards import Layered, LayeredOptions, WeightedSum, WeightedSumOptions


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "weighted_sum",
        WeightedSum,
        options=WeightedSumOptions,
        description="sum of weighted rewards; logs every term",
    )
    register(
        "layered",
        Layered,
        options=LayeredOptions,
        description="curriculum: each layer unlocks when the moving average of the one before passes its unlock_at",
    )
