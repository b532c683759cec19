"""The policy-gradient losses every algorithm shares: the clipped surrogate (PPO / GRPO, DAPO's clip-higher), GSPO's
sequence-level surrogate, CISPO's clipped-weight policy gradient, the (clipped) value loss, and the aggregation of
per-token losses into one number.

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

__all__ = ["aggregate", "cispo_surrogate", "clipped_surrogate", "gspo_surrogate", "value_loss"]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _policy_inputs(
    fn: str, logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked ``(logp as float32, per-token advantages, bool mask, masked log-ratio)`` for the policy losses."""
    check_tensor(fn, "logp", logp, FLOAT_DTYPES)
    check_tensor(fn, "behaviour_logp", behaviour_logp, FLOAT_DTYPES)
    check_same_shape(fn, "behaviour_logp", behaviour_logp, "logp", logp)
    check_tensor(fn, "adv", adv, FLOAT_DTYPES)
    a = _f32(per_token(fn, "adv", adv, "logp", logp).detach())
    m = as_mask(fn, mask, "logp", logp)
    lp = _f32(logp)
    log_ratio = torch.where(m, lp - _f32(behaviour_logp.detach()), torch.zeros_like(lp))
    return lp, a, m, log_ratio


def _clip_range(fn: str, clip_low: float, clip_high: float | None) -> tuple[float, float]:
    """``(clip_low, clip_high)`` as floats (``clip_high`` None: ``clip_low``), checked."""
    lo = float(clip_low)
    hi = float(clip_high) if clip_high is not None else lo
    if not (0 < lo < 1) or not hi > 0:
        raise ValueError(
            f"{fn}: clip_low must be in (0, 1) and clip_high > 0, got clip_low={clip_low}, clip_high={clip_high}"
        )
    return lo, hi


