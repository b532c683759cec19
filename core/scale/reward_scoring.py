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
    *,
    counted: int | None = None,
) -> tuple[RewardOutput, torch.Tensor]:
    """The reward's output on this rank's rows, and the scores of the global batch (every rank's rows, in rank
    order; this rank's own in one process), each rank's first ``counted`` rows only (None: all of them; a
    multi-agent credit plan puts the episodes' last turns first and the agents' own turns after them)."""
    import torch

    if not dist.enabled:
        out = reward(prompts, completions, metadata)
        return out, out.scores[:counted]
    parts = dist.all_gather_object((prompts, completions, metadata, counted))
    start = sum(len(p[1]) for p in parts[: dist.rank])
    rows = slice(start, start + len(completions))
    out = reward(*([x for p in parts for x in p[i]] for i in range(3)))
    firsts: list[int] = []
    offset = 0
    for p in parts:
        firsts += range(offset, offset + (len(p[1]) if p[3] is None else p[3]))
        offset += len(p[1])
    every = out.scores[torch.as_tensor(firsts, device=out.scores.device)]
    out.scores = out.scores[rows]
    out.components = {k: v[rows] for k, v in out.components.items()}
    return out, every
