"""The modern GRPO family on the one learner: DAPO, GSPO and CISPO.

All three reuse GRPO's group-relative advantages (:class:`~palestra.plugins.optimizers.grpo.GRPO`, including
``scale`` and ``std_eps``) and its optional KL term (``beta``, ``kl_estimator``); they differ in the loss.

* ``dapo`` (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale"): the clipped surrogate with
  clip-higher (``clip_eps=0.2``, ``clip_eps_high=0.28``), token-level aggregation (``token_mean``), and dynamic
  sampling: groups whose rewards all tie (so every advantage in them is 0) are dropped from the update, so that
  the gradient is a mean over informative tokens only. With ``refill_rounds > 0`` the batch is also *refilled*, as
  in the paper (verl's ``max_num_gen_batches``): while it holds fewer informative groups than one rollout's
  ``train.batch_size`` tasks, the trainer samples another batch of tasks, up to ``refill_rounds`` more a step, and
  the update takes the first ``train.batch_size`` informative groups (the rest are dropped).
  ``dapo/kept_groups_frac`` reports the share of sampled groups kept; when no group is left, the update is a no-op (no
  optimiser step, no LR-schedule step) and ``dapo/empty_update`` is 1. The overlong reward shaping is a reward,
  ``overlong`` (``plugins/rewards/length.py``), added to the task reward in the config.
* ``gspo`` (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per sequence, the
  geometric mean of its token ratios, clipped per sequence with GSPO's small ranges (3e-4 / 4e-4); GSPO-token form
  (:func:`palestra.rl.gspo_surrogate`); ``seq_mean_token_mean`` aggregation, which makes it the paper's
  sequence-level objective.
* ``cispo`` (MiniMax-M1, 2025): ``-sg[clip(r_t)] * A * logp_t`` (:func:`palestra.rl.cispo_surrogate`); the
  importance weight is clipped instead of the token's update, so every token keeps a gradient. No lower bound by
  default (the paper's choice); the upper bound ``1 + clip_eps_high = 5`` is the ScaleRL paper's ``eps_max = 5``
  (Khatri et al. 2025, which TRL's docs recommend for ``loss_type="cispo"``). Token-level aggregation, as the paper's
  ``1 / sum_i |o_i|``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import Experience, hookimpl, option
from palestra.plugins.optimizers.grpo import GRPO, GRPOOptions
from palestra.rl import LossAgg

if TYPE_CHECKING:
    import torch

log = logging.getLogger("palestra.plugins.optimizers.grpo_family")

# Experience.extras key: a per-row loss weight DAPO uses when it cannot drop rows by selecting them
# (see rows_for_update)
ROW_WEIGHT = "dapo_row_weight"


# ---- DAPO -------------------------------------------------------------------------------------------------
@dataclass
class DAPOOptions(GRPOOptions):
    clip_eps_high: float | None = option(0.28, gt=0)  # clip-higher: the ratio is clipped to [1 - 0.2, 1 + 0.28]
    loss_agg: LossAgg = "token_mean"
    dynamic_sampling: bool = True  # drop groups whose rewards all tie (every advantage 0) from the update
    tie_tolerance: float = option(0.0, ge=0)  # a group ties when its rewards' max - min is at most this
    # extra rollouts a step may sample to replace dropped groups (verl: max_num_gen_batches - 1); 0: drop only
    refill_rounds: int = option(0, ge=0)


def informative_rows(rewards: torch.Tensor, group_size: int, tolerance: float = 0.0) -> torch.Tensor:
    """Bool ``[B]``: the rows of groups (``group_size`` consecutive rows) whose rewards do not all tie.

    A group ties when ``max - min <= tolerance``; its group-relative advantages are then all 0.
    """
    r = rewards.detach().float().view(-1, group_size)
    spread = r.max(-1).values - r.min(-1).values
    return (spread > tolerance).repeat_interleave(group_size)


class DAPO(GRPO):
    """GRPO with clip-higher, token-level loss and dynamic sampling (tied groups dropped, optionally refilled)."""

    name = "dapo"
    Options = DAPOOptions
    options: DAPOOptions
    step_groups: int = 0  # one rollout's groups on this rank (on_setup)
    kept_frac: float = 0.0  # the last update's share of rows kept (rows_for_update)
    empty_update: bool = False  # the last update had no row to train on, on any rank

    def on_setup(self, policy: Any) -> None:
        super().on_setup(policy)
        if self.replay_options is not None:
            from palestra.config import ConfigError

            raise ConfigError(
                "optimizer.options.replay_capacity: dapo does not replay (its dynamic sampling decides the rows of "
                "each update); set replay_capacity and replay_rows to 0, or use grpo, gspo or cispo for replay"
            )
        if self.options.refill_rounds and not self.options.dynamic_sampling:
            from palestra.config import ConfigError

            raise ConfigError(
                "optimizer.options.refill_rounds: refills replace the tied groups that dynamic sampling drops; set "
                "dynamic_sampling to true, or refill_rounds to 0"
            )
        # One rollout's groups on this rank: what an update with refill is filled up to.
        d = self.context.distributed
        self.step_groups = self.train.batch_size if d is None else d.local_batch_size(self.train.batch_size)

    @property
    def refill_rounds(self) -> int:
        return self.options.refill_rounds

    def groups_short(self, batch: Experience) -> int:
        from palestra.rl import group_size_of

        g = group_size_of(batch.group_ids, self.name)
        informative = int(informative_rows(batch.rewards, g, self.options.tie_tolerance).sum()) // g
        return max(0, self.step_groups - informative)

    def kept_rows(self, batch: Experience) -> torch.Tensor:
        """Bool ``[B]``: the rows this update trains on (every row without dynamic sampling). With refill, at most
        one rollout's worth of groups: the first informative ones, in sampling order."""
        import torch

        from palestra.rl import group_size_of

        if not self.options.dynamic_sampling:
            return torch.ones(batch.batch_size, dtype=torch.bool, device=batch.rewards.device)
        g = group_size_of(batch.group_ids, self.name)
        keep = informative_rows(batch.rewards, g, self.options.tie_tolerance)
        if self.options.refill_rounds:
            keep &= keep.cumsum(0) <= self.step_groups * g  # groups are kept whole, so this cuts at a group's end
        return keep

    def rows_for_update(self, batch: Experience) -> Experience | None:
        """The rows of informative groups; None when no rank has any (the update is then a no-op: no optimiser step,
        no LR-schedule step, ``dapo/empty_update`` 1).

        When they cannot be split into ``train.grad_accum`` micro-batches (fewer rows than that, or none on this
        rank while another rank has some), every row stays and a per-row weight (``extras[ROW_WEIGHT]``, which
        :meth:`loss` hands to ``clipped_loss``) does the dropping instead: 0 on tied rows, and on kept rows the factor
        that turns the aggregation over all rows into the one over kept rows (all tokens / kept tokens for
        ``token_mean``, all rows / kept rows otherwise). The gradient is the same.
        """
        import torch

        from palestra.rl import group_size_of

        keep = self.kept_rows(batch)
        groups = batch.batch_size // group_size_of(batch.group_ids, self.name)
        self.kept_frac = float(keep.sum()) / batch.batch_size if batch.batch_size else 0.0
        anything = bool(keep.any())
        if self.context.is_distributed:
            # Every rank must agree: a rank that stepped alone would run collectives the others do not.
            anything = self.context.distributed.any_true(anything)
        self.empty_update = not anything
        if not anything:
            log.info("%s.update: every one of the %d groups has tied rewards; no update this step", self.name, groups)
            return None
        n_kept = int(keep.sum())
        t = self.train
        splits = 1 if (t.token_budget is not None or t.auto_micro_batch) else t.grad_accum
        if n_kept == batch.batch_size:
            return batch
        if n_kept >= splits:
            return batch.select(keep.nonzero().squeeze(-1))
        rows = batch.select(torch.arange(batch.batch_size))  # a copy, so that the caller's batch keeps its extras
        weight = keep.float()
        if n_kept > 0:
            if self.options.loss_agg == "token_mean":
                tokens = batch.completion_mask.sum(-1).float()
                weight = weight * (tokens.sum() / tokens[keep].sum().clamp(min=1))
            else:
                weight = weight * (batch.batch_size / n_kept)
        rows.extras[ROW_WEIGHT] = weight
        return rows

    def update_metrics(self) -> dict[str, float]:
        # groups are kept whole, so the row share is the group share; the loss over no rows is an empty sum (0)
        return {
            "dapo/kept_groups_frac": 0.0 if self.empty_update else self.kept_frac,
            "dapo/empty_update": 1.0 if self.empty_update else 0.0,
        }

    def loss(self, batch: Experience, scores: Any):
        return self.clipped_loss(batch, scores, kl_coef=self.options.beta, row_weight=batch.extras.get(ROW_WEIGHT))


