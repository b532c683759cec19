"""KL estimators from sampled tokens (Schulman, "Approximating KL divergence")."""

from __future__ import annotations

import torch

from palestra.rl.names import KL_ESTIMATORS

__all__ = ["kl_divergence"]

# exp() of a log-ratio beyond this overflows float32 long before it means anything; k3 clamps there.
MAX_LOG_RATIO = 20.0


def kl_divergence(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimates of KL(pi || pi_ref) from tokens sampled from pi.

    With ``log_r = ref_logp - logp``: ``k1 = -log_r`` (unbiased, high variance, can be negative),
    ``k2 = log_r**2 / 2`` (biased, low variance), ``k3 = exp(log_r) - 1 - log_r`` (unbiased, >= 0, low
    variance; ``log_r`` clamped to +-20 so that exp stays finite). Returns ``[B, T]``, 0 where ``mask`` is False.
    """
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"kl_divergence: logp {list(logp.shape)}, ref_logp {list(ref_logp.shape)} and mask "
            f"{list(mask.shape)} must have one shape"
        )
    log_r = ref_logp - logp
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        log_r = log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"kl_divergence: unknown estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    return torch.where(mask, kl, torch.zeros_like(kl))
