"""Masked statistics: the metric mean over valid tokens, and the critic's explained variance."""

from __future__ import annotations

import torch

__all__ = ["explained_variance", "masked_mean"]


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
