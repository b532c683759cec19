"""The policy-gradient losses every algorithm shares: the clipped surrogate, the (clipped) value loss, and the
aggregation of per-token losses into one number.

Losses come back **per token** (``[B, T]``, 0 at padding), so that the caller picks the aggregation (token
mean, sequence mean, per-agent weights), with detached 0-dim metric tensors, so that a caller converts them all
to floats with one device sync. The loss math runs in float32; gradients flow through ``logp`` / ``values``
only, every other input is data.
"""

from __future__ import annotations

import torch

from palestra.rl.checks import FLOAT_DTYPES, as_mask, check_same_shape, check_tensor, per_token
from palestra.rl.names import LOSS_AGGREGATIONS
from palestra.rl.stats import masked_mean

__all__ = ["aggregate", "clipped_surrogate", "value_loss"]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def clipped_surrogate(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token: ``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``.

    ``r = exp(logp - behaviour_logp)`` (the log-ratio is 0 at padding). ``adv`` is ``[B, T]`` or ``[B]`` (one
    advantage per row, repeated over its tokens); ``clip_high`` None is symmetric clipping (DAPO's clip-higher
    sets it above ``clip_low``). Metrics over valid tokens: ``clip_frac`` (the clipped branch is active, so
    the token's gradient is cut: ``r < 1 - clip_low`` with ``A < 0``, or ``r > 1 + clip_high`` with ``A > 0``),
    ``ratio_mean``, and ``approx_kl`` (the k3 estimate ``E[(r - 1) - log r]`` of KL(behaviour || current)).
    """
    fn = "clipped_surrogate"
    check_tensor(fn, "logp", logp, FLOAT_DTYPES)
    check_tensor(fn, "behaviour_logp", behaviour_logp, FLOAT_DTYPES)
    check_same_shape(fn, "behaviour_logp", behaviour_logp, "logp", logp)
    check_tensor(fn, "adv", adv, FLOAT_DTYPES)
    a = _f32(per_token(fn, "adv", adv, "logp", logp).detach())
    m = as_mask(fn, mask, "logp", logp)
    lo = float(clip_low)
    hi = float(clip_high) if clip_high is not None else lo
    if not (0 < lo < 1) or not hi > 0:
        raise ValueError(f"{fn}: clip_low must be in (0, 1) and clip_high > 0, got clip_low={clip_low}, clip_high={clip_high}")
    lp = _f32(logp)
    log_ratio = torch.where(m, lp - _f32(behaviour_logp.detach()), torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    loss = -torch.minimum(ratio * a, ratio.clamp(1.0 - lo, 1.0 + hi) * a)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    with torch.no_grad():
        clipped = ((ratio < 1.0 - lo) & (a < 0)) | ((ratio > 1.0 + hi) & (a > 0))
        metrics = {
            "clip_frac": masked_mean(clipped, m),
            "ratio_mean": masked_mean(ratio, m),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, m),
        }
    return loss, metrics


def _huber(err: torch.Tensor, delta: float) -> torch.Tensor:
    a = err.abs()
    return torch.where(a <= delta, 0.5 * err * err, delta * (a - 0.5 * delta))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor | None,
    clip: float | None = 0.2,
    huber_delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss per token: ``max(f(R - V), f(R - V_clip))``, ``V_clip = V_old + clip(V - V_old, -clip, clip)``.

    ``f`` is ``0.5 * e^2``, or the Huber loss with ``huber_delta`` (MAPPO uses delta 10 on normalised targets:
    robust to the occasional huge return). Pass ``values``, ``old_values`` and ``returns`` in the same units.
    ``clip=None`` turns clipping off; clipping keeps the critic near the one that produced the advantages, as
    the actor's clip does for the policy. Metrics: ``value_clip_frac`` (the clipped branch is the larger) and
    ``value_mse`` (``mean (V - R)^2``), over valid positions.
    """
    fn = "value_loss"
    check_tensor(fn, "values", values, FLOAT_DTYPES)
    check_tensor(fn, "old_values", old_values, FLOAT_DTYPES)
    check_tensor(fn, "returns", returns, FLOAT_DTYPES)
    check_same_shape(fn, "old_values", old_values, "values", values)
    check_same_shape(fn, "returns", returns, "values", values)
    m = as_mask(fn, mask, "values", values)
    if clip is not None and not clip > 0:
        raise ValueError(f"{fn}: clip must be > 0 or None, got {clip}")
    if huber_delta is not None and not huber_delta > 0:
        raise ValueError(f"{fn}: huber_delta must be > 0 or None, got {huber_delta}")
    v, old, ret = _f32(values), _f32(old_values.detach()), _f32(returns.detach())

    def f(e: torch.Tensor) -> torch.Tensor:
        return 0.5 * e * e if huber_delta is None else _huber(e, float(huber_delta))

    loss = f(ret - v)
    with torch.no_grad():
        mse = masked_mean((ret - v) ** 2, m)
    if clip is not None:
        v_clip = old + (v - old).clamp(-float(clip), float(clip))
        loss_clip = f(ret - v_clip)
        with torch.no_grad():
            frac = masked_mean(loss_clip > loss, m)
        loss = torch.maximum(loss, loss_clip)
    else:
        frac = torch.zeros((), dtype=torch.float32, device=v.device)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    return loss, {"value_clip_frac": frac, "value_mse": mse}


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: str, norm_length: int = 1) -> torch.Tensor:
    """Per-token ``x [B, T]`` -> a scalar (masked positions ignored):

    * ``token_mean``: the mean over all valid tokens of the batch (DAPO's token-level loss; TRL's ``"dapo"``);
    * ``seq_mean_token_mean``: the mean over rows of each row's token mean (the original GRPO; length-biased);
    * ``seq_mean_token_sum_norm``: the mean over rows of each row's token sum / ``norm_length`` (Dr.GRPO).
    """
    m = mask.to(x.dtype)
    if agg == "token_mean":
        return (x * m).sum() / m.sum().clamp(min=1)
    if agg == "seq_mean_token_mean":
        return ((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if agg == "seq_mean_token_sum_norm":
        return ((x * m).sum(-1) / norm_length).mean()
    raise ValueError(f"aggregate: unknown loss aggregation {agg!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}")
