"""PPO for language models (Schulman et al. 2017; Ouyang et al. 2022), with a value head on the policy.

Per token: the reward is the sequence reward on the completion's last real token, minus ``kl_coef``
times the KL estimate of the behaviour policy to a frozen reference (k1 by default, as TRL's PPO);
advantages and value targets come from GAE (``palestra.kernels.gae`` with ``gamma``, ``lam``) over the
values the policy's value head gave at rollout time (``batch.old_values``, which the learner scores before
``advantages`` for an algorithm that ``needs_value_head``);
advantages are whitened over the batch's valid tokens. The loss is the clipped surrogate, plus
``vf_coef`` times the clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
``V_clip = V_old + clip(V - V_old, -clip_value, clip_value)``, minus the entropy bonus (both from
:mod:`palestra.rl`).

Defaults follow TRL's ``PPOConfig`` (``gamma=1``, ``lam=0.95``, ``cliprange=0.2``,
``cliprange_value=0.2``, ``vf_coef=0.1``, ``kl_coef=0.05``, ``whiten_advantages``).

``value/explained_var`` is ``1 - Var(R - V_old) / Var(R)`` over the batch's valid tokens at rollout time
(0 when the returns do not vary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from palestra import Algorithm, AlgorithmOptions, Experience, hookimpl, option
from palestra.rl import KLEstimator


@dataclass
class PPOOptions(AlgorithmOptions):
    kl_coef: float = option(0.05, ge=0)  # per-token KL reward penalty; 0: no reference model
    kl_estimator: KLEstimator = "k1"
    gamma: float = option(1.0, ge=0, le=1)
    lam: float = option(0.95, ge=0, le=1)  # GAE lambda
    clip_eps: float = option(0.2, gt=0, lt=1)
    clip_eps_high: float | None = option(None, gt=0)  # None: clip_eps
    clip_value: float | None = option(0.2, gt=0)  # value clipping around the rollout values; None: no clipping
    vf_coef: float = option(0.1, ge=0)  # weight of the value loss
    whiten_advantages: bool = True


class PPO(Algorithm):
    """Clipped surrogate + clipped value loss, GAE advantages, KL-shaped token rewards."""

    name = "ppo"
    Options = PPOOptions
    options: PPOOptions
    needs_value_head = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.explained_var = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.options.kl_coef > 0

    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import gae
        from palestra.kernels.advantages import masked_whiten
        from palestra.rl import explained_variance, kl_shaped_rewards

        o = self.options
        mask = batch.completion_mask
        old_values = batch.old_values
        if old_values is None:
            raise ValueError(f"{self.name}: batch.old_values are missing; the learner's prepare() scores them")
        rewards = kl_shaped_rewards(batch, o.kl_coef, o.kl_estimator)
        adv, returns = gae(rewards, old_values, mask, o.gamma, o.lam)
        if o.whiten_advantages:
            adv = masked_whiten(adv, mask)
        batch.advantages, batch.returns, batch.old_values = adv, returns, old_values
        self.explained_var = explained_variance(old_values, returns, mask)
        return batch

    def loss(self, batch: Experience, scores: Any):
        from palestra.rl import value_loss as rl_value_loss

        o = self.options
        if batch.returns is None or batch.old_values is None:
            raise ValueError(f"{self.name}: batch.returns and batch.old_values are missing; run prepare() first")
        per_token, metrics = self.surrogate_terms(
            batch,
            scores,
            clip_low=o.clip_eps,
            clip_high=o.clip_eps_high if o.clip_eps_high is not None else o.clip_eps,
            kl_estimator=o.kl_estimator,
        )
        mask = batch.completion_mask
        value_loss, _ = rl_value_loss(scores.values, batch.old_values, batch.returns, mask, o.clip_value)
        metrics["value/loss"] = self.metric_mean(value_loss, mask)
        per_token = per_token + o.vf_coef * value_loss
        return self.aggregate(per_token, mask), metrics

    def update_metrics(self) -> dict[str, float]:
        return {"value/explained_var": self.explained_var}


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "ppo",
        PPO,
        options=PPOOptions,
        description="PPO: value head, GAE, clipped surrogate and value loss, KL-shaped rewards",
    )
