"""The learner's micro-batch plans: how many rows each forward sees, and what happens when one does not fit.

:class:`MicroBatchPlanner` decides a pass's micro-batches: ``train.grad_accum`` equal splits of a shuffled order, or
token-budget packs (``train.token_budget``; ``train.auto_micro_batch`` sizes the budget from free memory). Under
``auto_micro_batch`` an out-of-memory error halves the budget and retries (:meth:`MicroBatchPlanner.with_backoff`),
and the budget it learnt caps every later plan. :meth:`MicroBatchPlanner.score` scores a whole batch without
gradients in the update's micro-batch size (reference log-probs, rollout-time values, pre-update log-probs). The
packing itself is :mod:`palestra.scale.micro_batching`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from palestra.types import Experience

if TYPE_CHECKING:
    import torch

__all__ = ["MicroBatchPlanner"]

log = logging.getLogger("palestra.engine.learner")


class MicroBatchPlanner:
    """Micro-batch plans, token budgets and out-of-memory back-off for one learner.

    ``name`` prefixes error messages; ``on_out_of_memory`` drops the gradients a failed attempt left (the learner's).
    ``shuffle_generator`` orders rows between micro-batches; it is checkpointed by the learner.
    """

    def __init__(
        self,
        name: str,
        train: Any,
        policy: Any,
        params: Sequence[Any],
        precision: Any,
        shuffle_generator: torch.Generator,
        on_out_of_memory: Callable[[], None],
    ) -> None:
        self.name, self.train, self.policy, self.params, self.precision = name, train, policy, params, precision
        self.shuffle_generator = shuffle_generator
        self.on_out_of_memory = on_out_of_memory
        # train.auto_micro_batch: the highest token budget known to fit (lowered by each out-of-memory back-off).
        self.auto_budget_cap: int | None = None

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
            self.policy, self.params[0].device, width, elem, checkpointing=t.gradient_checkpointing
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

    def with_backoff(
        self, batch: Experience, budget: int | None, attempt: Callable[[int | None], Any], what: str
    ) -> Any:
        """``attempt(budget)``; under ``train.auto_micro_batch`` an out-of-memory error halves the budget and
        retries, until a plan of one row per micro-batch fails too (then a one-line :class:`OutOfMemory`)."""
        from palestra.scale.micro_batching import (
            OutOfMemory,
            free_cached_memory,
            is_out_of_memory,
            plan_micro_batches,
            row_tokens,
        )

        while True:
            try:
                return attempt(budget)
            except Exception as e:
                if not (self.train.auto_micro_batch and budget is not None and is_out_of_memory(e)):
                    raise
                self.on_out_of_memory()
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
                    "(train.auto_micro_batch)",
                    self.name,
                    what,
                    budget,
                    smaller,
                )
                budget = smaller
                self.auto_budget_cap = smaller

    def score(
        self, model: Any, batch: Experience, autocast: Callable[[], Any], temperature: float, *, values: bool = False
    ) -> Any:
        """``model.score`` over ``batch`` in the update's micro-batch size (memory like a training step), under
        ``autocast()``; with a token budget, in token-budget packs of trimmed rows. No gradients are kept by the
        caller's ``torch.no_grad``."""
        budget = self.token_budget(batch)
        return self.with_backoff(
            batch, budget, lambda b: self._score(model, batch, b, autocast, temperature, values), "score"
        )

    def _score(
        self,
        model: Any,
        batch: Experience,
        budget: int | None,
        autocast: Callable[[], Any],
        temperature: float,
        values: bool,
    ) -> Any:
        import torch

        from palestra.models.policy import TokenScores
        from palestra.scale.micro_batching import trim_padding

        n = batch.batch_size
        if budget is None:  # the update's micro-batch size, in row order, untrimmed
            size = max(1, math.ceil(n / self.train.grad_accum))
            plan = [torch.arange(start, min(start + size, n)) for start in range(0, n, size)]
        else:
            plan = self.plan(batch, budget, shuffle=False)
        shape, device = tuple(batch.completion_ids.shape), batch.completion_ids.device
        logprobs = torch.zeros(shape, dtype=torch.float32, device=device)
        vals = torch.zeros(shape, dtype=torch.float32, device=device) if values else None
        for idx in plan:
            micro = batch.select(idx)
            if budget is not None:
                micro = trim_padding(micro)
            with autocast():
                out = model.score(
                    micro.prompt_ids,
                    micro.prompt_mask,
                    micro.completion_ids,
                    micro.completion_mask,
                    temperature=temperature,
                    entropy=False,
                    values=values,
                    agent_ids=list(micro.agent_ids),
                )
            rows, width = idx.to(device), out.logprobs.shape[1]
            logprobs[rows, :width] = out.logprobs.float()
            if vals is not None:
                vals[rows, :width] = out.values.float()
        return TokenScores(logprobs=logprobs, values=vals)
