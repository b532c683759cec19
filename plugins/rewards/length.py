"""``overlong``: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4), a length penalty in [-1, 0].

With ``L = max_length`` and ``C = cache``, a completion of length ``n`` scores

* ``0`` when ``n <= L - C``;
* ``((L - C) - n) / C`` when ``L - C < n <= L`` (linearly from 0 down to -1);
* ``-1`` when ``n > L``.

Add it to the task reward with a ``weighted_sum`` (see ``examples/dapo.yaml``). A reward sees text only (prompts,
completions and the environment's metadata), not token ids, so ``n`` is measured in characters (``unit: chars``,
the default) or whitespace-separated words (``unit: words``); set ``max_length`` and ``cache`` in that unit. The
paper's numbers are in tokens (``L = 20480``, ``C = 4096`` with a 16384-token answer budget plus the cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.config import OptionError, check_options, option

if TYPE_CHECKING:
    import torch


@dataclass
class OverlongOptions:
    max_length: int = option(20480, ge=1)  # L: from here on the score is -1
    cache: int = option(4096, ge=1)  # C: the soft zone's width; the penalty starts after L - C
    unit: Literal["chars", "words"] = "chars"  # how the completion's length is measured

    def __post_init__(self) -> None:
        if self.cache > self.max_length:
            raise OptionError("cache", f"must be <= max_length ({self.max_length}), got {self.cache}")


class OverlongReward:
    """0 up to ``max_length - cache``, then linearly down to -1 at ``max_length``, -1 beyond (a penalty)."""

    max_score = 0.0

    def __init__(self, **options: Any) -> None:
        self.options: OverlongOptions = check_options(OverlongOptions, options, where="overlong")

    def length(self, completion: str) -> int:
        return len(completion) if self.options.unit == "chars" else len(completion.split())

    def score(self, completion: str) -> float:
        o = self.options
        n = self.length(completion)
        free = o.max_length - o.cache
        if n <= free:
            return 0.0
        if n > o.max_length:
            return -1.0
        return (free - n) / o.cache

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        import torch

        return torch.tensor([self.score(c) for c in completions], dtype=torch.float32)


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "overlong",
        OverlongReward,
        options=OverlongOptions,
        description="DAPO's soft overlong punishment: 0, then linearly to -1 over the last `cache` of `max_length`",
    )
