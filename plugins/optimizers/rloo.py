"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al., "Back to Basics", 2024).

Each completion's advantage is its reward minus the mean reward of the *other* completions of the same
prompt (``palestra.kernels.rloo_advantages``; needs ``train.group_size >= 2``). The KL to a frozen
reference is a reward penalty, as in TRL's RLOO: the sequence reward becomes
``reward - kl_coef * sum_t KL_t`` (``kl_estimator`` per token, k1 by default, i.e. the sequence's
log-ratio of behaviour to reference) before the baseline is taken. The loss is the clipped PPO surrogate
against the behaviour log-probs; with one pass over fresh samples the ratio is 1 and this is exactly
the REINFORCE gradient, and with ``train.updates_per_batch > 1`` the clip keeps later passes close.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import Algorithm, AlgorithmOptions, Experience, hookimpl, option
from palestra.rl import KLEstimator

if TYPE_CHECKING:
    import torch


@dataclass
class RLOOOptions(AlgorithmOptions):
    kl_coef: float = option(0.05, ge=0)  # KL reward penalty; 0: no reference model
    kl_estimator: KLEstimator = "k1"  # per-token estimator summed over each completion
    clip_eps: float = option(0.2, gt=0, lt=1)
    clip_eps_high: float | None = option(None, gt=0)  # None: clip_eps
    normalize_advantages: bool = False  # whiten the advantages across the batch (mean 0, std 1)


class RLOO(Algorithm):
    """Leave-one-out baseline, KL as a reward penalty, clipped surrogate."""

    name = "rloo"
    Options = RLOOOptions
    options: RLOOOptions

    @property
    def needs_reference(self) -> bool:
        return self.options.kl_coef > 0

    def sequence_rewards(self, batch: Experience) -> torch.Tensor:
        """``rewards - kl_coef * sum_t KL_t`` (float32 [B]); the plain rewards without a reference."""
        from palestra.rl import kl_divergence

        rewards = batch.rewards.float()
        if self.options.kl_coef > 0:
            kl = kl_divergence(
                batch.behaviour_logprobs.float(),
                batch.ref_logprobs.float(),
                batch.completion_mask,
                self.options.kl_estimator,
            )
            rewards = rewards - self.options.kl_coef * kl.sum(-1)
        return rewards

    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import rloo_advantages
        from palestra.rl import group_size_of

        g = group_size_of(batch.group_ids, self.name)
        if g < 2:
            raise ValueError(
                f"{self.name}: the leave-one-out baseline needs at least 2 completions per prompt "
                f"(train.group_size >= 2); batch.group_ids {list(batch.group_ids.shape)} has groups of {g}"
            )
        adv = rloo_advantages(self.sequence_rewards(batch), g)
        if self.options.normalize_advantages and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        batch.advantages = adv
        return batch

    def loss(self, batch: Experience, scores: Any):
        return self.clipped_loss(batch, scores)


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "rloo",
        RLOO,
        options=RLOOOptions,
        description="RLOO: leave-one-out baseline, KL reward penalty, clipped surrogate",
    )
