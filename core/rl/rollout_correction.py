"""Rollout correction: when the behaviour log-probs did not come from the learner itself.

The tokens of a batch were sampled by a *behaviour* policy ``mu`` (``batch.behaviour_logprobs``): the KV-cache
sampler today, another engine (vLLM, bf16 sampling while the learner is fp32) tomorrow. Even with identical
weights the two disagree a little, and on rare tokens a lot. The learner's own log-probs of the same tokens before
the update, ``pi_old``, are the *proximal* policy: the PPO ratio is taken against them, and an importance weight
``rho = pi_old / mu`` (detached) corrects for the sampler (decoupled PPO; Liu, Li et al. 2025, "When speed kills
stability"; verl's rollout correction, TRL's ``vllm_importance_sampling_*``):

* ``level="token"``: ``rho_t = exp(log pi_old_t - log mu_t)``, one weight per token;
* ``level="sequence"``: ``rho = exp(sum_t (log pi_old_t - log mu_t))``, one weight for all of a row's tokens
  (unbiased for the sequence, higher variance);
* ``mode="truncate"`` (truncated IS, TIS): ``w = min(rho, threshold)``;
* ``mode="mask"`` (masked IS): ``w = rho`` when ``mask_low <= rho <= threshold``, else 0: the token (row) is
  rejected, its policy-gradient term dropped.

The weights are computed in log space (``min(s, log C)`` before ``exp``), so a sequence ratio of a long row
never overflows. :func:`rollout_mismatch` also measures the gap, whatever the option: how far the sampler's
log-probs are from the learner's. This module imports torch only inside its functions, so that the options
dataclass stays cheap to import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from palestra.config import OptionError, option

if TYPE_CHECKING:
    import torch

__all__ = ["RolloutCorrectionOptions", "rollout_mismatch"]


@dataclass
class RolloutCorrectionOptions:
    """``<algorithm>.options.rollout_correction``: importance weights for behaviour log-probs from another engine."""

    level: Literal["token", "sequence"] | None = None  # None: no correction (the gap is still measured)
    mode: Literal["truncate", "mask"] = "truncate"  # truncate: w = min(rho, threshold); mask: w = 0 outside the band
    threshold: float = option(2.0, ge=1)  # truncate: the cap C; mask: the band's upper end
    mask_low: float | None = option(None, ge=0)  # mask: the band's lower end; None: 1 / threshold

    def __post_init__(self) -> None:
        if self.mask_low is not None:
            if self.mode != "mask":
                raise OptionError("mask_low", f"only mode 'mask' uses a lower bound; got mode {self.mode!r}")
            if self.mask_low >= self.threshold:
                raise OptionError("mask_low", f"must be below threshold ({self.threshold}), got {self.mask_low}")

    @property
    def enabled(self) -> bool:
        return self.level is not None

    @property
    def low(self) -> float:
        """The lower end of the mask band."""
        return self.mask_low if self.mask_low is not None else 1.0 / self.threshold


def rollout_mismatch(
    learner_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    options: RolloutCorrectionOptions | None = None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Importance weights ``[B, T]`` (None without correction) and metric tensors, all detached.

    ``learner_logp`` are the learner's pre-update log-probs of the sampled tokens, ``behaviour_logp`` the
    sampler's, ``mask`` the valid tokens (weights are 0 elsewhere). Metrics, over valid tokens:

    * ``logp_gap_mean`` / ``logp_gap_max``: the mean and the largest ``|log pi_old - log mu|``;
    * ``kl``: the k3 estimate ``E_mu[rho - 1 - log rho]`` of KL(mu || pi_old) from mu's own samples (>= 0);

    and with a correction on:

    * ``is_weight_mean``: the mean weight applied (0 for a rejected token);
    * ``truncated_frac``: the fraction of tokens whose ratio was capped (``truncate``);
    * ``masked_frac``: the fraction of tokens rejected (``mask``; a rejected row counts all its tokens).
    """
    import torch

    from palestra.rl.kl import MAX_LOG_RATIO
    from palestra.rl.stats import masked_mean

    m = mask.detach().bool()
    lp = learner_logp.detach().float()
    log_rho = torch.where(m, lp - behaviour_logp.detach().float(), torch.zeros_like(lp))
    gap = log_rho.abs()
    clamped = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # exp stays finite: the metric, not the weights
    metrics = {
        "logp_gap_mean": masked_mean(gap, m),
        "logp_gap_max": gap.amax() if gap.numel() else torch.zeros((), device=gap.device),
        "kl": masked_mean(torch.expm1(clamped) - clamped, m),
    }
    if options is None or not options.enabled:
        return None, metrics
    s = log_rho if options.level == "token" else log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    log_cap = math.log(options.threshold)
    zero = torch.zeros_like(s)
    if options.mode == "truncate":
        capped = s > log_cap
        weights = torch.exp(s.clamp(max=log_cap))
        rejected = torch.zeros_like(m)
    else:
        log_low = math.log(options.low) if options.low > 0 else -math.inf
        rejected = (s < log_low) | (s > log_cap)
        weights = torch.where(rejected, zero, torch.exp(s.clamp(max=log_cap)))
        capped = torch.zeros_like(m)
    weights = torch.where(m, weights, zero)
    metrics["is_weight_mean"] = masked_mean(weights, m)
    metrics["truncated_frac"] = masked_mean(capped & m, m)
    metrics["masked_frac"] = masked_mean(rejected & m, m)
    return weights, metrics
