"""REINFORCE++ (Hu, 2025): token-level rewards, discounted returns whitened across the batch, clipped surrogate.

Token rewards are the sequence reward on the completion's last real token minus ``kl_coef`` times the
per-token KL estimate of the behaviour policy to a frozen reference (``kl_estimator``, k1 by default:
``log pi_old - log pi_ref``). The advantage of token ``t`` is the discounted reward-to-go
``G_t = r_t + gamma * G_{t+1}``, whitened over every valid token of the batch (global, not per group:
no critic and no group baseline), computed by ``palestra.kernels.discounted_returns(whiten=True)``.
Defaults follow OpenRLHF (``init_kl_coef=0.01``, ``gamma=1``, ``eps_clip=0.2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from palestra import Algorithm, AlgorithmOptions, Experience, hookimpl, option
from palestra.rl import KLEstimator


@dataclass
class ReinforcePPOptions(AlgorithmOptions):
    kl_coef: float = option(0.01, ge=0)  # per-token KL reward penalty; 0: no reference model
    kl_estimator: KLEstimator = "k1"
    gamma: float = option(1.0, ge=0, le=1)  # discount of the reward-to-go
    clip_eps: float = option(0.2, gt=0, lt=1)
    clip_eps_high: float | None = option(None, gt=0)  # None: clip_eps


class ReinforcePP(Algorithm):
    """REINFORCE++: KL-shaped token rewards, globally whitened returns, clipped surrogate."""

    name = "reinforce_pp"
    Options = ReinforcePPOptions
    options: ReinforcePPOptions

    @property
    def needs_reference(self) -> bool:
        return self.options.kl_coef > 0

    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import discounted_returns

        o = self.options
        from palestra.rl import kl_shaped_rewards

        rewards = kl_shaped_rewards(batch, o.kl_coef, o.kl_estimator)
        batch.advantages = discounted_returns(rewards, batch.completion_mask, o.gamma, whiten=True)
        return batch

    def loss(self, batch: Experience, scores: Any):
        return self.clipped_loss(batch, scores)


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "reinforce_pp",
        ReinforcePP,
        options=ReinforcePPOptions,
        description="REINFORCE++: KL-shaped token rewards, whitened discounted returns, clipped surrogate",
    )
