"""What the learner measures about an update besides the loss: group ties, the entropy bonus's share of the
gradient, logit and hidden-state norms, and the relative size of the weight update.

``diag/*`` group-tie metrics are cheap and logged on every update (:func:`group_diagnostics`); the costlier
``diag/entropy_grad_share`` / ``diag/logit_norm`` / ``diag/hidden_norm`` run on one micro-batch of every
``options.diagnostics_every``-th update (:func:`diagnostics_probe`); ``grad/update_ratio`` is
:func:`update_ratio`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palestra.types import Experience

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_METRICS", "diagnostics_probe", "floats", "group_diagnostics", "update_ratio"]

MAX_METRICS = frozenset({"rollout/logp_gap_max"})  # combined over micro-batches by their maximum


def floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metric tensors as python floats (one device sync)."""
    import torch

    keys = list(metrics)
    values = [metrics[k] for k in keys]
    tensors = [v.detach().float().reshape(()) for v in values if isinstance(v, torch.Tensor)]
    stacked = iter(torch.stack(tensors).tolist()) if tensors else iter(())
    return {k: (next(stacked) if isinstance(v, torch.Tensor) else float(v)) for k, v in zip(keys, values)}


def group_diagnostics(batch: Experience, tie_std: float) -> dict[str, float]:
    """``diag/tied_group_frac``, ``diag/near_tie_group_frac``, ``diag/adv_abs_mean_near_tie`` of the fresh
    rows (:func:`palestra.rl.stats.group_tie_stats`); nothing when no group has two rows."""
    from palestra.rl.stats import group_tie_stats

    stats = group_tie_stats(batch.rewards, batch.group_ids, batch.advantages, batch.completion_mask, tie_std)
    return {f"diag/{k}": v for k, v in stats.items()}


def diagnostics_probe(
    policy: Any,
    micro: Experience,
    weight: float,
    *,
    params: Sequence[Any],
    entropy_coef: float,
    entropy_loss: Callable[[Experience], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    autocast: Any,
) -> dict[str, float]:
    """The costlier diagnostics, on ``micro`` right after its backward as the first micro-batch of a pass
    (so the gradients of ``params`` hold its gradient alone):

    * ``diag/entropy_grad_share``: ``||grad of the entropy term|| / ||grad of the whole loss||`` over ``params``, on
      this micro-batch: one more forward and backward of it (``entropy_loss(micro)``, the loss's graph is gone), its
      gradients kept apart and the loss's put back. 0 without an entropy bonus (nothing is computed); left out when
      the loss's gradient is 0 or not finite;
    * ``diag/logit_norm`` and ``diag/hidden_norm``: the mean L2 norm of the logits (before the temperature)
      and of the final hidden states at the valid completion positions, from one no-grad forward of the
      trunk (a :class:`~palestra.models.policy.CausalLMPolicy` only; logits in chunks of 256 positions).
    """
    from palestra.models.policy import CausalLMPolicy

    out: dict[str, float] = {}
    if entropy_coef == 0:
        out["diag/entropy_grad_share"] = 0.0
    else:
        total = _grad_norm(params)
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        backward(entropy_loss(micro) * weight)  # scaled like the loss: the scale cancels
        entropy = _grad_norm(params)
        for p, g in zip(params, kept):
            p.grad = g
        if total > 0 and math.isfinite(total) and math.isfinite(entropy):
            out["diag/entropy_grad_share"] = entropy / total
    if isinstance(policy, CausalLMPolicy):
        out.update(_logit_norms(policy, micro, autocast))
    return out


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
    from palestra.models.policy import attended

    mask = torch.cat([batch.prompt_mask, attended(batch.completion_mask)], dim=1)
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
