"""GRPO (Shao et al., DeepSeekMath) and Dr.GRPO (Liu et al., "Understanding R1-Zero-like training").

Advantages are group-relative: each completion's reward minus the mean of its prompt's group
(``palestra.kernels.group_advantages``), divided by the group's std for GRPO (``scale="group"``) and
not scaled for Dr.GRPO; so both need ``train.group_size >= 2`` (checked at setup). The loss is the
clipped PPO surrogate per token against the behaviour log-probs, plus ``beta`` times the k3 KL
estimate to a frozen reference when ``beta > 0``.

Defaults follow TRL's ``GRPOConfig``: ``beta=0`` (no reference model), ``clip_eps=0.2``,
``scale="group"``, and token-level aggregation over the whole batch (TRL's default ``"dapo"``; ours is
``loss_agg="token_mean"``). ``dr_grpo`` is the same algorithm with ``scale="none"`` and
``loss_agg="seq_mean_token_sum_norm"`` (each row's token sum divided by ``train.max_new_tokens``).

DAPO, GSPO and CISPO build on :class:`GRPO` (its advantages, a different loss): ``grpo_family.py`` next to this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from palestra import Algorithm, Experience, ReplayOptions, hookimpl, option
from palestra.rl import KLEstimator, LossAgg


@dataclass
class GRPOOptions(ReplayOptions):
    beta: float = option(0.0, ge=0)  # KL coefficient to the frozen reference; 0: no reference model
    kl_estimator: KLEstimator = "k3"  # Schulman's estimator for the KL term (k3: unbiased, >= 0)
    clip_eps: float = option(0.2, gt=0, lt=1)  # ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float | None = option(None, gt=0)  # None: clip_eps (DAPO's clip-higher uses 0.28)
    scale: Literal["group", "batch", "none"] = "group"  # divide centred rewards by the group's / batch's std, or not
    std_eps: float = option(1e-4, gt=0)  # added to the std (a group of equal rewards gives 0, not NaN)
    loss_agg: LossAgg = "token_mean"
    # Replay (ReplayOptions: replay_capacity, replay_rows, replay_informative_only): a replayed row keeps its
    # advantage and behaviour log-probs; the clipped ratio against the latter corrects (and bounds) its staleness.


@dataclass
class DrGRPOOptions(GRPOOptions):
    scale: Literal["group", "batch", "none"] = "none"
    loss_agg: LossAgg = "seq_mean_token_sum_norm"


class GRPO(Algorithm):
    """Group-relative advantages, clipped surrogate, optional KL to a reference (k3)."""

    name = "grpo"
    Options = GRPOOptions
    options: GRPOOptions

    @property
    def needs_reference(self) -> bool:
        return self.options.beta > 0

    def on_setup(self, policy: Any) -> None:
        # Every scale centres on the group's mean: with one completion per prompt each advantage is exactly 0,
        # and the run would spend its budget on steps that learn nothing from the reward. Refuse before training.
        if self.train.group_size < 2:
            from palestra.config import ConfigError

            raise ConfigError(
                f"train.group_size: {self.name}'s group-relative advantages need at least 2 completions per prompt, "
                f"got {self.train.group_size} (every advantage would be 0)"
            )

    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import group_advantages
        from palestra.rl import group_size_of

        g = group_size_of(batch.group_ids, self.name)
        batch.advantages = group_advantages(batch.rewards, g, scale=self.options.scale, eps=self.options.std_eps)
        return batch

    def loss(self, batch: Experience, scores: Any):
        return self.clipped_loss(batch, scores, kl_coef=self.options.beta)


class DrGRPO(GRPO):
    """GRPO without the length and difficulty biases: no std scaling, token sums over a constant length."""

    name = "dr_grpo"
    Options = DrGRPOOptions


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "grpo",
        GRPO,
        options=GRPOOptions,
        description="GRPO: group-relative advantages, clipped surrogate, optional KL (k3)",
    )
    register(
        "dr_grpo",
        DrGRPO,
        options=DrGRPOOptions,
        description="Dr.GRPO: GRPO without std scaling, token sums over a constant length",
    )
