"""Scoring a batch with the reward across ranks, so that a stateful reward moves identically on every rank.

Under torchrun every rank scores the *global* batch (the rows of every rank, in rank order) and keeps its own
slice: a curriculum that unlocks a layer once a moving average is high enough then sees exactly what one process
would, on every rank, and the ranks' curricula never drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from palestra.scale.distributed import DistributedContext
    from palestra.types import RewardOutput

__all__ = ["score_global"]


def score_global(
    reward: Callable[[list[str], list[str], list[dict[str, Any]]], RewardOutput],
    dist: DistributedContext,
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
) -> tuple[RewardOutput, torch.Tensor]:
    """The reward's output on this rank's rows, and the scores of the global batch (every rank's rows, in rank
    order; this rank's own in one process)."""
    if not dist.enabled:
        out = reward(prompts, completions, metadata)
        return out, out.scores
    parts = dist.all_gather_object((prompts, completions, metadata))
    start = sum(len(p[1]) for p in parts[: dist.rank])
    rows = slice(start, start + len(completions))
    out = reward(*([x for p in parts for x in p[i]] for i in range(3)))
    every = out.scores
    out.scores = out.scores[rows]
    out.components = {k: v[rows] for k, v in out.components.items()}
    return out, every
