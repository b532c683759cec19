"""The base of Palestra's RL algorithms: :class:`Algorithm` (implements :class:`palestra.types.PolicyOptimizer`).

A subclass declares its ``Options`` dataclass (extending :class:`AlgorithmOptions`) and implements two
methods:

* ``advantages(batch) -> batch``: fill ``batch.advantages`` (and ``returns`` / ``old_values``) for a fresh
  rollout; runs under ``torch.no_grad`` from :meth:`Algorithm.prepare`, after the reference log-probs;
* ``loss(policy, batch) -> (loss, metrics)``: the differentiable scalar on one micro-batch, aggregated
  with :meth:`Algorithm.aggregate`, and float metrics that are token means (:meth:`Algorithm.metric_mean`).

The base does everything else: option checking, the AdamW optimiser and learning-rate schedule, the
update loop (``train.updates_per_batch`` passes, each shuffled and split into ``train.grad_accum``
micro-batches, one optimiser step per pass, gradient clipping), and checkpoints. It also applies the
scale and memory switches of ``train``: mixed precision (:mod:`palestra.precision`: autocast around the
policy forward only, fp16 loss scaling), token-budget and automatic micro-batches with out-of-memory
back-off, CPU offload of the reference and the optimiser, gradient checkpointing (:mod:`palestra.memory`),
and skipping a step whose loss or gradient norm is not finite (``train/skipped``) instead of raising.

Micro-batches are weighted so that a pass's gradient equals the full-batch gradient whatever
``grad_accum`` is: with ``loss_agg="token_mean"`` each micro-batch counts by its share of the pass's
tokens, otherwise by its share of rows (see :meth:`Algorithm.micro_weights`). TRL calls the former
"dapo" (tokens of the whole accumulated batch); a per-micro-batch token mean divided by ``grad_accum``
would instead weight short micro-batches' tokens more. Metrics are averaged over micro-batches by token
share (so they equal the full batch's token means) and over passes; ``grad/norm`` and
``grad/update_ratio`` are the mean over passes, ``lr`` the rate used by this update.

Shared pieces used by the built-ins: :func:`kl_divergence` (Schulman's k1/k2/k3 estimators),
:func:`group_size_of` (the group structure of ``batch.group_ids``), :func:`last_token_rewards` (a
sequence reward on each row's last real token), :meth:`Algorithm.surrogate_terms` (the clipped PPO
surrogate with entropy bonus and optional KL loss).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .config import OptionError, check_options, option
from .types import Experience

if TYPE_CHECKING:  # torch is imported where it is used, so that loading the optimizer plugins stays light
    import torch

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "Algorithm",
    "AlgorithmOptions",
    "group_size_of",
    "kl_divergence",
    "kl_shaped_rewards",
    "last_token_rewards",
    "lr_factor",
]

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")

log = logging.getLogger("palestra.algorithm")

# exp() of a log-ratio beyond this overflows float32 long before it means anything; k3 clamps there.
_MAX_LOG_RATIO = 20.0


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


# ---- shared math ------------------------------------------------------------------------------------
def kl_divergence(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimates of KL(pi || pi_ref) from tokens sampled from pi (Schulman, "Approximating KL").

    With ``log_r = ref_logp - logp``: ``k1 = -log_r`` (unbiased, high variance, can be negative),
    ``k2 = log_r**2 / 2`` (biased, low variance), ``k3 = exp(log_r) - 1 - log_r`` (unbiased, >= 0, low
    variance; ``log_r`` clamped to +-20 so that exp stays finite). Returns ``[B, T]``, 0 where ``mask`` is False.
    """
    import torch

    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"kl_divergence: logp {list(logp.shape)}, ref_logp {list(ref_logp.shape)} and mask "
            f"{list(mask.shape)} must have one shape"
        )
    log_r = ref_logp - logp
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"kl_divergence: unknown estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    return torch.where(mask, kl, torch.zeros_like(kl))


