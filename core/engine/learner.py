"""The learner: :class:`Learner` owns the update every algorithm runs on.

It takes an :class:`~palestra.engine.algorithm.Algorithm` (the RL content: advantages, loss, parameter groups) and
does the rest:

* the forward: it scores the policy (``policy.score``) and hands the scores to ``algorithm.loss(batch, scores)``;
  in :meth:`Learner.prepare` it scores the frozen reference and, for an algorithm with a value head, the
  rollout-time values, before ``algorithm.advantages``;
* micro-batches (``train.grad_accum`` splits, token budgets, ``auto_micro_batch`` with out-of-memory back-off:
  :mod:`palestra.engine.micro_plans`), mixed precision (autocast around the forward, fp16 loss scaling), gradient
  synchronisation over ranks (the context's ``grad_sync``), clipping, the optimiser steps and learning-rate
  schedules (:mod:`palestra.engine.optimizers`), CPU offload of the reference and of the optimiser state;
* experience replay (an algorithm whose options derive from ``ReplayOptions``) and rollout correction;
* a pass whose loss or gradient norm is not finite takes no step (``train/skipped``), and diagnostics
  (:mod:`palestra.engine.diagnostics`); checkpoints (FSDP2's sharded optimiser state included).

Micro-batches are weighted so that a pass's gradient equals the full-batch gradient whatever ``grad_accum`` is:
with ``loss_agg="token_mean"`` each micro-batch counts by its share of the pass's tokens, otherwise by its share of
rows (``Algorithm.micro_weights``). Metrics are averaged over micro-batches by token share (so they equal the full
batch's token means) and over the passes that stepped; ``grad/norm`` and ``grad/update_ratio`` are the mean over
passes, ``lr`` the rate used by this update.

Rollout correction (``options.rollout_correction``, :mod:`palestra.rl.rollout_correction`): with it on, policy ratios
are taken against the learner's own pre-update log-probs and the advantages are multiplied by importance weights
for the sampler (:func:`palestra.rl.corrected_advantages`) before the algorithm's loss sees them: every
policy-gradient term is linear in the advantage and the weights are positive and detached, so this weights the
policy-gradient term and nothing else. ``rollout/*`` metrics (the sampler-learner gap) come from the first pass,
correction or not.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from typing import TYPE_CHECKING, Any

from palestra.context import TrainContext
from palestra.engine.algorithm import (
    Algorithm,
    AlgorithmOptions,
    ParamGroup,
    ReplayOptions,
    check_option,
    token_weights,
)
from palestra.engine.diagnostics import MAX_METRICS, diagnostics_probe, floats, group_diagnostics, update_ratio
from palestra.engine.micro_plans import MicroBatchPlanner
from palestra.engine.optimizers import build_optimizers, learner_state, load_learner_state
from palestra.types import Experience, GradientCheckpointing

if TYPE_CHECKING:
    import torch

__all__ = [
    "Algorithm",
    "AlgorithmOptions",
    "Learner",
    "ParamGroup",
    "ReplayOptions",
    "check_option",
    "token_weights",
    "update_ratio",
]

log = logging.getLogger("palestra.engine.learner")


class Learner:
    """The update for ``algorithm`` on ``policy`` (see the module docstring).

    Built once per run with the run's :class:`~palestra.context.TrainContext` (and the frozen ``reference`` when
    ``algorithm.needs_reference``); also applies the memory and precision switches of ``train``: gradient
    checkpointing on the policy, the reference in CPU memory (``offload_reference``), CPU master copies for the
    optimisers (``offload_optimizer``), and the autocast / loss-scaling set-up (``precision``).
    """

    def __init__(self, algorithm: Algorithm, policy: Any, context: TrainContext, *, reference: Any = None) -> None:
        import torch

        if not isinstance(context, TrainContext):
            raise TypeError(
                f"Learner: context must be a palestra.TrainContext, got {type(context).__name__} "
                "(TrainContext.local(train) makes one for a single process)"
            )
        name = algorithm.name
        if algorithm.needs_reference and reference is None:
            raise ValueError(f"{name}: the KL term needs a frozen reference policy; Learner() got reference=None")
        self.algorithm, self.policy, self.context, self.train = algorithm, policy, context, context.train
        self.reference = reference if algorithm.needs_reference else None
        self._prepare_models()
        algorithm.bind(policy, context)
        self.groups: dict[str, ParamGroup] = algorithm.optimizer_groups(policy)
        # policy_params: the policy's trained tensors (grad/update_ratio, diagnostics); params: every trained tensor
        self.policy_params = [p for g in self.groups.values() if g.policy for p in g.params]
        if not self.policy_params:
            raise ValueError(f"{name}: the policy ({type(policy).__name__}) has no trainable parameters")
        self.params = [p for g in self.groups.values() for p in g.params]
        from palestra.scale.precision import Precision

        first = self.policy_params[0]
        self.precision = Precision(context.precision, first.device.type, param_dtype=first.dtype)
        self.optimizer_set = build_optimizers(self.groups, self.train)
        algorithm.on_optimizers(self.optimizer_set.stepped)
        # Shuffles rows between micro-batches; its own generator so that sampling elsewhere does not move it, derived
        # from the process seed (the trainer seeds torch from run.seed), offset so that it does not replay the
        # default generator's stream.
        self.shuffle_generator = torch.Generator()
        self.shuffle_generator.manual_seed((torch.initial_seed() + 0x5EED_5EED) % (2**63))
        self.replay = None
        replay = algorithm.replay_options
        if replay is not None:
            from palestra.rl.replay import ReplayBuffer

            self.replay = ReplayBuffer(
                replay.replay_capacity, replay.replay_rows, informative_only=replay.replay_informative_only
            )
        self.planner = MicroBatchPlanner(
            name, self.train, policy, self.params, self.precision, self.shuffle_generator, self._zero_grads
        )

    def _prepare_models(self) -> None:
        """The reference frozen (and offloaded), the value head added, gradient checkpointing switched on."""
        from palestra.config import ConfigError

        policy, train = self.policy, self.train
        if self.reference is not None:
            self.reference.requires_grad_(False)
            if train.offload_reference:
                self.reference.to("cpu")  # visits the training device only in prepare() (offload.borrowed)
        if self.algorithm.needs_value_head:
            policy.enable_value_head()
        if train.gradient_checkpointing:
            if not isinstance(policy, GradientCheckpointing):
                raise ConfigError(
                    f"train.gradient_checkpointing: the policy ({type(policy).__name__}) has no "
                    "set_gradient_checkpointing(on); set it to false"
                )
            policy.set_gradient_checkpointing(True)

    # ---- what others read --------------------------------------------------------------------------------
    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The AdamW of each parameter group, by group name."""
        return self.optimizer_set.optimizers

    @property
    def schedulers(self) -> dict[str, Any]:
        """The learning-rate schedule of each parameter group, by group name."""
        return self.optimizer_set.schedulers

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first group's optimiser (the only one for a single-group algorithm)."""
        return next(iter(self.optimizers.values()))

    @property
    def scheduler(self) -> Any:
        return next(iter(self.schedulers.values()))

    def autocast(self) -> Any:
        """The training precision's autocast region (the forward here; the trainer's rollouts sample under it)."""
        return self.precision.autocast()

    def state_dict(self) -> dict[str, Any]:
        """Optimisers, LR schedules, the shuffling generator, the replay buffer and the algorithm's extra state, the
        fp16 scaler and the CPU master weights (:func:`palestra.engine.optimizers.learner_state`). Collective under
        FSDP2 (every rank calls it)."""
        return learner_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a learner built on the restored policy)."""
        load_learner_state(self, state)

    # ---- scoring -----------------------------------------------------------------------------------------
    def prepare(self, batch: Experience) -> Experience:
        """Reference log-probs (when there is a reference), rollout-time values (an algorithm with a value head),
        then ``algorithm.advantages``; no gradients. An offloaded reference (``train.offload_reference``) visits the
        policy's device for the scoring only."""
        import torch

        from palestra.scale.offload import borrowed

        batch.validate()
        temperature = self.algorithm.temperature
        with torch.no_grad():
            if self.reference is not None:
                if self.train.offload_reference:
                    with borrowed(self.reference, batch.completion_ids.device) as reference:
                        batch.ref_logprobs = self.planner.score(reference, batch, self.autocast, temperature).logprobs
                else:
                    batch.ref_logprobs = self.planner.score(self.reference, batch, self.autocast, temperature).logprobs
            if self.algorithm.needs_value_head:
                batch.old_values = self.planner.score(
                    self.policy, batch, self.autocast, temperature, values=True
                ).values
            return self.algorithm.advantages(batch)

    def score(self, batch: Experience) -> Any:
        """The policy's differentiable scores on ``batch`` (log-probs and entropy; values for an algorithm with a
        value head), under the training precision's autocast; they come out in fp32, so the loss math is fp32."""
        with self.autocast():
            return self.policy.score(
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                temperature=self.algorithm.temperature,
                entropy=True,
                values=self.algorithm.needs_value_head,
                agent_ids=list(batch.agent_ids),
            )

    def loss(self, batch: Experience) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss: the forward, rollout correction, ``algorithm.loss``; metrics as floats, the
        ``rollout/*`` gap metrics among them (see the module docstring)."""
        from palestra.rl.rollout_correction import rollout_mismatch
        from palestra.rl.terms import corrected_advantages

        scores = self.score(batch)
        correction = self.algorithm.options.rollout_correction
        # the learner's own pre-update log-probs: from before the first pass when the update has several, else this
        # forward's (no optimiser step has happened yet)
        learner = batch.old_logprobs if batch.old_logprobs is not None else scores.logprobs
        weights, gap = rollout_mismatch(learner, batch.behaviour_logprobs, batch.completion_mask, correction)
        inputs = copy.copy(batch)
        if correction.enabled:
            inputs.old_logprobs = learner.detach()
            inputs.advantages = corrected_advantages(batch.advantages, weights)
        else:
            inputs.old_logprobs = batch.behaviour_logprobs
        loss, metrics = self.algorithm.loss(inputs, scores)
        return loss, floats({**metrics, **{f"rollout/{k}": v for k, v in gap.items()}})

    # ---- the update --------------------------------------------------------------------------------------
    def update(self, batch: Experience) -> dict[str, float]:
        """``train.updates_per_batch`` passes, each one optimiser step over its micro-batches.

        A non-finite loss or gradient norm does not raise: that pass takes no step (gradients zeroed, no optimiser
        step) and the update's later passes are not run; one warning line names the pass and micro-batch. When no
        pass stepped the metrics say ``train/skipped: 1.0`` (no LR-schedule step; the trainer counts skips in a row,
        ``train.max_bad_steps``); when an earlier pass did step, the update counts (``train/skipped: 0.0``, the
        schedule steps, replay keeps the batch, the metrics are the passes that stepped) and
        ``train/skipped_passes`` says how many did not. Under fp16 an overflow of the *scaled* gradients is the
        loss scaler's business (it skips that pass's step and backs off, ``amp/overflow``), not a bad step.
        """
        lr = float(self.optimizer.param_groups[0]["lr"])
        rows = self.rows_for_update(batch)
        if rows is None:  # nothing to train on anywhere: no optimiser or schedule step
            return {"loss": 0.0, "lr": lr, "train/skipped": 0.0, **self.algorithm.update_metrics()}
        n, k = rows.batch_size, self.train.grad_accum
        budget = self.planner.token_budget(rows)
        if budget is None and n < k:
            raise ValueError(
                f"{self.algorithm.name}.update: the batch has {n} rows, fewer than train.grad_accum={k} micro-batches"
            )
        self.algorithm.begin_update(rows)
        passes = self.train.updates_per_batch
        if self.algorithm.options.rollout_correction.enabled and passes > 1:
            # Later passes need the pre-update log-probs after the weights have moved: one no-grad scoring pass.
            # (A single pass takes them from its own forward, detached: see loss.)
            import torch

            with torch.no_grad():
                rows.old_logprobs = self.planner.score(
                    self.policy, rows, self.autocast, self.algorithm.temperature
                ).logprobs
        every = self.algorithm.options.diagnostics_every
        probe = every > 0 and self.scheduler.last_epoch % every == 0  # counts updates (schedule steps); checkpointed
        results: list[dict[str, float]] = []
        for pass_index in range(passes):
            result = self.planner.with_backoff(
                rows, budget, functools.partial(self._pass, rows, pass_index, probe=probe and pass_index == 0), "update"
            )
            if result is None:  # a bad step: skip the rest of this update
                break
            results.append(result)
            if self.planner.auto_budget_cap is not None and budget is not None:
                budget = min(budget, self.planner.auto_budget_cap)
        return self._finish(batch, results, passes - len(results), lr, budget)

    def rows_for_update(self, batch: Experience) -> Experience | None:
        """The rows one update trains on: the algorithm's choice (``Algorithm.rows_for_update``; None: no update),
        plus replayed rows when replay is on (drawn by the shuffling generator)."""
        rows = self.algorithm.rows_for_update(batch)
        if rows is None or self.replay is None:
            return rows
        return self.replay.mix(rows, self.shuffle_generator, pad_token_id=self.policy.tokenizer.pad_token_id)

    def _finish(
        self, batch: Experience, results: list[dict[str, float]], skipped: int, lr: float, budget: int | None
    ) -> dict[str, float]:
        """The update's metrics; the schedule and replay move on when a pass stepped."""
        if not results:
            out = {"train/skipped": 1.0, "lr": lr, **self.precision.metrics()}
            if self.train.auto_micro_batch and self.planner.auto_budget_cap is not None:
                out["memory/token_budget"] = float(self.planner.auto_budget_cap)
            out["train/skipped_passes"] = float(skipped)
            out.update(self.algorithm.update_metrics())
            return out
        totals: dict[str, float] = {}
        for key in dict.fromkeys(k for r in results for k in r):  # first-seen order
            have = [r[key] for r in results if key in r]
            total = 0.0
            for v in have:
                total += v / len(have)
            totals[key] = total
        if any(r.get("amp/overflow", 0.0) == 0.0 for r in results):
            for scheduler in self.schedulers.values():
                scheduler.step()  # the schedule follows optimiser steps (an update lost to fp16 overflow is not one)
        if self.replay is not None:
            self.replay.add(batch)  # the fresh rows join the replay buffer once their update is done
        totals.update(group_diagnostics(batch, self.algorithm.options.diagnostics_tie_std))
        totals["lr"] = lr
        totals["train/skipped"] = 0.0
        if skipped:
            totals["train/skipped_passes"] = float(skipped)
        totals.update(self.precision.metrics())
        if budget is not None:
            totals["memory/token_budget"] = float(budget)
        totals.update(self.algorithm.update_metrics())
        return totals

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None
        if self.optimizer_set.master is not None:
            self.optimizer_set.master.zero_grad()

    def _pass(
        self, rows: Experience, pass_index: int, budget: int | None, *, probe: bool = False
    ) -> dict[str, float] | None:
        """One pass: micro-batch forwards and backwards, then :meth:`_step`. None: a bad step."""
        metrics, bad = self._backward(rows, pass_index, budget, probe=probe)
        return self._step(metrics, bad, pass_index)

    def _backward(
        self, rows: Experience, pass_index: int, budget: int | None, *, probe: bool
    ) -> tuple[dict[str, float], str | None]:
        """The micro-batches' losses and backwards; their metrics and what was not finite (None: all finite).

        ``probe``: measure the costlier diagnostics on the first micro-batch. ``rollout/*`` metrics compare the
        behaviour log-probs with the learner's *before* the update, so only the first pass reports them;
        ``MAX_METRICS`` combine over micro-batches by their maximum, the rest by token share."""
        from palestra.scale.micro_batching import trim_padding

        chunks = self.planner.plan(rows, budget)
        weights = self.algorithm.micro_weights(rows, chunks)
        token_shares = token_weights(rows, chunks)  # metrics are token means
        self._zero_grads()
        metrics: dict[str, float] = {"loss": 0.0}
        bad: str | None = None
        for micro_index, (w, share, idx) in enumerate(zip(weights, token_shares, chunks)):
            micro = rows.select(idx)
            if budget is not None:
                micro = trim_padding(micro)
            loss, micro_metrics = self.loss(micro)
            value = float(loss.detach())
            if not math.isfinite(value) and bad is None:
                bad = (
                    f"non-finite loss ({value}) in pass {pass_index},"
                    f" micro-batch {micro_index} ({micro.batch_size} rows)"
                )
            # Backward even after a bad loss: every rank runs the same collectives (DDP hooks, grad_sync).
            self.precision.backward(loss * w)
            if probe and micro_index == 0:
                metrics.update(self._probe(micro, w))
            metrics["loss"] += w * value
            for key, v in micro_metrics.items():
                if pass_index > 0 and key.startswith("rollout/"):
                    continue
                if key in MAX_METRICS:
                    metrics[key] = max(metrics.get(key, -math.inf), float(v))
                else:
                    metrics[key] = metrics.get(key, 0.0) + share * float(v)
        return metrics, bad

    def _step(self, metrics: dict[str, float], bad: str | None, pass_index: int) -> dict[str, float] | None:
        """Gradient sync, unscale, clip and the optimiser step of one pass; None (and no step) when ``bad`` or the
        gradient norm is not finite."""
        import torch

        params, opt = self.params, self.optimizer_set
        if bad is not None:
            # Make the skip collective: NaN gradients reach every rank through grad_sync, so all ranks skip.
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)
        self.context.grad_sync(params)
        if opt.master is not None:
            opt.master.grads_from(params)  # gradients to CPU memory; the steps run there
        optimizers = list(opt.optimizers.values())
        for o in optimizers:
            self.precision.unscale_(o)
        max_norm = self.train.max_grad_norm if self.train.max_grad_norm is not None else math.inf
        grad_norm, norms = self.algorithm.clip_gradients(opt.stepped, max_norm)
        finite = math.isfinite(grad_norm) and all(math.isfinite(v) for v in norms.values())
        if bad is None and not finite and self.precision.scaler is None:
            bad = f"non-finite gradient norm ({grad_norm}) in pass {pass_index}"
        if bad is not None:
            self.precision.skip(optimizers)
            self._zero_grads()
            log.warning("%s.update: skipped the optimiser step: %s", self.algorithm.name, bad)
            return None
        stepping = self.algorithm.before_optimizer_step(opt.stepped, max_norm)
        track = self.train.track_update_ratio
        before = [p.detach().clone() for p in self.policy_params] if track else []  # a copy of the weights: optional
        took = self.precision.step(optimizers)
        if took and opt.master is not None:
            opt.master.copy_to(params)
        self._zero_grads()
        self.algorithm.after_optimizer_step(took)
        if self.precision.scaler is not None:
            metrics["amp/overflow"] = 0.0 if took else 1.0
        if took:  # an fp16 overflow pass has an inf norm and no update: it does not count in their means
            metrics.update(stepping)
            metrics.update(norms)
            metrics["grad/norm"] = grad_norm
            if track:
                metrics["grad/update_ratio"] = update_ratio(before, self.policy_params)
        return metrics

    def _probe(self, micro: Experience, weight: float) -> dict[str, float]:
        """The costlier diagnostics (:func:`palestra.engine.diagnostics.diagnostics_probe`); nothing under FSDP
        (sharded gradients; the extra forwards would be collectives)."""
        if self.context.fsdp:
            return {}
        algorithm = self.algorithm

        def entropy_loss(batch: Experience) -> torch.Tensor:  # the entropy bonus's part of the loss, aggregated
            return -algorithm.options.entropy_coef * algorithm.aggregate(
                self.score(batch).entropy, batch.completion_mask
            )

        return diagnostics_probe(
            self.policy,
            micro,
            weight,
            params=self.policy_params,
            entropy_coef=algorithm.options.entropy_coef,
            entropy_loss=entropy_loss,
            backward=self.precision.backward,
            autocast=self.autocast(),
        )
