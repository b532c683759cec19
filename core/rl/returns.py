"""From sequence rewards to what the advantage estimators take: token rewards, KL shaping, group structure."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from palestra.rl.kl import kl_divergence

if TYPE_CHECKING:
    from palestra.types import Experience

__all__ = ["group_size_of", "kl_shaped_rewards", "last_token_rewards"]


def group_size_of(group_ids: torch.Tensor, where: str) -> int:
    """The common size of the groups in ``group_ids`` [B]; each group's rows must be consecutive.

    Raises a one-line ValueError (prefixed with ``where``) when a group is split or sizes differ.
    """
    if group_ids.dim() != 1 or group_ids.numel() == 0:
        raise ValueError(f"{where}: batch.group_ids must have shape [B] with B >= 1, got {list(group_ids.shape)}")
    ids = group_ids.tolist()
    runs: list[int] = []
    seen: set[int] = set()
    for i, g in enumerate(ids):
        if i and g == ids[i - 1]:
            runs[-1] += 1
            continue
        if g in seen:
            raise ValueError(
                f"{where}: batch.group_ids {list(group_ids.shape)} must keep each group's rows consecutive; "
                f"group {g} appears again at row {i}"
            )
        seen.add(g)
        runs.append(1)
    if len(set(runs)) != 1:
        raise ValueError(
            f"{where}: groups in batch.group_ids {list(group_ids.shape)} must all have the same size "
            f"(train.group_size); got sizes {sorted(set(runs))}"
        )
    return runs[0]


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards ``[B, T]``: ``rewards[b]`` on row ``b``'s last real token, 0 elsewhere.

    A row without any real token gets nothing (it has no action to credit).
    """
    b, t = mask.shape
    positions = torch.arange(t, device=mask.device).expand(b, t)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)
    out = torch.zeros((b, t), dtype=torch.float32, device=mask.device)
    has = last >= 0
    rows = torch.arange(b, device=mask.device)[has]
    out[rows, last[has]] = rewards[has].to(torch.float32)
    return out


def kl_shaped_rewards(batch: Experience, kl_coef: float, estimator: str) -> torch.Tensor:
    """Token rewards ``[B, T]``: the sequence reward on the last real token, minus ``kl_coef`` times the
    per-token KL estimate of the behaviour policy to the reference (``batch.ref_logprobs``) when ``kl_coef > 0``."""
    rewards = last_token_rewards(batch.rewards, batch.completion_mask)
    if kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_shaped_rewards: kl_coef > 0 needs batch.ref_logprobs (a reference policy)")
        kl = kl_divergence(
            batch.behaviour_logprobs.float(), batch.ref_logprobs.float(), batch.completion_mask, estimator
        )
        rewards = rewards - kl_coef * kl
    return rewards