def group_size_of(group_ids: torch.Tensor, where: str) -> int:
    """The common size of the groups in ``group_ids`` [B]; each group's rows must be consecutive.

    Raises a one-line ValueError (prefixed with ``where``) when a group is split or sizes differ.
    """
    if group_ids.dim() != 1 or group_ids.numel() == 0:
        raise ValueError(f"{where}: batch.group_ids must have shape [B] with B >= 1, got {list(group_ids.shape)}")
    ids = group_ids.tolist()
    runs: list[int] = []
    seen: set[int] = set()
    for i, g in enumerate(ids):
        if i and g == ids[i - 1]:
            runs[-1] += 1
            continue
        if g in seen:
            raise ValueError(
                f"{where}: batch.group_ids {list(group_ids.shape)} must keep each group's rows consecutive; "
                f"group {g} appears again at row {i}"
            )
        seen.add(g)
        runs.append(1)
    if len(set(runs)) != 1:
        raise ValueError(
            f"{where}: groups in batch.group_ids {list(group_ids.shape)} must all have the same size "
            f"(train.group_size); got sizes {sorted(set(runs))}"
        )
    return runs[0]


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards ``[B, T]``: ``rewards[b]`` on row ``b``'s last real token, 0 elsewhere.

    A row without any real token gets nothing (it has no action to credit).
    """
    import torch

    b, t = mask.shape
    positions = torch.arange(t, device=mask.device).expand(b, t)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)
    out = torch.zeros((b, t), dtype=torch.float32, device=mask.device)
    has = last >= 0
    rows = torch.arange(b, device=mask.device)[has]
    out[rows, last[has]] = rewards[has].to(torch.float32)
    return out


def kl_shaped_rewards(batch: Experience, kl_coef: float, estimator: str) -> torch.Tensor:
    """Token rewards ``[B, T]``: the sequence reward on the last real token, minus ``kl_coef`` times the
    per-token KL estimate of the behaviour policy to the reference (``batch.ref_logprobs``) when ``kl_coef > 0``."""
    rewards = last_token_rewards(batch.rewards, batch.completion_mask)
    if kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_shaped_rewards: kl_coef > 0 needs batch.ref_logprobs (a reference policy)")
        kl = kl_divergence(batch.behaviour_logprobs.float(), batch.ref_logprobs.float(), batch.completion_mask, estimator)
        rewards = rewards - kl_coef * kl
    return rewards


def lr_factor(schedule: str, warmup_steps: int, total_steps: int):
    """The learning-rate multiplier after ``s`` completed updates (LambdaLR's argument).

    Warm-up rises linearly ``1/w, 2/w, ..., 1`` over the first ``w`` updates (never a zero-lr step);
    then ``constant`` stays at 1, ``linear`` falls towards 0 at ``total_steps``, ``cosine`` follows half a
    cosine to 0 at ``total_steps``. Neither decay reaches 0 within ``total_steps`` updates.
    """

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (s - warmup_steps) / span)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r}; choose constant, linear or cosine")

    return factor


# ---- the base class ---------------------------------------------------------------------------------
class Algorithm:
    """Base of the built-in policy optimisers (see the module docstring)."""

    name: ClassVar[str] = "algorithm"  # the registered name; prefixes error messages
    Options: ClassVar[type] = AlgorithmOptions
    needs_value_head: ClassVar[bool] = False
    routes_agents: ClassVar[bool] = True  # scores each row with its agent's parameters (see agent_rows)

    def __init__(self, **options: Any) -> None:
        import torch

        self.options = check_options(self.Options, options, where=self.name)
        self.policy: Any = None
        self.reference: Any = None
        self.train: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.temperature: float = 1.0
        self.norm_length: int = 1
        # Shuffles rows between micro-batches; its own generator so that sampling elsewhere does not move it.
        self.shuffle_generator = torch.Generator()
        # The trainable parameters on the training device, in the optimiser's order (the optimiser itself holds
        # CPU master copies under train.offload_optimizer).
        self.params: list[torch.nn.Parameter] = []
        self.precision: Any = None  # palestra.precision.Precision, built in setup()
        self.master: Any = None  # palestra.memory.CPUMasterWeights under train.offload_optimizer
        # Called with self.params after the last micro-batch's backward and before unscaling/clipping, when set:
        # the trainer's gradient all-reduce for data parallelism (default: nothing to sync).
        self.grad_sync: Callable[[list[torch.nn.Parameter]], None] | None = None
        # train.auto_micro_batch: the highest token budget known to fit (lowered by each out-of-memory back-off).
        self.auto_budget_cap: int | None = None

    # ---- what subclasses provide -------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        """True when the loss or the advantages use a frozen reference policy (a KL term)."""
        return False

    def advantages(self, batch: Experience) -> Experience:
        raise NotImplementedError

    def loss(self, policy: Any, batch: Experience) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def extra_state(self) -> dict[str, Any]:
        """State of the subclass beyond optimiser, schedule and shuffling (running moments, a replay buffer)."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        if state:
            raise KeyError(f"{self.name}.load_state_dict: unexpected extra state keys {sorted(state)}")

    # ---- lifecycle -------------------------------------------------------------------------------------
    def setup(self, policy: Any, train: Any, *, reference: Any = None) -> None:
        """Bind ``policy`` (and ``reference``), add a value head if needed, build AdamW and the LR schedule.

        Also applies the memory and precision switches of ``train``: gradient checkpointing on the policy,
        the reference moved to CPU memory (``offload_reference``), a CPU master copy for the optimiser
        (``offload_optimizer``), and the autocast/loss-scaling set-up (``precision``).
        """
        import torch

        from .config import ConfigError
        from .memory import CPUMasterWeights
        from .precision import Precision

        if self.needs_reference and reference is None:
            raise ValueError(f"{self.name}: the KL term needs a frozen reference policy; setup() got reference=None")
        self.policy, self.train = policy, train
        self.reference = reference if self.needs_reference else None
        if self.reference is not None:
            self.reference.requires_grad_(False)
            if getattr(train, "offload_reference", False):
                self.reference.to("cpu")  # visits the training device only in prepare() (memory.borrowed)
        if self.needs_value_head:
            policy.enable_value_head()
        if getattr(train, "gradient_checkpointing", False):
            toggle = getattr(policy, "set_gradient_checkpointing", None)
            if toggle is None:
                raise ConfigError(
                    f"train.gradient_checkpointing: the policy ({type(policy).__name__}) has no "
                    "set_gradient_checkpointing(on); set it to false"
                )
            toggle(True)
        params = [p for p in policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{self.name}: the policy ({type(policy).__name__}) has no trainable parameters")
        self.params = params
        self.precision = Precision(
            getattr(train, "precision", "fp32"), params[0].device.type, param_dtype=params[0].dtype
        )
        self.master = None
        stepped: list[torch.Tensor] = params
        if getattr(train, "offload_optimizer", False):
            self.master = CPUMasterWeights(params)
            stepped = self.master.master
        self.optimizer = torch.optim.AdamW(stepped, lr=train.lr, weight_decay=train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(train.lr_schedule, train.warmup_steps, train.steps)
        )
        o = self.options
        self.temperature = o.temperature if o.temperature is not None else (train.temperature or 1.0)
        self.norm_length = o.loss_norm_length if o.loss_norm_length is not None else train.max_new_tokens
        # Derived from the process seed (the trainer seeds torch from run.seed), offset so that it does not
        # replay the default generator's stream.
        self.shuffle_generator.manual_seed((torch.initial_seed() + 0x5EED_5EED) % (2**63))
        self.auto_budget_cap = None

    def _require_setup(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{self.name}.{what}: call setup(policy, train) first")

    def prepare(self, batch: Experience) -> Experience:
        """Reference log-probs (when there is a reference), then :meth:`advantages`; no gradients.

        An offloaded reference (``train.offload_reference``) is brought to the policy's device for the scoring
        and sent back to CPU memory afterwards.
        """
        import torch

        from .memory import borrowed

        self._require_setup("prepare")
        batch.validate()
        with torch.no_grad():
            if self.reference is not None:
                if getattr(self.train, "offload_reference", False):
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
        fixed = getattr(t, "token_budget", None)
        if not getattr(t, "auto_micro_batch", False):
            return fixed
        from .memory import auto_token_budget, row_tokens

        elem = 2 if self.precision is not None and self.precision.enabled else self.params[0].element_size()
        width = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
        budget = auto_token_budget(
            self.policy, self.params[0].device, width, elem,
            checkpointing=bool(getattr(t, "gradient_checkpointing", False)),
        )
        for cap in (fixed, self.auto_budget_cap, batch.batch_size * width):  # never more than the whole batch
            if cap is not None:
                budget = min(budget, cap)
        biggest = int(row_tokens(batch).max()) if batch.batch_size else 1
        return max(budget, biggest)  # one row per micro-batch at least; the back-off decides if even that fails

    def plan(self, batch: Experience, budget: int | None, *, shuffle: bool = True) -> list[torch.Tensor]:
        """Row indices of the micro-batches of one pass: ``train.grad_accum`` equal splits of a random order,
        or token-budget packs (:func:`palestra.memory.plan_micro_batches`)."""
        import torch

        from .memory import RowTooLong, plan_micro_batches

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
        from .memory import (
            OutOfMemory,
            free_cached_memory,
            is_out_of_memory,
            plan_micro_batches,
            row_tokens,
        )

        auto = bool(getattr(self.train, "auto_micro_batch", False))
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

        from .memory import trim_padding
        from .policy import TokenScores

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
    def batch_for_update(self, batch: Experience) -> Experience:
        """The rows one update trains on (a replay buffer adds old rows here)."""
        return batch

    def after_update(self, batch: Experience) -> None:
        """Called once an update on ``batch`` (the fresh rows) is done."""

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
        assert self.optimizer is not None and self.scheduler is not None
        rows = self.batch_for_update(batch)
        n, k = rows.batch_size, self.train.grad_accum
        budget = self.token_budget(rows)
        if budget is None and n < k:
            raise ValueError(f"{self.name}.update: the batch has {n} rows, fewer than train.grad_accum={k} micro-batches")
        passes = self.train.updates_per_batch
        lr = float(self.optimizer.param_groups[0]["lr"])
        results: list[dict[str, float]] = []
        for pass_index in range(passes):
            result = self._with_backoff(rows, budget, lambda b, i=pass_index: self._pass(policy, rows, i, b), "update")
            if result is None:  # a bad step: skip the rest of this update
                out = {"train/skipped": 1.0, "lr": lr, **self.precision.metrics()}
                if getattr(self.train, "auto_micro_batch", False) and self.auto_budget_cap is not None:
                    out["memory/token_budget"] = float(self.auto_budget_cap)
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
            self.scheduler.step()  # the schedule follows optimiser steps (an update lost to fp16 overflow is not one)
        self.after_update(batch)
        totals["lr"] = lr
        totals["train/skipped"] = 0.0
        totals.update(self.precision.metrics())
        if budget is not None:
            totals["memory/token_budget"] = float(budget)
        return totals

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None
        if self.master is not None:
            self.master.zero_grad()

    def _pass(self, policy: Any, rows: Experience, pass_index: int, budget: int | None) -> dict[str, float] | None:
        """One pass: micro-batch forwards and backwards, gradient sync, unscale, clip, step. None: a bad step."""
        import torch

        from .memory import trim_padding

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
            value = float(loss.detach())
            if not math.isfinite(value) and bad is None:
                bad = f"non-finite loss ({value}) in pass {pass_index}, micro-batch {micro_index} ({micro.batch_size} rows)"
            # Backward even after a bad loss: every rank runs the same collectives (DDP hooks, grad_sync).
            self.precision.backward(loss * w)
            metrics["loss"] += w * value
            for key, v in micro_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + share * float(v)
        if bad is not None:
            # Make the skip collective: NaN gradients reach every rank through grad_sync, so all ranks skip.
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)
        if self.grad_sync is not None:
            self.grad_sync(params)
        stepped: list[torch.Tensor] = params
        if self.master is not None:
            self.master.grads_from(params)  # gradients to CPU memory; the step runs there
            stepped = self.master.master
        self.precision.unscale_(self.optimizer)
        max_norm = self.train.max_grad_norm
        grad_norm = float(torch.nn.utils.clip_grad_norm_(stepped, max_norm if max_norm is not None else math.inf))
        if bad is None and not math.isfinite(grad_norm) and self.precision.scaler is None:
            bad = f"non-finite gradient norm ({grad_norm}) in pass {pass_index}"
        if bad is not None:
            self.precision.skip(self.optimizer)
            self._zero_grads()
            log.warning("%s.update: skipped the optimiser step: %s", self.name, bad)
            return None
        track = self.train.track_update_ratio
        before = [p.detach().clone() for p in params] if track else []  # a copy of the weights: optional
        took = self.precision.step(self.optimizer)
        if took and self.master is not None:
            self.master.copy_to(params)
        self._zero_grads()
        if self.precision.scaler is not None:
            metrics["amp/overflow"] = 0.0 if took else 1.0
        if took:  # an fp16 overflow pass has an inf norm and no update: it does not count in their means
            metrics["grad/norm"] = grad_norm
            if track:
                metrics["grad/update_ratio"] = update_ratio(before, params)
        return metrics

    # ---- loss helpers ----------------------------------------------------------------------------------
    def aggregate(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token ``x [B, T]`` -> a scalar, as ``options.loss_agg`` says (masked positions ignored)."""
        m = mask.to(x.dtype)
        agg = self.options.loss_agg
        if agg == "token_mean":
            return (x * m).sum() / m.sum().clamp(min=1)
        if agg == "seq_mean_token_mean":
            return ((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
        if agg == "seq_mean_token_sum_norm":
            return ((x * m).sum(-1) / self.norm_length).mean()
        raise ValueError(f"{self.name}: loss_agg: unknown aggregation {agg!r}")

    @staticmethod
    def metric_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The mean of ``x`` over valid tokens, detached: how metrics are reported, whatever ``loss_agg`` is."""
        m = mask.to(x.dtype)
        return ((x.detach() * m).sum() / m.sum().clamp(min=1))

    @staticmethod
    def token_advantages(batch: Experience) -> torch.Tensor:
        """``batch.advantages`` as ``[B, T]`` (a per-row advantage repeated over the row's tokens)."""
        import torch

        adv = batch.advantages
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(batch.completion_mask)
        return adv.to(torch.float32)

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
        """The clipped PPO surrogate per token, minus the entropy bonus, plus ``kl_coef`` * KL when > 0.

        ``ratio = exp(logp - behaviour_logp)``; ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.
        Returns the per-token loss ``[B, T]`` and metric tensors (clip fraction, ratio mean, entropy, KL).
        ``policy/kl`` is reported whenever the batch has reference log-probs.
        """
        import torch

        mask = batch.completion_mask
        adv = self.token_advantages(batch)
        logp = scores.logprobs
        log_ratio = torch.where(mask, logp - batch.behaviour_logprobs.to(logp.dtype), torch.zeros_like(logp))
        ratio = torch.exp(log_ratio)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
        with torch.no_grad():
            clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
            metrics = {
                "policy/clip_frac": self.metric_mean(clipped.to(logp.dtype), mask),
                "policy/ratio_mean": self.metric_mean(ratio, mask),
            }
        per_token = self.add_entropy_and_kl(per_token, scores, batch, metrics, kl_coef=kl_coef, kl_estimator=kl_estimator)
        return per_token, metrics

    def clipped_loss(self, policy: Any, batch: Experience, *, kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
        """The aggregated clipped surrogate on ``batch``, clipping at the options' ``clip_eps`` / ``clip_eps_high``
        (None: symmetric) and adding ``kl_coef`` * KL (``kl_estimator``) when > 0."""
        o = self.options
        scores = self.score(policy, batch)
        per_token, metrics = self.surrogate_terms(
            scores, batch,
            clip_low=o.clip_eps,
            clip_high=o.clip_eps_high if o.clip_eps_high is not None else o.clip_eps,
            kl_coef=kl_coef, kl_estimator=o.kl_estimator,
        )
        return self.aggregate(per_token, batch.completion_mask), self.floats(metrics)

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
        """``per_token - entropy_coef * entropy + kl_coef * KL``; adds the entropy and KL metrics."""
        mask = batch.completion_mask
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
    def state_dict(self) -> dict[str, Any]:
        """Optimiser, LR schedule, the shuffling generator and the subclass's extra state; plus the fp16 loss
        scaler's state (``precision``, only under fp16) and the CPU master weights (``master``, only under
        ``train.offload_optimizer``)."""
        self._require_setup("state_dict")
        assert self.optimizer is not None and self.scheduler is not None
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "shuffle_generator": self.shuffle_generator.get_state(),
            "extra": self.extra_state(),
        }
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
        assert self.optimizer is not None and self.scheduler is not None
        want = {"optimizer", "scheduler", "shuffle_generator", "extra"}
        optional = {"precision", "master"}
        if not want <= set(state) <= want | optional:
            raise KeyError(
                f"{self.name}.load_state_dict: missing keys {sorted(want - set(state))}, "
                f"unexpected keys {sorted(set(state) - want - optional)}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
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

def agent_rows(model: Any, agent_ids: Sequence[Any]) -> dict[str, Any]:
    """``{"agent_ids": ...}`` for a policy that routes rows to per-agent parameters (a multi-agent policy)."""
    return {"agent_ids": list(agent_ids)} if getattr(model, "routes_agents", False) else {}


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

    delta = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for b, p in zip(before, params):
        d = (p.detach().double() - b.double()).square().sum()
        n = b.double().square().sum()
        if hasattr(d, "full_tensor"):  # FSDP2 shards are DTensors: their sums are partial until gathered
            d, n = d.full_tensor(), n.full_tensor()
        delta += d.cpu()
        norm += n.cpu()
    return float(delta.sqrt() / norm.sqrt()) if float(norm) > 0 else 0.0


def check_option(condition: bool, key: str, message: str) -> None:
    """Raise :class:`OptionError` for ``key`` unless ``condition`` (for options' ``__post_init__``)."""
    if not condition:
        raise OptionError(key, message)