def _pessimistic(ratio: torch.Tensor, a: torch.Tensor, m: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """PPO's pessimistic clipped objective per token, ``-min(r * A, clip(r, 1 - lo, 1 + hi) * A)``, 0 at padding."""
    loss = -torch.minimum(ratio * a, ratio.clamp(1.0 - lo, 1.0 + hi) * a)
    return torch.where(m, loss, torch.zeros_like(loss))


def _clip_metrics(
    ratio: torch.Tensor, a: torch.Tensor, m: torch.Tensor, lo: float, hi: float, log_ratio: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``clip_frac`` (the clipped branch of ``ratio`` is active), ``ratio_mean``, and ``approx_kl`` (k3 of the token
    log-ratios), over valid tokens."""
    with torch.no_grad():
        clipped = ((ratio < 1.0 - lo) & (a < 0)) | ((ratio > 1.0 + hi) & (a > 0))
        return {
            "clip_frac": masked_mean(clipped, m),
            "ratio_mean": masked_mean(ratio, m),
            "approx_kl": masked_mean((torch.exp(log_ratio) - 1.0) - log_ratio, m),
        }


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
    _lp, a, m, log_ratio = _policy_inputs(fn, logp, behaviour_logp, adv, mask)
    lo, hi = _clip_range(fn, clip_low, clip_high)
    ratio = torch.exp(log_ratio)
    return _pessimistic(ratio, a, m, lo, hi), _clip_metrics(ratio, a, m, lo, hi, log_ratio)


def gspo_surrogate(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's clipped surrogate with a sequence-level ratio (Zheng et al. 2025), in its GSPO-token form, per token.

    ``s_i = exp(mean over row i's valid tokens of (logp - behaviour_logp))`` is the geometric mean of the row's
    token ratios. Each token carries ``s_it = sg[s_i] * exp(logp_t - sg[logp_t])``: its value is ``s_i`` and its
    gradient ``s_i * grad logp_t``, so every token of the row is clipped (or not) together and the gradient reaches
    every token. The loss per token is ``-min(s_it * A_it, clip(s_it, 1 - clip_low, 1 + clip_high) * A_it)``.
    With one advantage per row and ``seq_mean_token_mean`` aggregation this is exactly GSPO's sequence objective
    ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)`` in value and gradient. (With one advantage per row, any aggregation
    that weighs a row's tokens alike gives a differentiable ``s_i`` the same gradient; the token form differs, as
    it should, with per-token advantages or per-token weights such as rollout correction's.) ``clip_high`` None:
    ``clip_low``.

    The clip ranges are GSPO's small ones (the paper's 3e-4 / 4e-4): ``s_i`` is a per-token geometric mean, so it
    moves far less than a token ratio. Metrics over valid tokens: ``clip_frac`` (tokens of rows whose clipped branch
    is active), ``ratio_mean`` (``s_i`` averaged over tokens), ``approx_kl`` (k3, per token, as
    :func:`clipped_surrogate`).
    """
    fn = "gspo_surrogate"
    lp, a, m, log_ratio = _policy_inputs(fn, logp, behaviour_logp, adv, mask)
    lo, hi = _clip_range(fn, clip_low, clip_high)
    lengths = m.sum(-1, keepdim=True).clamp(min=1)
    with torch.no_grad():
        seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / lengths)  # [B, 1]; 1 for a row without tokens
    token_ratio = seq_ratio * torch.exp(lp - lp.detach())  # value s_i, gradient s_i * grad logp
    return _pessimistic(token_ratio, a, m, lo, hi), _clip_metrics(seq_ratio.expand_as(lp), a, m, lo, hi, log_ratio)


def cispo_surrogate(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float | None = None,
    clip_high: float = 4.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO's policy gradient with a clipped importance weight (MiniMax-M1, 2025), per token.

    ``-sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * logp_t`` with ``r_t = exp(logp_t - behaviour_logp_t)``:
    the weight is clipped and carries no gradient, and no token is ever dropped from the gradient (PPO's clip
    zeroes the gradient of a token outside the trust region; here such a token keeps ``A * grad logp`` with a
    bounded weight). ``clip_low`` None: no lower bound (the paper's choice). The loss *value* is not a surrogate
    objective (it is ``-w A logp``); its gradient is the clipped-IS policy gradient. Metrics over valid tokens:
    ``clip_frac`` (tokens whose weight was clipped, either side), ``ratio_mean``, ``approx_kl`` (k3).
    """
    fn = "cispo_surrogate"
    lp, a, m, log_ratio = _policy_inputs(fn, logp, behaviour_logp, adv, mask)
    if clip_low is not None and not 0 < float(clip_low) <= 1:
        raise ValueError(f"{fn}: clip_low must be in (0, 1] or None, got {clip_low}")
    if not float(clip_high) > 0:
        raise ValueError(f"{fn}: clip_high must be > 0, got {clip_high}")
    lower = 1.0 - float(clip_low) if clip_low is not None else None
    upper = 1.0 + float(clip_high)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(min=lower, max=upper)
    loss = -weight * a * lp
    loss = torch.where(m, loss, torch.zeros_like(loss))
    with torch.no_grad():
        clipped = ratio > upper
        if lower is not None:
            clipped = clipped | (ratio < lower)
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
    * ``seq_mean_token_sum``: the mean over rows of each row's token sum (REINFORCE's sequence log-likelihood
      weighting: a row's gradient grows with its length; verl's ``seq-mean-token-sum``);
    * ``seq_mean_token_sum_norm``: the mean over rows of each row's token sum / ``norm_length`` (Dr.GRPO).
    """
    m = mask.to(x.dtype)
    if agg == "token_mean":
        return (x * m).sum() / m.sum().clamp(min=1)
    if agg == "seq_mean_token_mean":
        return ((x * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if agg == "seq_mean_token_sum":
        return (x * m).sum(-1).mean()
    if agg == "seq_mean_token_sum_norm":
        return ((x * m).sum(-1) / norm_length).mean()
    raise ValueError(f"aggregate: unknown loss aggregation {agg!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}")
