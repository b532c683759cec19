"""Masked statistics: the metric mean over valid tokens, the critic's explained variance, and how many prompt
groups tie (a training diagnostic)."""

from __future__ import annotations

import torch

__all__ = ["explained_variance", "group_tie_stats", "masked_mean"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over valid positions, detached, in ``x``'s float dtype (float32 for a bool ``x``); 0 when
    nothing is valid. How every per-token metric is reported, whatever the loss aggregation is."""
    if not x.is_floating_point():
        x = x.to(torch.float32)
    m = mask.to(x.dtype)
    return (x.detach() * m).sum() / m.sum().clamp(min=1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the valid positions, in float64 (population variances); 0 when
    ``Var(R)`` is 0 or nothing is valid. 1 is a perfect critic, 0 one no better than a constant."""
    r = returns[mask].double()
    v = values[mask].double()
    if r.numel() == 0:
        return 0.0
    var_r = r.var(unbiased=False)
    if float(var_r) <= 1e-12:
        return 0.0
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


def group_tie_stats(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tie_std: float,
) -> dict[str, float]:
    """How many prompt groups give the optimiser nothing, or noise, to learn from; ``{}`` when no group has 2 rows.

    A group's rewards *tie* when their (population) standard deviation is at most ``tie_std``; a *near tie* is
    a tie whose std is not exactly 0. Group-relative advantages divide by that std (``scale: group``), so a
    near tie turns reward differences the size of rounding into advantages of size ~1: a precursor of collapse.

    * ``tied_group_frac``: the fraction of groups (of 2 rows or more) that tie, exact or near;
    * ``near_tie_group_frac``: the fraction that tie nearly (std in ``(0, tie_std]``);
    * ``adv_abs_mean_near_tie``: the mean ``|advantage|`` over the valid tokens of near-tie groups' rows (a
      per-row advantage counts once per token, as the token-mean loss counts it); 0 when there is none.

    Groups are the distinct values of ``group_ids`` (their rows need not be consecutive); float64 throughout.
    """
    ids, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.detach().double()
    k = ids.numel()
    sums = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts.double()
    centred = r - mean[inverse]
    var = (
        torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, inverse, centred * centred) / counts.double()
    )
    std = var.sqrt()
    real = counts >= 2
    n = int(real.sum())
    if n == 0:
        return {}
    tied = real & (std <= tie_std)
    near = tied & (std > 0)
    rows = near[inverse]
    adv = advantages.detach().double()
    if adv.dim() == 1:
        adv = adv[:, None].expand(mask.shape)
    m = mask.bool() & rows[:, None]
    count = int(m.sum())
    adv_near = float(adv.abs()[m].sum() / count) if count else 0.0
    return {
        "tied_group_frac": int(tied.sum()) / n,
        "near_tie_group_frac": int(near.sum()) / n,
        "adv_abs_mean_near_tie": adv_near,
    }
