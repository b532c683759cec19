"""The terms a policy loss adds to its policy-gradient term, as functions over tensors: the entropy bonus and the KL
penalty to a frozen reference, and the advantages rollout correction reweights.

Every algorithm's per-token loss is ``pg + [- entropy_coef * H] + [kl_coef * KL]``: :func:`entropy_and_kl` adds the
last two (and reports ``policy/entropy`` and, whenever there are reference log-probs, ``policy/kl``).
:func:`corrected_advantages` is how the learner applies rollout correction before an algorithm sees the batch (see
:mod:`palestra.rl.rollout_correction`): the importance weights are positive and detached and every policy-gradient
term is linear in the advantage (``min(r A, clip(r) A) w = min(r wA, clip(r) wA)``), so weighting the advantages
weights the policy-gradient term and leaves the entropy and KL terms alone.
"""

from __future__ import annotations

import torch

from palestra.rl.kl import kl_divergence
from palestra.rl.stats import masked_mean

__all__ = ["corrected_advantages", "entropy_and_kl"]


def entropy_and_kl(
    per_token: torch.Tensor,
    *,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``per_token - entropy_coef * entropy + kl_coef * KL(logprobs || ref_logprobs)`` and the detached metric tensors
    ``policy/entropy`` (when ``entropy`` is given) and ``policy/kl`` (when ``ref_logprobs`` is given).

    A term whose coefficient is 0 is not added at all (the sum is then bitwise ``per_token``). ``kl_coef > 0``
    without reference log-probs raises: the KL term would silently be 0.
    """
    metrics: dict[str, torch.Tensor] = {}
    if entropy is not None:
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * entropy
        metrics["policy/entropy"] = masked_mean(entropy, mask)
    if ref_logprobs is not None:
        kl = kl_divergence(logprobs, ref_logprobs.to(logprobs.dtype), mask, kl_estimator)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
        metrics["policy/kl"] = masked_mean(kl, mask)
    elif kl_coef > 0:
        raise ValueError(
            "entropy_and_kl: the KL term needs reference log-probs (batch.ref_logprobs); the learner "
            "scores them in prepare() when the algorithm says needs_reference"
        )
    return per_token, metrics


def corrected_advantages(advantages: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``advantages`` (``[B]`` per row or ``[B, T]``) times rollout correction's importance ``weights`` ``[B, T]``, as
    float32 ``[B, T]``; ``advantages`` unchanged when ``weights`` is None (no correction)."""
    if weights is None:
        return advantages
    adv = advantages
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(weights)
    return adv.to(torch.float32) * weights.detach()
