"""What an RL algorithm is to the learner: :class:`Algorithm`, a small object with its RL content and nothing else.

The :class:`~palestra.engine.learner.Learner` owns the update (the forward, micro-batches, precision, back-off,
offload, clipping, stepping, replay, rollout correction, optimiser state). An algorithm supplies:

* ``advantages(batch) -> batch`` (required): fill ``batch.advantages`` (and ``returns``) for a fresh rollout; the
  learner runs it under ``torch.no_grad`` after scoring the reference log-probs and, for an algorithm that
  ``needs_value_head``, the rollout-time values (``batch.old_values``);
* ``loss(batch, scores) -> (loss, metrics)`` (required): the differentiable scalar of one micro-batch from the
  policy's ``scores`` (:class:`~palestra.models.policy.TokenScores`: log-probs, entropy, values) that the learner
  computed; metrics are token means (tensors or floats). The learner hands it a batch whose ``old_logprobs`` are
  what the policy ratio is taken against (the behaviour log-probs, or the learner's own pre-update ones with
  rollout correction on) and whose ``advantages`` already carry rollout correction's weights. Built from the pure
  functions of :mod:`palestra.rl` (:meth:`clipped_loss` is GRPO's whole loss);
* optionally: ``optimizer_groups(policy)`` (the parameters it trains, one AdamW each), ``clip_gradients``,
  ``micro_weights`` (how micro-batches add up), ``rows_for_update`` (which rows an update keeps),
  ``refill_rounds`` / ``groups_short`` (DAPO's refill), the step hooks of a multi-agent window
  (``on_optimizers``, ``before_optimizer_step``, ``after_optimizer_step``), ``update_metrics`` and its own state
  (``extra_state`` / ``load_extra_state``).

It never calls the policy. (MAPPO's centralised critic is its own small network, part of what it learns, so MAPPO
runs that one itself.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from palestra.config import OptionError, check_options, option
from palestra.context import TrainContext
from palestra.rl.names import LossAgg
from palestra.rl.rollout_correction import RolloutCorrectionOptions
from palestra.types import Experience

if TYPE_CHECKING:  # torch is imported where it is used, so that loading the optimizer plugins stays light
    import torch

__all__ = ["Algorithm", "AlgorithmOptions", "ParamGroup", "ReplayOptions", "check_option", "token_weights"]


@dataclass
class AlgorithmOptions:
    """Options every algorithm has. Subclasses add theirs (all fields need defaults)."""

    # Temperature the log-probs are scored at; must be the sampling temperature so that ratios against
    # behaviour_logprobs are consistent. None: train.temperature (1.0 when that is 0, i.e. greedy).
    temperature: float | None = option(None, gt=0)
    entropy_coef: float = option(0.0, ge=0)  # entropy bonus: loss -= entropy_coef * entropy
    # How per-token losses become one number: mean over all tokens of the batch; mean over rows of each
    # row's token mean (length-biased, original GRPO); mean over rows of token sum / loss_norm_length (Dr.GRPO).
    loss_agg: LossAgg = "token_mean"
    loss_norm_length: int | None = option(None, ge=1)  # seq_mean_token_sum_norm's constant; None: train.max_new_tokens
    # Importance weights for behaviour log-probs that came from another engine than the learner
    # (palestra.rl.rollout_correction); off by default, the rollout/* gap metrics are logged either way.
    rollout_correction: RolloutCorrectionOptions = field(default_factory=RolloutCorrectionOptions)
    # The costlier diagnostics (diag/entropy_grad_share, diag/logit_norm) run on one micro-batch of every
    # diagnostics_every-th update; 0: never. The group-tie ones are cheap and logged on every update.
    diagnostics_every: int = option(50, ge=0)
    diagnostics_tie_std: float = option(1e-2, ge=0)  # a group whose reward std is at most this counts as tied


@dataclass
class ReplayOptions(AlgorithmOptions):
    """:class:`AlgorithmOptions` plus experience replay (:mod:`palestra.rl.replay`). An algorithm opts in to replay
    by deriving its options from this class; the learner then keeps the buffer, mixes it into every update and
    checkpoints it."""

    replay_capacity: int = option(0, ge=0)  # batches kept for replay; 0: no replay
    replay_rows: int = option(0, ge=0)  # replayed rows added to every update
    # Keep only rows whose advantage is not 0: a tied group's rows carry no policy gradient, and on a hard task
    # (most groups all wrong) they would fill most of the draw.
    replay_informative_only: bool = False

    def __post_init__(self) -> None:
        from palestra.rl.replay import check_replay_options

        check_replay_options(self.replay_capacity, self.replay_rows)


@dataclass
class ParamGroup:
    """Parameters trained by one AdamW with one learning-rate schedule.

    ``module`` owns them (FSDP2's full state dicts name parameters through it); ``policy`` is False for
    parameters outside the policy (a critic), which ``grad/update_ratio`` leaves out.
    """

    params: list[Any]
    lr: float
    module: Any
    policy: bool = True


class Algorithm:
    """An RL algorithm's content: advantages, loss, parameter groups, state (see the module docstring)."""

    name: ClassVar[str] = "algorithm"  # the registered name; prefixes error messages
    Options: ClassVar[type] = AlgorithmOptions
    needs_value_head: ClassVar[bool] = False  # the learner adds a value head and scores values for it
    routes_agents: ClassVar[bool] = True  # scores each row with its agent's parameters (agents.independent_layers)
    shared_update_window: ClassVar[bool] = False  # honours agents.update_frequency (a multi-agent window)

    def __init__(self, **options: Any) -> None:
        self.options = check_options(self.Options, options, where=self.name)
        self.context: TrainContext | None = None
        self.train: Any = None
        self.temperature: float = 1.0
        self.norm_length: int = 1

    # ---- what the learner tells it -----------------------------------------------------------------------
    def bind(self, policy: Any, context: TrainContext) -> None:
        """Called once by the learner before it builds the optimisers: the run's context, then :meth:`on_setup`."""
        o = self.options
        self.context, self.train = context, context.train
        self.temperature = o.temperature if o.temperature is not None else (context.train.temperature or 1.0)
        self.norm_length = o.loss_norm_length if o.loss_norm_length is not None else context.train.max_new_tokens
        self.on_setup(policy)

    def on_setup(self, policy: Any) -> None:
        """Checks against the run, and anything built once (a critic); ``self.context`` / ``self.train`` are set."""

    def on_optimizers(self, stepped: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """The tensors each group's optimiser steps (the parameters, or their CPU master copies under
        ``train.offload_optimizer``), in :meth:`optimizer_groups` order; called once they exist."""

    # ---- what it provides ---------------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        """True when the loss or the advantages use a frozen reference policy (a KL term)."""
        return False

    @property
    def replay_options(self) -> ReplayOptions | None:
        """The options of experience replay when it is on (the learner keeps the buffer), else None."""
        o = self.options
        return o if isinstance(o, ReplayOptions) and o.replay_capacity > 0 else None

    def advantages(self, batch: Experience) -> Experience:
        raise NotImplementedError

    def loss(self, batch: Experience, scores: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
        raise NotImplementedError

    def optimizer_groups(self, policy: Any) -> dict[str, ParamGroup]:
        """The parameters to train, by group: one AdamW and one LR schedule each, in this order."""
        return {"policy": ParamGroup([p for p in policy.parameters() if p.requires_grad], self.train.lr, policy)}

    def clip_gradients(
        self, groups: Mapping[str, Sequence[torch.Tensor]], max_norm: float
    ) -> tuple[float, dict[str, float]]:
        """Clip the gradients of the tensors each optimiser steps; returns the norm reported as ``grad/norm`` and
        further norms to report. Every returned norm must be finite for the step to be taken."""
        import torch

        stepped = [t for ts in groups.values() for t in ts]
        return float(torch.nn.utils.clip_grad_norm_(stepped, max_norm)), {}

    def micro_weights(self, batch: Experience, chunks: Sequence[torch.Tensor]) -> list[float]:
        """Each micro-batch's share of a pass: tokens for ``token_mean``, rows otherwise (sums to 1), so that a pass's
        gradient is the full batch's whatever the micro-batching."""
        if self.options.loss_agg == "token_mean":
            return token_weights(batch, chunks)
        n = batch.batch_size
        return [len(idx) / n for idx in chunks]

    def rows_for_update(self, batch: Experience) -> Experience | None:
        """The rows an update trains on (``batch``: all of them); None: no update at all this step (DAPO when every
        group tied on every rank). The learner mixes replayed rows in afterwards."""
        return batch

    def begin_update(self, rows: Experience) -> None:
        """Called once per update before its passes, with the rows it trains on (per-row loss weights go here)."""

    def before_optimizer_step(self, groups: Mapping[str, Sequence[torch.Tensor]], max_norm: float) -> dict[str, float]:
        """Called when a step will be taken (its gradients are finite), after clipping; returns metrics."""
        return {}

    def after_optimizer_step(self, took: bool) -> None:
        """Called after the optimisers stepped (``took`` False: an fp16 overflow skipped the step)."""

    def update_metrics(self) -> dict[str, float]:
        """Metrics the algorithm adds to each update's (explained variance, per-agent statistics)."""
        return {}

    @property
    def refill_rounds(self) -> int:
        """Extra rollouts the trainer may draw in one step while :meth:`groups_short` is above 0 (DAPO's dynamic
        sampling with refill); 0: every update takes the batch as it was sampled."""
        return 0

    def groups_short(self, batch: Experience) -> int:
        """How many more groups with a training signal ``batch`` (this rank's rows so far this step) needs for a full
        update; the trainer asks only when :attr:`refill_rounds` is above 0."""
        return 0

    def extra_state(self) -> dict[str, Any]:
        """The algorithm's own state (running moments, a critic); the learner checkpoints it with its own."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`extra_state`."""
        if state:
            raise KeyError(f"{self.name}.load_state_dict: unexpected extra state keys {sorted(state)}")

    # ---- loss helpers over tensors (palestra.rl) ------------------------------------------------------------
    def aggregate(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token ``x [B, T]`` -> a scalar, as ``options.loss_agg`` says (:func:`palestra.rl.aggregate`)."""
        from palestra.rl.losses import aggregate

        return aggregate(x, mask, self.options.loss_agg, self.norm_length)

    @staticmethod
    def metric_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The mean of ``x`` over valid tokens, detached: how metrics are reported, whatever ``loss_agg`` is."""
        from palestra.rl.stats import masked_mean

        return masked_mean(x, mask)

    @staticmethod
    def token_advantages(batch: Experience) -> torch.Tensor:
        """``batch.advantages`` as ``[B, T]`` float32 (a per-row advantage repeated over the row's tokens)."""
        import torch

        adv = batch.advantages
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(batch.completion_mask)
        return adv.to(torch.float32)

    def entropy_and_kl(
        self,
        per_token: torch.Tensor,
        batch: Experience,
        scores: Any,
        metrics: dict[str, Any],
        *,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
    ) -> torch.Tensor:
        """``per_token - entropy_coef * entropy + kl_coef * KL`` (:func:`palestra.rl.entropy_and_kl`); adds the
        entropy and KL metrics to ``metrics``."""
        from palestra.rl.terms import entropy_and_kl

        try:
            per_token, m = entropy_and_kl(
                per_token,
                logprobs=scores.logprobs,
                entropy=scores.entropy,
                ref_logprobs=batch.ref_logprobs,
                mask=batch.completion_mask,
                entropy_coef=self.options.entropy_coef,
                kl_coef=kl_coef,
                kl_estimator=kl_estimator,
            )
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        metrics.update(m)
        return per_token

    def surrogate_terms(
        self,
        batch: Experience,
        scores: Any,
        *,
        clip_low: float,
        clip_high: float,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        surrogate: Any = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """A clipped surrogate per token (``surrogate``, :func:`palestra.rl.clipped_surrogate` by default; GSPO's and
        CISPO's have its signature) against ``batch.old_logprobs``, then :meth:`entropy_and_kl`; metric tensors
        ``policy/clip_frac``, ``policy/ratio_mean``, ``policy/entropy`` and, with reference log-probs, ``policy/kl``."""
        from palestra.rl.losses import clipped_surrogate

        fn = surrogate if surrogate is not None else clipped_surrogate
        if batch.old_logprobs is None:
            raise ValueError(f"{self.name}: batch.old_logprobs is None; the learner's prepare fills it before the loss")
        per_token, m = fn(
            scores.logprobs, batch.old_logprobs, batch.advantages, batch.completion_mask, clip_low, clip_high
        )
        metrics: dict[str, Any] = {"policy/clip_frac": m["clip_frac"], "policy/ratio_mean": m["ratio_mean"]}
        per_token = self.entropy_and_kl(per_token, batch, scores, metrics, kl_coef=kl_coef, kl_estimator=kl_estimator)
        return per_token, metrics

    def clipped_loss(
        self,
        batch: Experience,
        scores: Any,
        *,
        kl_coef: float = 0.0,
        row_weight: torch.Tensor | None = None,
        surrogate: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The aggregated clipped surrogate minus the entropy bonus plus ``kl_coef`` * KL, each row's terms times
        ``row_weight`` ``[B]`` when given (DAPO's dropped rows); clipping at the options' ``clip_eps`` /
        ``clip_eps_high`` (None: symmetric), KL by ``kl_estimator``."""
        o = self.options
        high = o.clip_eps_high if o.clip_eps_high is not None or surrogate is not None else o.clip_eps
        per_token, metrics = self.surrogate_terms(
            batch,
            scores,
            clip_low=o.clip_eps,
            clip_high=high,
            kl_coef=kl_coef,
            kl_estimator=o.kl_estimator,
            surrogate=surrogate,
        )
        if row_weight is not None:
            per_token = per_token * row_weight.to(per_token.dtype)[:, None]
        return self.aggregate(per_token, batch.completion_mask), metrics


def token_weights(batch: Experience, chunks: Sequence[torch.Tensor]) -> list[float]:
    """Each chunk's share of the batch's valid tokens (its share of rows when there are no tokens)."""
    tokens = batch.completion_mask.sum(-1)
    total = int(tokens.sum())
    if total == 0:
        return [len(idx) / batch.batch_size for idx in chunks]
    return [int(tokens[idx].sum()) / total for idx in chunks]


def check_option(condition: bool, key: str, message: str) -> None:
    """Raise :class:`OptionError` for ``key`` unless ``condition`` (for options' ``__post_init__``)."""
    if not condition:
        raise OptionError(key, message)