# ---- GSPO -------------------------------------------------------------------------------------------------
@dataclass
class GSPOOptions(GRPOOptions):
    clip_eps: float = option(3e-4, gt=0, lt=1)  # the sequence ratio clipped to [1 - 3e-4, 1 + 4e-4] (the paper's)
    clip_eps_high: float | None = option(4e-4, gt=0)
    loss_agg: LossAgg = "seq_mean_token_mean"  # with one ratio per sequence: GSPO's sequence-level objective


class GSPO(GRPO):
    """GRPO's advantages with a sequence-level importance ratio, clipped per sequence (GSPO-token form)."""

    name = "gspo"
    Options = GSPOOptions
    options: GSPOOptions

    def loss(self, batch: Experience, scores: Any):
        from palestra.rl import gspo_surrogate

        return self.clipped_loss(batch, scores, kl_coef=self.options.beta, surrogate=gspo_surrogate)


# ---- CISPO ------------------------------------------------------------------------------------------------
@dataclass
class CISPOOptions(GRPOOptions):
    # Optional here, where GRPO's is not: CISPO.loss hands it to cispo_surrogate, which takes None as no lower bound,
    # and no GRPO code that needs a float runs for CISPO.
    clip_eps: float | None = option(None, gt=0, le=1)  # type: ignore[assignment]  # lower bound 1 - clip_eps
    clip_eps_high: float = option(4.0, gt=0)  # weight's upper bound 1 + clip_eps_high (ScaleRL's eps_max = 5)
    loss_agg: LossAgg = "token_mean"


class CISPO(GRPO):
    """GRPO's advantages with CISPO's loss: a clipped, stop-gradient importance weight times ``A * logp``."""

    name = "cispo"
    # mypy compares the two classes as constructors: CISPO's clip_eps_high cannot be None, GRPO's can
    Options = CISPOOptions  # type: ignore[assignment]
    options: CISPOOptions

    def loss(self, batch: Experience, scores: Any):
        from palestra.rl import cispo_surrogate

        return self.clipped_loss(batch, scores, kl_coef=self.options.beta, surrogate=cispo_surrogate)


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "dapo",
        DAPO,
        options=DAPOOptions,
        description="DAPO: GRPO with clip-higher, token-level loss, dynamic sampling (tied groups dropped or refilled)",
    )
    register(
        "gspo",
        GSPO,
        options=GSPOOptions,
        description="GSPO: GRPO advantages, sequence-level importance ratio clipped per sequence",
    )
    register(
        "cispo",
        CISPO,
        options=CISPOOptions,
        description="CISPO: GRPO advantages, clipped stop-gradient importance weight on every token's log-prob",
    )
