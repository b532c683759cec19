"""The one learner loop every algorithm runs on: :class:`Algorithm` (implements :class:`palestra.types.PolicyOptimizer`).

The learner owns the update mechanics: micro-batching (``train.grad_accum`` splits, token budgets,
``auto_micro_batch`` with out-of-memory back-off), mixed precision (autocast around the policy forward, fp16 loss
scaling), gradient synchronisation over ranks (the context's ``grad_sync``), clipping, the optimiser steps and
learning-rate schedules, CPU offload of the reference and of the optimiser state, skipping a step whose loss or
gradient norm is not finite (``train/skipped``), and checkpoints (FSDP2's sharded optimiser state included).

An algorithm owns only its RL content, through hooks:

* ``advantages(batch) -> batch`` (required): fill ``batch.advantages`` (and ``returns`` / ``old_values``) for
  a fresh rollout; runs under ``torch.no_grad`` from :meth:`Algorithm.prepare`, after the reference log-probs;
* ``loss(policy, batch) -> (loss, metrics)`` (required): the differentiable scalar on one micro-batch and
  its token-mean metrics; :mod:`palestra.rl` has the shared math (surrogate, value loss, KL, aggregation);
* ``optimizer_groups()``: the parameters it trains, as named :class:`ParamGroup` s, one AdamW and one LR
  schedule each (default: the policy's trainable parameters, one group). A multi-agent algorithm returns
  one group per agent plus the shared layers and a critic;
* ``clip_gradients(groups, max_norm)``: clipping (default: one global norm; MAPPO clips per agent);
* ``on_setup``, ``begin_update``, ``before_optimizer_step``, ``after_optimizer_step``, ``update_metrics``,
  ``extra_state`` / ``load_extra_state``: what an algorithm adds around the loop (running moments, a critic,
  a replay buffer, a shared-layer update window).

Micro-batches are weighted so that a pass's gradient equals the full-batch gradient whatever
``grad_accum`` is: with ``loss_agg="token_mean"`` each micro-batch counts by its share of the pass's
tokens, otherwise by its share of rows (see :meth:`Algorithm.micro_weights`). TRL calls the former
"dapo" (tokens of the whole accumulated batch); a per-micro-batch token mean divided by ``grad_accum``
would instead weight short micro-batches' tokens more. Metrics are averaged over micro-batches by token
share (so they equal the full batch's token means) and over passes; ``grad/norm`` and
``grad/update_ratio`` are the mean over passes, ``lr`` the rate used by this update.

Rollout correction (``options.rollout_correction``, :mod:`palestra.rl.rollout_correction`): with it on, policy
ratios are taken against the learner's own pre-update log-probs (:meth:`Algorithm.proximal_logprobs`) and the
policy-gradient term is multiplied by importance weights for the sampler (:meth:`Algorithm.rollout_terms`, which
:meth:`Algorithm.add_entropy_and_kl` calls). ``rollout/*`` metrics (the sampler-learner gap) come from the first
pass, correction or not. Diagnostics: ``diag/*`` group-tie metrics on every update, and the costlier
``diag/entropy_grad_share`` / ``diag/logit_norm`` every ``options.diagnostics_every`` updates
(:meth:`Algorithm.diagnostics_probe`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from palestra.config import OptionError, check_options, option
from palestra.context import TrainContext
from palestra.rl.names import LossAgg
from palestra.rl.rollout_correction import RolloutCorrectionOptions
from palestra.types import Experience, GradientCheckpointing

if TYPE_CHECKING:  # torch is imported where it is used, so that loading the optimizer plugins stays light
    import torch

    from palestra.rl.replay import ReplayBuffer

__all__ = ["Algorithm", "AlgorithmOptions", "ParamGroup", "ReplayOptions", "agent_rows", "check_option", "token_weights", "update_ratio"]

log = logging.getLogger("palestra.engine.learner")


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
    rollout_correction: RolloutCorrectionOptions = option(default_factory=RolloutCorrectionOptions)
    # The costlier diagnostics (diag/entropy_grad_share, diag/logit_norm) run on one micro-batch of every
    # diagnostics_every-th update; 0: never. The group-tie ones are cheap and logged on every update.
    diagnostics_every: int = option(50, ge=0)
    diagnostics_tie_std: float = option(1e-2, ge=0)  # a group whose reward std is at most this counts as tied


@dataclass
class ReplayOptions(AlgorithmOptions):
    """:class:`AlgorithmOptions` plus experience replay (:mod:`palestra.rl.replay`). An algorithm opts in to replay
    by deriving its options from this class; the learner then keeps the buffer, mixes it into every update
    (:meth:`Algorithm.batch_for_update`) and checkpoints it."""

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
    """The learner loop; a subclass supplies ``advantages`` and ``loss`` (see the module docstring)."""

    name: ClassVar[str] = "algorithm"  # the registered name; prefixes error messages
    Options: ClassVar[type] = AlgorithmOptions
    needs_value_head: ClassVar[bool] = False
    routes_agents: ClassVar[bool] = True  # scores each row with its agent's parameters (see agent_rows)
    shared_update_window: ClassVar[bool] = False  # honours agents.update_frequency (a multi-agent window)

    def __init__(self, **options: Any) -> None:
        import torch

        self.options = check_options(self.Options, options, where=self.name)
        self.policy: Any = None
        self.reference: Any = None
        self.context: TrainContext | None = None
        self.train: Any = None
        self.groups: dict[str, ParamGroup] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        self.temperature: float = 1.0
        self.norm_length: int = 1
        # Shuffles rows between micro-batches; its own generator so that sampling elsewhere does not move it.
        self.shuffle_generator = torch.Generator()
        # Every trained tensor on the training device, group by group (the optimisers step CPU master copies of
        # them under train.offload_optimizer); policy_params: the policy's among them.
        self.params: list[torch.nn.Parameter] = []
        self.policy_params: list[torch.nn.Parameter] = []
        self.stepped: dict[str, list[torch.Tensor]] = {}  # group -> the tensors its optimiser steps
        self.precision: Any = None  # palestra.scale.precision.Precision, built in setup()
        self.master: Any = None  # palestra.scale.offload.CPUMasterWeights under train.offload_optimizer
        # train.auto_micro_batch: the highest token budget known to fit (lowered by each out-of-memory back-off).
        self.auto_budget_cap: int | None = None
        self.replay: ReplayBuffer | None = None  # options derived from ReplayOptions, with replay_capacity > 0
        o = self.options
        if isinstance(o, ReplayOptions) and o.replay_capacity > 0:
            from palestra.rl.replay import ReplayBuffer

            self.replay = ReplayBuffer(o.replay_capacity, o.replay_rows, informative_only=o.replay_informative_only)

    # ---- what subclasses provide -------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        """True when the loss or the advantages use a frozen reference policy (a KL term)."""
        return False

    def advantages(self, batch: Experience) -> Experience:
        raise NotImplementedError

    def loss(self, policy: Any, batch: Experience) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError

    def on_setup(self, policy: Any) -> None:
        """Called in :meth:`setup` once the policy is bound, before the optimisers are built (build a critic here)."""

    def optimizer_groups(self, policy: Any) -> dict[str, ParamGroup]:
        """The parameters to train, by group: one AdamW and one LR schedule each, in this order."""
        return {"policy": ParamGroup([p for p in policy.parameters() if p.requires_grad], self.train.lr, policy)}

    def begin_update(self, rows: Experience) -> None:
        """Called once per update before its passes, with the rows it trains on (per-row loss weights go here)."""

    def clip_gradients(self, groups: Mapping[str, Sequence[torch.Tensor]], max_norm: float) -> tuple[float, dict[str, float]]:
        """Clip the gradients of the tensors each optimiser steps; returns the norm reported as ``grad/norm`` and
        further norms to report. Every returned norm must be finite for the step to be taken."""
        import torch

        stepped = [t for ts in groups.values() for t in ts]
        return float(torch.nn.utils.clip_grad_norm_(stepped, max_norm)), {}

    def before_optimizer_step(self, groups: Mapping[str, Sequence[torch.Tensor]], max_norm: float) -> dict[str, float]:
        """Called when a step will be taken (its gradients are finite), after clipping; returns metrics."""
        return {}

    def after_optimizer_step(self, took: bool) -> None:
        """Called after the optimisers stepped (``took`` False: an fp16 overflow skipped the step)."""

    def update_metrics(self) -> dict[str, float]:
        """Metrics the algorithm adds to each update's (explained variance, per-agent statistics)."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """State beyond optimisers, schedules and shuffling: the replay buffer here; a subclass adds its own (running
        moments, a critic's statistics) to ``super().extra_state()``."""
        return {"replay": self.replay.state()} if self.replay is not None else {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`extra_state`; a subclass takes its own keys out and passes the rest here."""
        rest = dict(state)
        if self.replay is not None:
            if "replay" not in rest:
                raise KeyError(f"{self.name}.load_state_dict: replay is on but the checkpoint has no replay buffer "
                               f"(extra state keys {sorted(state)})")
            self.replay.load(rest.pop("replay"))
        if rest:
            raise KeyError(f"{self.name}.load_state_dict: unexpected extra state keys {sorted(rest)}")

    # ---- lifecycle -------------------------------------------------------------------------------------
    def setup(self, policy: Any, context: TrainContext | Any, *, reference: Any = None) -> None:
        """Bind ``policy`` (and ``reference``), add a value head if needed, build the optimisers and LR schedules.

        ``context`` is the run's :class:`~palestra.context.TrainContext`; a bare ``train`` config section is
        taken as a single-process context. Also applies the memory and precision switches of ``train``: gradient
        checkpointing on the policy, the reference moved to CPU memory (``offload_reference``), CPU master copies
        for the optimisers (``offload_optimizer``), and the autocast / loss-scaling set-up (``precision``).
        """
        import torch

        from palestra.config import ConfigError
        from palestra.rl.schedules import lr_factor
        from palestra.scale.offload import CPUMasterWeights
        from palestra.scale.precision import Precision

        if not isinstance(context, TrainContext):
            context = TrainContext.local(context)
        train = context.train
        if self.needs_reference and reference is None:
            raise ValueError(f"{self.name}: the KL term needs a frozen reference policy; setup() got reference=None")
        self.policy, self.context, self.train = policy, context, train
        self.reference = reference if self.needs_reference else None
        if self.reference is not None:
            self.reference.requires_grad_(False)
            if train.offload_reference:
                self.reference.to("cpu")  # visits the training device only in prepare() (offload.borrowed)
        if self.needs_value_head:
            policy.enable_value_head()
        if train.gradient_checkpointing:
            if not isinstance(policy, GradientCheckpointing):
                raise ConfigError(
                    f"train.gradient_checkpointing: the policy ({type(policy).__name__}) has no "
                    "set_gradient_checkpointing(on); set it to false"
                )
            policy.set_gradient_checkpointing(True)
        self.on_setup(policy)
        groups = self.optimizer_groups(policy)
        self.policy_params = [p for g in groups.values() if g.policy for p in g.params]
        if not self.policy_params:
            raise ValueError(f"{self.name}: the policy ({type(policy).__name__}) has no trainable parameters")
        self.groups = groups
        self.params = [p for g in groups.values() for p in g.params]
        first = self.policy_params[0]
        self.precision = Precision(context.precision, first.device.type, param_dtype=first.dtype)
        self.master = None
        self.stepped = {name: list(g.params) for name, g in groups.items()}
        if train.offload_optimizer:
            self.master = CPUMasterWeights(self.params)
            copies = iter(self.master.master)
            self.stepped = {name: [next(copies) for _ in g.params] for name, g in groups.items()}
        factor = lr_factor(train.lr_schedule, train.warmup_steps, train.steps)
        self.optimizers = {
            name: torch.optim.AdamW(self.stepped[name], lr=g.lr, weight_decay=train.weight_decay) for name, g in groups.items()
        }
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, factor) for name, opt in self.optimizers.items()}
        o = self.options
        self.temperature = o.temperature if o.temperature is not None else (train.temperature or 1.0)
        self.norm_length = o.loss_norm_length if o.loss_norm_length is not None else train.max_new_tokens
        # Derived from the process seed (the trainer seeds torch from run.seed), offset so that it does not
        # replay the default generator's stream.
        self.shuffle_generator.manual_seed((torch.initial_seed() + 0x5EED_5EED) % (2**63))
        self.auto_budget_cap = None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first group's optimiser (the only one for a single-group algorithm)."""
        return next(iter(self.optimizers.values()), None)

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR | None:
        return next(iter(self.schedulers.values()), None)

    def _require_setup(self, what: str) -> None:
        if not self.optimizers:
            raise RuntimeError(f"{self.name}.{what}: call setup(policy, context) first")

    def prepare(self, batch: Experience) -> Experience:
        """Reference log-probs (when there is a reference), then :meth:`advantages`; no gradients.

        An offloaded reference (``train.offload_reference``) is brought to the policy's device for the scoring
        and sent back to CPU memory afterwards.
        """
        import torch

        from palestra.scale.offload import borrowed

        self._require_setup("prepare")
        batch.validate()
        with torch.no_grad():
            if self.reference is not None:
                if self.train.offload_reference:
                    with borrowed(self.reference, batch.completion_ids.device) as reference:
                        batch.ref_logprobs = self.score_in_chunks(reference, batch).logprobs
                else:
                    batch.ref_logprobs = self.score_in_chunks(self.reference, batch).logprobs
            return self.advantages(batch)

    # ---- micro-batch plans -----------------------------------------------------------------------------
    def token_budget(self, batch: Experience) -> int | None:
        """Tokens per micro-batch for ``batch``: None for the plain ``train.grad_accum`` split; else
        ``train.token_budget``, or (``train.auto_micro_batch``) a budget from free memory, capped by the
        token budget and by what an out-of-memory back-off has learnt."""
        t = self.train
        fixed = t.token_budget
        if not t.auto_micro_batch:
            return fixed
        from palestra.scale.micro_batching import auto_token_budget, row_tokens

        elem = 2 if self.precision is not None and self.precision.enabled else self.params[0].element_size()
        width = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
        budget = auto_token_budget(
            self.policy, self.params[0].device, width, elem,
            checkpointing=t.gradient_checkpointing,
        )
        for cap in (fixed, self.auto_budget_cap, batch.batch_size * width):  # never more than the whole batch
            if cap is not None:
                budget = min(budget, cap)
        biggest = int(row_tokens(batch).max()) if batch.batch_size else 1
        return max(budget, biggest)  # one row per micro-batch at least; the back-off decides if even that fails

    def plan(self, batch: Experience, budget: int | None, *, shuffle: bool = True) -> list[torch.Tensor]:
        """Row indices of the micro-batches of one pass: ``train.grad_accum`` equal splits of a random order,
        or token-budget packs (:func:`palestra.scale.micro_batching.plan_micro_batches`)."""
        import torch

        from palestra.scale.micro_batching import RowTooLong, plan_micro_batches

        n = batch.batch_size
        if budget is None:
            k = self.train.grad_accum
            order = torch.randperm(n, generator=self.shuffle_generator) if shuffle else torch.arange(n)
            return [c for c in torch.tensor_split(order, k) if shuffle or len(c)]
        try:
            return plan_micro_batches(batch, budget, self.shuffle_generator if shuffle else None)
        except RowTooLong as e:
            raise ValueError(
                f"{self.name}: train.token_budget={budget} is smaller than row {e.row} of the batch, which needs "
                f"{e.tokens} tokens (prompt + completion) by itself; raise train.token_budget"
            ) from None

    def _with_backoff(self, batch: Experience, budget: int | None, attempt: Callable[[int | None], Any], what: str) -> Any:
        """``attempt(budget)``; under ``train.auto_micro_batch`` an out-of-memory error halves the budget and
        retries, until a plan of one row per micro-batch fails too (then a one-line :class:`OutOfMemory`)."""
        from palestra.scale.micro_batching import (
            OutOfMemory,
            free_cached_memory,
            is_out_of_memory,
            plan_micro_batches,
            row_tokens,
        )

        auto = self.train.auto_micro_batch
        while True:
            try:
                return attempt(budget)
            except Exception as e:
                if not (auto and budget is not None and is_out_of_memory(e)):
                    raise
                self._zero_grads()
                free_cached_memory(self.params[0].device)
                biggest = int(row_tokens(batch).max())
                if budget <= biggest or max(len(c) for c in plan_micro_batches(batch, budget)) <= 1:
                    raise OutOfMemory(
                        f"{self.name}.{what}: out of memory with one row per micro-batch (a budget of {budget} "
                        f"tokens; the longest row has {biggest}); train.auto_micro_batch cannot back off further: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                    ) from None
                smaller = max(biggest, budget // 2)
                log.warning(
                    "%s.%s: out of memory at a budget of %d tokens per micro-batch; retrying with %d "
                    "(train.auto_micro_batch)", self.name, what, budget, smaller,
                )
                budget = smaller
                self.auto_budget_cap = smaller

    # ---- scoring ----------------------------------------------------------------------------------------
    def score_in_chunks(self, model: Any, batch: Experience, *, values: bool = False) -> Any:
        """``model.score`` over ``batch`` in the update's micro-batch size (memory like a training step), under
        the training precision's autocast; with a token budget, in token-budget packs of trimmed rows."""
        import torch

        from palestra.scale.micro_batching import trim_padding
        from palestra.models.policy import TokenScores

        n = batch.batch_size
        budget = self.token_budget(batch)

        def run(budget: int | None) -> Any:
            if budget is None:  # the update's micro-batch size, in row order, untrimmed
                size = max(1, math.ceil(n / self.train.grad_accum))
                plan = [torch.arange(start, min(start + size, n)) for start in range(0, n, size)]
            else:
                plan = self.plan(batch, budget, shuffle=False)
            shape = tuple(batch.completion_ids.shape)
            device = batch.completion_ids.device
            logprobs = torch.zeros(shape, dtype=torch.float32, device=device)
            vals = torch.zeros(shape, dtype=torch.float32, device=device) if values else None
            for idx in plan:
                micro = batch.select(idx)
                if budget is not None:
                    micro = trim_padding(micro)
                with self.autocast():
                    out = model.score(
                        micro.prompt_ids, micro.prompt_mask, micro.completion_ids, micro.completion_mask,
                        temperature=self.temperature, entropy=False, values=values, **agent_rows(model, micro.agent_ids),
                    )
                rows, width = idx.to(device), out.logprobs.shape[1]
                logprobs[rows, :width] = out.logprobs.float()
                if vals is not None:
                    vals[rows, :width] = out.values.float()
            return TokenScores(logprobs=logprobs, values=vals)

        return self._with_backoff(batch, budget, run, "score")

    def score(self, policy: Any, batch: Experience, *, values: bool = False) -> Any:
        """The policy's differentiable scores on ``batch`` (log-probs and entropy, values if asked).

        The forward runs under the training precision's autocast; the scores come out in fp32, so the loss
        math that follows is fp32.
        """
        with self.autocast():
            return policy.score(
                batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                temperature=self.temperature, entropy=True, values=values, **agent_rows(policy, batch.agent_ids),
            )

    def autocast(self) -> Any:
        """The training precision's autocast region (for scoring outside update(), e.g. rollouts)."""
        import contextlib

        return self.precision.autocast() if self.precision is not None else contextlib.nullcontext()

    # ---- the update --------------------------------------------------------------------------------------
    @property
    def refill_rounds(self) -> int:
        """Extra rollouts the trainer may draw in one step while :meth:`groups_short` is above 0 (DAPO's dynamic
        sampling with refill); 0: every update takes the batch as it was sampled."""
        return 0

    def groups_short(self, batch: Experience) -> int:
        """How many more groups with a training signal ``batch`` (this rank's rows so far this step) needs for a full
        update; the trainer asks only when :attr:`refill_rounds` is above 0."""
        return 0

    def batch_for_update(self, batch: Experience) -> Experience:
        """The rows one update trains on: ``batch``, plus replayed rows when replay is on."""
        if self.replay is None:
            return batch
        return self.replay.mix(batch, self.shuffle_generator, pad_token_id=self.policy.tokenizer.pad_token_id)

    def after_update(self, batch: Experience) -> None:
        """Called once an update on ``batch`` (the fresh rows) is done: they join the replay buffer."""
        if self.replay is not None:
            self.replay.add(batch)

    def micro_weights(self, batch: Experience, chunks: Sequence[torch.Tensor]) -> list[float]:
        """Each micro-batch's share of the pass: tokens for ``token_mean``, rows otherwise (sums to 1)."""
        if self.options.loss_agg == "token_mean":
            return token_weights(batch, chunks)
        n = batch.batch_size
        return [len(idx) / n for idx in chunks]

    def update(self, policy: Any, batch: Experience) -> dict[str, float]:
        """``train.updates_per_batch`` passes, each one optimiser step over its micro-batches
        (``train.grad_accum`` of them, or token-budget packs with ``train.token_budget`` / ``auto_micro_batch``).

        A non-finite loss or gradient norm does not raise: the step is skipped (gradients zeroed, no optimiser
        step, no LR-schedule step), one warning line names the pass and micro-batch, and the metrics say
        ``train/skipped: 1.0`` (0.0 otherwise); the trainer counts skips in a row (``train.max_bad_steps``).
        Under fp16 an overflow of the *scaled* gradients is the loss scaler's business (it skips that pass's
        step and backs off, ``amp/overflow``), not a bad step.
        """
        self._require_setup("update")
        if policy is not self.policy:
            raise ValueError(f"{self.name}.update: policy is not the one given to setup()")
        rows = self.batch_for_update(batch)
        n, k = rows.batch_size, self.train.grad_accum
        budget = self.token_budget(rows)
        if budget is None and n < k:
            raise ValueError(f"{self.name}.update: the batch has {n} rows, fewer than train.grad_accum={k} micro-batches")
        self.begin_update(rows)
        passes = self.train.updates_per_batch
        if self.options.rollout_correction.enabled and passes > 1:
            # Later passes need the pre-update log-probs after the weights have moved: one no-grad scoring pass.
            # (A single pass takes them from its own forward, detached: see proximal_logprobs.)
            import torch

            with torch.no_grad():
                rows.old_logprobs = self.score_in_chunks(policy, rows).logprobs
        lr = float(self.optimizer.param_groups[0]["lr"])
        every = self.options.diagnostics_every
        probe = every > 0 and self.scheduler.last_epoch % every == 0  # counts optimiser steps; checkpointed
        results: list[dict[str, float]] = []
        for pass_index in range(passes):
            result = self._with_backoff(
                rows, budget, lambda b, i=pass_index: self._pass(policy, rows, i, b, probe=probe and i == 0), "update"
            )
            if result is None:  # a bad step: skip the rest of this update
                out = {"train/skipped": 1.0, "lr": lr, **self.precision.metrics()}
                if self.train.auto_micro_batch and self.auto_budget_cap is not None:
                    out["memory/token_budget"] = float(self.auto_budget_cap)
                out.update(self.update_metrics())
                return out
            results.append(result)
            if self.auto_budget_cap is not None and budget is not None:
                budget = min(budget, self.auto_budget_cap)
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
        self.after_update(batch)
        totals.update(self.group_diagnostics(batch))
        totals["lr"] = lr
        totals["train/skipped"] = 0.0
        totals.update(self.precision.metrics())
        if budget is not None:
            totals["memory/token_budget"] = float(budget)
        totals.update(self.update_metrics())
        return totals

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None
        if self.master is not None:
            self.master.zero_grad()

    def _pass(
        self, policy: Any, rows: Experience, pass_index: int, budget: int | None, *, probe: bool = False
    ) -> dict[str, float] | None:
        """One pass: micro-batch forwards and backwards, gradient sync, unscale, clip, step. None: a bad step.

        ``probe``: measure the costlier diagnostics on the first micro-batch (see :meth:`diagnostics_probe`).
        ``rollout/*`` metrics compare the behaviour log-probs with the learner's *before* the update, so only the
        first pass reports them; ``MAX_METRICS`` combine over micro-batches by their maximum, the rest by token share.
        """
        import torch

        from palestra.scale.micro_batching import trim_padding

        params = self.params
        chunks = self.plan(rows, budget)
        weights = self.micro_weights(rows, chunks)
        token_shares = token_weights(rows, chunks)  # metrics are token means (see metric_mean)
        self._zero_grads()
        metrics: dict[str, float] = {"loss": 0.0}
        bad: str | None = None
        for micro_index, (w, share, idx) in enumerate(zip(weights, token_shares, chunks)):
            micro = rows.select(idx)
            if budget is not None:
                micro = trim_padding(micro)
            loss, micro_metrics = self.loss(policy, micro)
            if self.options.rollout_correction.enabled and "rollout/is_weight_mean" not in micro_metrics:
                from palestra.config import ConfigError

                raise ConfigError(
                    f"optimizer.options.rollout_correction: {self.name}'s loss does not apply it (it calls neither "
                    "add_entropy_and_kl nor rollout_terms); set level to null"
                )
            value = float(loss.detach())
            if not math.isfinite(value) and bad is None:
                bad = f"non-finite loss ({value}) in pass {pass_index}, micro-batch {micro_index} ({micro.batch_size} rows)"
            # Backward even after a bad loss: every rank runs the same collectives (DDP hooks, grad_sync).
            self.precision.backward(loss * w)
            if probe and micro_index == 0:
                metrics.update(self.diagnostics_probe(policy, micro, w))
            metrics["loss"] += w * value
            for key, v in micro_metrics.items():
                if pass_index > 0 and key.startswith("rollout/"):
                    continue
                if key in MAX_METRICS:
                    metrics[key] = max(metrics.get(key, -math.inf), float(v))
                else:
                    metrics[key] = metrics.get(key, 0.0) + share * float(v)
        if bad is not None:
            # Make the skip collective: NaN gradients reach every rank through grad_sync, so all ranks skip.
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)
        self.context.grad_sync(params)
        if self.master is not None:
            self.master.grads_from(params)  # gradients to CPU memory; the steps run there
        optimizers = list(self.optimizers.values())
        for opt in optimizers:
            self.precision.unscale_(opt)
        max_norm = self.train.max_grad_norm if self.train.max_grad_norm is not None else math.inf
        grad_norm, norms = self.clip_gradients(self.stepped, max_norm)
        finite = math.isfinite(grad_norm) and all(math.isfinite(v) for v in norms.values())
        if bad is None and not finite and self.precision.scaler is None:
            bad = f"non-finite gradient norm ({grad_norm}) in pass {pass_index}"
        if bad is not None:
            self.precision.skip(optimizers)
            self._zero_grads()
            log.warning("%s.update: skipped the optimiser step: %s", self.name, bad)
            return None
        stepping = self.before_optimizer_step(self.stepped, max_norm)
        track = self.train.track_update_ratio
        before = [p.detach().clone() for p in self.policy_params] if track else []  # a copy of the weights: optional
        took = self.precision.step(optimizers)
        if took and self.master is not None:
            self.master.copy_to(params)
        self._zero_grads()
        self.after_optimizer_step(took)
        if self.precision.scaler is not None:
            metrics["amp/overflow"] = 0.0 if took else 1.0
        if took:  # an fp16 overflow pass has an inf norm and no update: it does not count in their means
            metrics.update(stepping)
            metrics.update(norms)
            metrics["grad/norm"] = grad_norm
            if track:
                metrics["grad/update_ratio"] = update_ratio(before, self.policy_params)
        return metrics

    # ---- loss helpers ----------------------------------------------------------------------------------
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

    def clipped_loss(self, policy: Any, batch: Experience, *, kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
        """The aggregated clipped surrogate on ``batch`` minus the entropy bonus, plus ``kl_coef`` * KL when > 0;
        clipping at the options' ``clip_eps`` / ``clip_eps_high`` (None: symmetric), KL by ``kl_estimator``."""
        o = self.options
        scores = self.score(policy, batch)
        per_token, metrics = self.surrogate_terms(
            scores, batch,
            clip_low=o.clip_eps,
            clip_high=o.clip_eps_high if o.clip_eps_high is not None else o.clip_eps,
            kl_coef=kl_coef, kl_estimator=o.kl_estimator,
        )
        return self.aggregate(per_token, batch.completion_mask), self.floats(metrics)

    def surrogate_terms(
        self,
        scores: Any,
        batch: Experience,
        *,
        clip_low: float,
        clip_high: float,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate per token (:func:`palestra.rl.clipped_surrogate`) with the ratio taken against
        :meth:`proximal_logprobs`, then :meth:`add_entropy_and_kl` (rollout correction, entropy bonus, KL); metric
        tensors ``policy/clip_frac``, ``policy/ratio_mean``, ``policy/entropy``, ``rollout/*`` and, whenever the
        batch has reference log-probs, ``policy/kl``."""
        from palestra.rl.losses import clipped_surrogate

        per_token, m = clipped_surrogate(
            scores.logprobs, self.proximal_logprobs(scores, batch), batch.advantages, batch.completion_mask,
            clip_low, clip_high,
        )
        metrics = {"policy/clip_frac": m["clip_frac"], "policy/ratio_mean": m["ratio_mean"]}
        per_token = self.add_entropy_and_kl(per_token, scores, batch, metrics, kl_coef=kl_coef, kl_estimator=kl_estimator)
        return per_token, metrics

    def add_entropy_and_kl(
        self,
        per_token: torch.Tensor,
        scores: Any,
        batch: Experience,
        metrics: dict[str, torch.Tensor],
        *,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
    ) -> torch.Tensor:
        """``w * per_token - entropy_coef * entropy + kl_coef * KL``, ``w`` the rollout-correction weights
        (:meth:`rollout_terms`; 1 with the correction off); adds the rollout, entropy and KL metrics.

        ``per_token`` is the policy-gradient term alone: every loss calls this last, so that each gets the
        correction (the entropy bonus and the KL term are not reweighted)."""
        from palestra.rl.kl import kl_divergence

        mask = batch.completion_mask
        per_token = self.rollout_terms(per_token, scores, batch, metrics)
        if scores.entropy is not None:
            if self.options.entropy_coef > 0:
                per_token = per_token - self.options.entropy_coef * scores.entropy
            metrics["policy/entropy"] = self.metric_mean(scores.entropy, mask)
        if batch.ref_logprobs is not None:
            kl = kl_divergence(scores.logprobs, batch.ref_logprobs.to(scores.logprobs.dtype), mask, kl_estimator)
            if kl_coef > 0:
                per_token = per_token + kl_coef * kl
            metrics["policy/kl"] = self.metric_mean(kl, mask)
        elif kl_coef > 0:
            raise ValueError(f"{self.name}: the KL term needs batch.ref_logprobs; run prepare() with a reference policy")
        return per_token

    # ---- rollout correction ------------------------------------------------------------------------------
    def proximal_logprobs(self, scores: Any, batch: Experience) -> torch.Tensor:
        """The log-probs a policy ratio is taken against: the behaviour log-probs, or, with
        ``rollout_correction`` on, the learner's own before the update (the proximal policy). Those are
        ``batch.old_logprobs`` when the update set them (several passes), else this forward's, detached: in
        the only pass no optimiser step has happened yet, so they are exactly the pre-update values."""
        if not self.options.rollout_correction.enabled:
            return batch.behaviour_logprobs
        if batch.old_logprobs is not None:
            return batch.old_logprobs
        return scores.logprobs.detach()

    def rollout_terms(self, per_token: torch.Tensor, scores: Any, batch: Experience, metrics: dict[str, Any]) -> torch.Tensor:
        """``per_token`` times the rollout-correction weights (unchanged with the correction off), and the
        ``rollout/*`` metrics (:func:`palestra.rl.rollout_correction.rollout_mismatch`), whatever the option.

        :meth:`add_entropy_and_kl` calls this; a loss that does not use it calls this on its policy-gradient term."""
        from palestra.rl.rollout_correction import rollout_mismatch

        learner = batch.old_logprobs if batch.old_logprobs is not None else scores.logprobs
        weights, m = rollout_mismatch(
            learner, batch.behaviour_logprobs, batch.completion_mask, self.options.rollout_correction
        )
        metrics.update({f"rollout/{k}": v for k, v in m.items()})
        return per_token if weights is None else per_token * weights

    # ---- diagnostics -----------------------------------------------------------------------------------
    def entropy_term(self, scores: Any, batch: Experience) -> torch.Tensor:
        """The entropy bonus's part of the loss, ``-entropy_coef * aggregate(entropy)`` (what
        :meth:`add_entropy_and_kl` adds per token, aggregated); ``diag/entropy_grad_share`` differentiates it."""
        return -self.options.entropy_coef * self.aggregate(scores.entropy, batch.completion_mask)

    def group_diagnostics(self, batch: Experience) -> dict[str, float]:
        """``diag/tied_group_frac``, ``diag/near_tie_group_frac``, ``diag/adv_abs_mean_near_tie`` of the fresh
        rows (:func:`palestra.rl.stats.group_tie_stats`); nothing when no group has two rows."""
        from palestra.rl.stats import group_tie_stats

        stats = group_tie_stats(
            batch.rewards, batch.group_ids, batch.advantages, batch.completion_mask, self.options.diagnostics_tie_std
        )
        return {f"diag/{k}": v for k, v in stats.items()}

    def diagnostics_probe(self, policy: Any, micro: Experience, weight: float) -> dict[str, float]:
        """The costlier diagnostics, on ``micro`` right after its backward as the first micro-batch of a pass
        (so the gradients hold its gradient alone):

        * ``diag/entropy_grad_share``: ``||grad of the entropy term|| / ||grad of the whole loss||`` over the
          policy's parameters, on this micro-batch: one more forward and backward of it (the loss's graph is gone),
          its gradients kept apart and the loss's put back. 0 without an entropy bonus (nothing is computed);
          left out when the loss's gradient is 0 or not finite;
        * ``diag/logit_norm`` and ``diag/hidden_norm``: the mean L2 norm of the logits (before the temperature)
          and of the final hidden states at the valid completion positions, from one no-grad forward of the
          trunk (a :class:`~palestra.models.policy.CausalLMPolicy` only; logits in chunks of 256 positions).

        Nothing under FSDP (sharded gradients; the extra forwards would be collectives).
        """
        import torch

        from palestra.models.policy import CausalLMPolicy

        if self.context.fsdp:  # sharded gradients and gathered forwards: not worth the collectives
            return {}
        out: dict[str, float] = {}
        if self.options.entropy_coef == 0:
            out["diag/entropy_grad_share"] = 0.0
        else:
            params = self.policy_params
            total = _grad_norm(params)
            kept = [p.grad for p in params]
            for p in params:
                p.grad = None
            scores = self.score(policy, micro)
            self.precision.backward(self.entropy_term(scores, micro) * weight)  # scaled like the loss: the scale cancels
            entropy = _grad_norm(params)
            for p, g in zip(params, kept):
                p.grad = g
            if total > 0 and math.isfinite(total) and math.isfinite(entropy):
                out["diag/entropy_grad_share"] = entropy / total
        if isinstance(policy, CausalLMPolicy):
            out.update(_logit_norms(policy, micro, self.autocast()))
        return out

    @staticmethod
    def floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
        """Metric tensors as python floats (one device sync)."""
        import torch

        keys = list(metrics)
        values = [metrics[k] for k in keys]
        tensors = [v.detach().float().reshape(()) for v in values if isinstance(v, torch.Tensor)]
        stacked = iter(torch.stack(tensors).tolist()) if tensors else iter(())
        return {k: (next(stacked) if isinstance(v, torch.Tensor) else float(v)) for k, v in zip(keys, values)}

    # ---- checkpoints -------------------------------------------------------------------------------------
    def _optimizer_states(self) -> dict[str, Any]:
        """Each optimiser's state dict; under FSDP2 the full (unsharded) state, gathered on every rank.

        An optimiser that has not stepped yet (MAPPO's shared layers inside their update window) is saved as it is:
        torch's FSDP helper would first give it a zero-learning-rate step to create its state, which moves AdamW's
        step count and so changes every later update of the run.
        """
        if not self.context.fsdp:
            return {name: opt.state_dict() for name, opt in self.optimizers.items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            name: get_optimizer_state_dict(self.groups[name].module, opt, options=full) if opt.state else opt.state_dict()
            for name, opt in self.optimizers.items()
        }

    def _load_optimizer_states(self, states: Mapping[str, Any]) -> None:
        if not self.context.fsdp:
            for name, opt in self.optimizers.items():
                opt.load_state_dict(states[name])
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = StateDictOptions(full_state_dict=True)
        for name, opt in self.optimizers.items():
            if states[name]["state"]:
                set_optimizer_state_dict(self.groups[name].module, opt, states[name], options=full)
            else:  # saved before its first step (see _optimizer_states): only the learning rates and options
                opt.load_state_dict(states[name])

    def state_dict(self) -> dict[str, Any]:
        """Optimisers, LR schedules, the shuffling generator and the subclass's extra state; plus the fp16 loss
        scaler's state (``precision``, only under fp16) and the CPU master weights (``master``, only under
        ``train.offload_optimizer``). A single-group algorithm saves ``optimizer`` / ``scheduler``; one with
        several groups ``optimizers`` / ``schedulers`` by group name. Collective under FSDP2 (every rank calls it)."""
        self._require_setup("state_dict")
        optimizers = self._optimizer_states()
        schedulers = {name: s.state_dict() for name, s in self.schedulers.items()}
        if list(self.optimizers) == ["policy"]:
            state: dict[str, Any] = {"optimizer": optimizers["policy"], "scheduler": schedulers["policy"]}
        else:
            state = {"optimizers": optimizers, "schedulers": schedulers}
        state["shuffle_generator"] = self.shuffle_generator.get_state()
        state["extra"] = self.extra_state()
        if self.precision.scaler is not None:
            state["precision"] = self.precision.state_dict()
        if self.master is not None:
            state["master"] = [m.clone() for m in self.master.master]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`setup` with the restored policy).

        ``precision`` and ``master`` may be missing (a run saved in another precision or without offload): the
        scaler then starts fresh and the master copy is the policy's weights.
        """
        self._require_setup("load_state_dict")
        single = list(self.optimizers) == ["policy"]
        want = {"optimizer", "scheduler"} if single else {"optimizers", "schedulers"}
        want |= {"shuffle_generator", "extra"}
        optional = {"precision", "master"}
        if not want <= set(state) <= want | optional:
            raise KeyError(
                f"{self.name}.load_state_dict: missing keys {sorted(want - set(state))}, "
                f"unexpected keys {sorted(set(state) - want - optional)}"
            )
        if single:
            optimizers, schedulers = {"policy": state["optimizer"]}, {"policy": state["scheduler"]}
        else:
            optimizers, schedulers = state["optimizers"], state["schedulers"]
            if set(optimizers) != set(self.optimizers):
                raise KeyError(
                    f"{self.name}.load_state_dict: optimisers {sorted(optimizers)} saved, {sorted(self.optimizers)} here "
                    "(the parameter groups differ: the agents, or an option such as per_agent_optimizer)"
                )
        self._load_optimizer_states(optimizers)
        for name, s in self.schedulers.items():
            s.load_state_dict(schedulers[name])
        self.shuffle_generator.set_state(state["shuffle_generator"])
        self.load_extra_state(state["extra"])
        self.precision.load_state_dict(state.get("precision"))
        if self.master is not None:
            import torch

            saved = state.get("master")
            if saved is None:
                self.master.load_from(self.params)
            else:
                with torch.no_grad():
                    for m, s in zip(self.master.master, saved):
                        m.copy_(s)


MAX_METRICS = frozenset({"rollout/logp_gap_max"})  # combined over micro-batches by their maximum


def _grad_norm(params: Sequence[Any]) -> float:
    """The L2 norm of the gradients of ``params`` (those that have one), in float64."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().double().square().sum().cpu()
    return float(total.sqrt())


def _logit_norms(policy: Any, batch: Experience, autocast: Any) -> dict[str, float]:
    """Mean L2 norms of the final hidden states and of the logits at ``batch``'s valid completion positions,
    by one no-grad forward of ``policy.trunk`` (the positions :meth:`CausalLMPolicy.score` scores)."""
    import torch

    p, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    n = int(batch.completion_mask.sum())
    if n == 0:
        return {}
    with torch.no_grad(), autocast:
        hidden, _ = policy.trunk(
            torch.cat([batch.prompt_ids, batch.completion_ids], dim=1), mask, (mask.long().cumsum(-1) - 1).clamp(min=0)
        )
        states = hidden[:, p - 1 : p + t - 1][batch.completion_mask]  # [n, H]
        hidden_sum = torch.linalg.vector_norm(states.float(), dim=-1).double().sum()
        logit_sum = torch.zeros((), dtype=torch.float64, device=states.device)
        for chunk in states.split(256):  # never all positions' [n, V] logits at once
            logit_sum += torch.linalg.vector_norm(policy.logits(chunk).float(), dim=-1).double().sum()
    return {"diag/hidden_norm": float(hidden_sum) / n, "diag/logit_norm": float(logit_sum) / n}


def agent_rows(model: Any, agent_ids: Sequence[Any]) -> dict[str, Any]:
    """``{"agent_ids": ...}`` for a policy that routes rows to per-agent parameters (a multi-agent policy)."""
    from palestra.multiagent.sharing import MultiAgentPolicy

    return {"agent_ids": list(agent_ids)} if isinstance(model, MultiAgentPolicy) else {}


def token_weights(batch: Experience, chunks: Sequence[torch.Tensor]) -> list[float]:
    """Each chunk's share of the batch's valid tokens (its share of rows when there are no tokens)."""
    tokens = batch.completion_mask.sum(-1)
    total = int(tokens.sum())
    if total == 0:
        return [len(idx) / batch.batch_size for idx in chunks]
    return [int(tokens[idx].sum()) / total for idx in chunks]


def update_ratio(before: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> float:
    """``||theta_after - theta_before|| / ||theta_before||`` over all parameters (0 when theta is 0)."""
    import torch
    from torch.distributed.tensor import DTensor

    delta = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for b, p in zip(before, params):
        # float32 norms (torch sums them in cascades), squared in float64: float64 copies of every weight cost a
        # quarter second a step on a 4-layer Llama with a 32k vocabulary, for a monitoring figure
        d = torch.linalg.vector_norm((p.detach() - b).float()).double().square()
        n = torch.linalg.vector_norm(b.float()).double().square()
        if isinstance(d, DTensor):  # FSDP2 shards are DTensors: their sums are partial until gathered
            d, n = d.full_tensor(), n.full_tensor()
        delta += d.cpu()
        norm += n.cpu()
    return float(delta.sqrt() / norm.sqrt()) if float(norm) > 0 else 0.0


def check_option(condition: bool, key: str, message: str) -> None:
    """Raise :class:`OptionError` for ``key`` unless ``condition`` (for options' ``__post_init__``)."""
    if not condition:
        raise OptionError(key, message)
