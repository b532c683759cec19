"""The GRPO family's math in palestra.rl: GSPO's sequence-ratio surrogate, CISPO's clipped-weight policy gradient,
DAPO's clip-higher, and the ``seq_mean_token_sum`` aggregation.

Each is checked against a float64 hand computation (plain Python loops) on random inputs with padding, rows of
different lengths and a fully masked row, with clipping active on some tokens or sequences and not on others; and
the autograd gradient of the aggregated loss against the hand-derived float64 gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from palestra.rl import aggregate, cispo_surrogate, clipped_surrogate, gspo_surrogate

torch.set_num_threads(1)

AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def random_inputs(B: int, T: int, seed: int, scale: float, per_row_adv: bool = True):
    """float64 ``logp`` (a leaf with grad), ``behaviour`` = logp - N(0, scale) shifts, advantages, and a padded mask:
    right padding to random lengths 1..T, row 0 empty."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    behaviour = logp.detach() - torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(B if per_row_adv else (B, T), generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logp, behaviour, adv, mask


def agg_weights(mask: torch.Tensor, agg: str) -> list[list[float]]:
    """d(aggregate)/d(x[b][t]) by hand: what each valid token's loss counts for in the aggregate."""
    B, T = mask.shape
    n = [sum(bool(mask[b, t]) for t in range(T)) for b in range(B)]
    total = sum(n)
    out = []
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                row.append(0.0)
            elif agg == "token_mean":
                row.append(1.0 / total)
            elif agg == "seq_mean_token_mean":
                row.append(1.0 / (B * n[b]))
            else:  # seq_mean_token_sum
                row.append(1.0 / B)
        out.append(row)
    return out


def adv_at(adv: torch.Tensor, b: int, t: int) -> float:
    return float(adv[b]) if adv.dim() == 1 else float(adv[b, t])


def autograd(loss: torch.Tensor, mask: torch.Tensor, agg: str, logp: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(aggregate(loss, mask, agg), logp)
    return grad


# ---- seq_mean_token_sum ------------------------------------------------------------------------------------------
def test_seq_mean_token_sum_by_hand_with_its_gradient():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(6)[None, :] < torch.tensor([0, 6, 2, 5, 1])[:, None]
    want = sum(sum(float(x.detach()[b, t]) for t in range(6) if mask[b, t]) for b in range(5)) / 5
    got = aggregate(x, mask, "seq_mean_token_sum")
    assert got.item() == pytest.approx(want, rel=1e-12)
    (grad,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(grad, mask.double() / 5)
    # Unlike the token mean, a row's weight grows with its length: the same rows, summed not averaged.
    assert got.item() != pytest.approx(aggregate(x, mask, "seq_mean_token_mean").item())


# ---- DAPO's clip-higher ------------------------------------------------------------------------------------------
def test_clip_higher_surrogate_and_gradient_by_hand():
    logp, behaviour, adv, mask = random_inputs(16, 9, seed=11, scale=0.3, per_row_adv=False)
    lo, hi = 0.2, 0.28
    loss, metrics = clipped_surrogate(logp, behaviour, adv, mask, lo, hi)
    weights = agg_weights(mask, "token_mean")
    want_grad = torch.zeros_like(logp)
    clipped = between = 0
    for b in range(16):
        for t in range(9):
            if not mask[b, t]:
                assert loss[b, t].item() == 0.0
                continue
            a = adv_at(adv, b, t)
            r = math.exp(float(logp.detach()[b, t]) - float(behaviour[b, t]))
            assert loss[b, t].item() == pytest.approx(-min(r * a, min(max(r, 1 - lo), 1 + hi) * a), rel=1e-5, abs=1e-6)
            cut = (r > 1 + hi and a > 0) or (r < 1 - lo and a < 0)
            clipped += cut
            between += 1 + lo < r <= 1 + hi and a > 0  # kept by clip-higher, clipped by symmetric 0.2
            want_grad[b, t] = 0.0 if cut else -a * r * weights[b][t]
    assert clipped > 0 and between > 0
    assert metrics["clip_frac"].item() == pytest.approx(clipped / int(mask.sum()), abs=1e-6)
    torch.testing.assert_close(autograd(loss, mask, "token_mean", logp), want_grad, rtol=1e-5, atol=1e-7)


# ---- GSPO -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_row_adv", [True, False], ids=["row_adv", "token_adv"])
def test_gspo_surrogate_and_gradient_by_hand(agg, per_row_adv):
    """With per-token advantages the GSPO-token form differs from a differentiable sequence ratio: the gradient of
    token t is -s_i * A_it (times its aggregation weight), not a row-wide mean of them."""
    B, T = 12, 7
    logp, behaviour, adv, mask = random_inputs(B, T, seed=5, scale=0.15, per_row_adv=per_row_adv)
    lo, hi = 0.03, 0.04
    loss, metrics = gspo_surrogate(logp, behaviour, adv, mask, lo, hi)
    weights = agg_weights(mask, agg)
    want_grad = torch.zeros_like(logp)
    kept_rows = clipped_tokens = 0
    ratio_sum = 0.0
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        if not valid:
            assert not loss[b].any()
            continue
        s = math.exp(sum(float(logp.detach()[b, t]) - float(behaviour[b, t]) for t in valid) / len(valid))
        outside = not (1 - lo <= s <= 1 + hi)
        for t in range(T):
            if t not in valid:
                assert loss[b, t].item() == 0.0
                continue
            a = adv_at(adv, b, t)
            cut = (s > 1 + hi and a > 0) or (s < 1 - lo and a < 0)
            assert loss[b, t].item() == pytest.approx(-min(s * a, min(max(s, 1 - lo), 1 + hi) * a), rel=1e-5, abs=1e-6)
            # d/d logp_t of -s_it * A_it is -s_i * A_it (the GSPO-token form); 0 where the clipped branch is active
            want_grad[b, t] = 0.0 if cut else -s * a * weights[b][t]
            clipped_tokens += cut
            kept_rows += outside and not cut  # outside the range, yet the unclipped branch is the min
            ratio_sum += s
    assert clipped_tokens > 0 and kept_rows > 0  # both sides of the clip are exercised
    n = int(mask.sum())
    assert metrics["clip_frac"].item() == pytest.approx(clipped_tokens / n, abs=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio_sum / n, rel=1e-5)
    torch.testing.assert_close(autograd(loss, mask, agg, logp), want_grad, rtol=1e-5, atol=1e-7)


def test_gspo_token_form_equals_the_sequence_objective_with_seq_mean_token_mean():
    """GSPO's sequence objective -1/B sum_i min(s_i A_i, clip(s_i) A_i), s_i differentiable: same value and gradient."""
    logp, behaviour, adv, mask = random_inputs(10, 6, seed=8, scale=0.2)
    lo, hi = 0.02, 0.03
    loss, _ = gspo_surrogate(logp, behaviour, adv, mask, lo, hi)
    token_form = aggregate(loss, mask, "seq_mean_token_mean")
    m = mask.double()
    n = m.sum(-1)
    s = torch.exp(((logp - behaviour) * m).sum(-1) / n.clamp(min=1))
    per_seq = -torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv) * (n > 0)
    sequence_form = per_seq.mean()
    assert token_form.item() == pytest.approx(sequence_form.item(), rel=1e-5)
    g_token = torch.autograd.grad(token_form, logp)[0]
    g_seq = torch.autograd.grad(sequence_form, logp)[0]
    assert g_seq.abs().sum() > 0 and (g_token == 0).any()  # some rows clipped, the rest not
    torch.testing.assert_close(g_token, g_seq, rtol=1e-5, atol=1e-7)


def test_gspo_on_policy_ratio_is_one_and_nothing_clips():
    logp, _, adv, mask = random_inputs(4, 5, seed=2, scale=0.0)
    loss, metrics = gspo_surrogate(logp, logp.detach(), adv, mask)  # the paper's 3e-4 / 4e-4
    assert metrics["clip_frac"].item() == 0.0 and metrics["ratio_mean"].item() == pytest.approx(1.0)
    want = torch.where(mask, -adv[:, None].expand_as(logp), torch.zeros_like(logp))
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-7)


# ---- CISPO ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip_low", [None, 0.25])
def test_cispo_surrogate_and_gradient_by_hand(agg, clip_low):
    B, T = 9, 8
    logp, behaviour, adv, mask = random_inputs(B, T, seed=21, scale=0.4, per_row_adv=False)
    hi = 0.2
    loss, metrics = cispo_surrogate(logp, behaviour, adv, mask, clip_low, hi)
    weights = agg_weights(mask, agg)
    want_grad = torch.zeros_like(logp)
    above = below = 0
    ratio_sum = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                assert loss[b, t].item() == 0.0
                continue
            a = adv_at(adv, b, t)
            lp = float(logp.detach()[b, t])
            r = math.exp(lp - float(behaviour[b, t]))
            w = min(r, 1 + hi) if clip_low is None else min(max(r, 1 - clip_low), 1 + hi)
            above += r > 1 + hi
            below += clip_low is not None and r < 1 - clip_low
            ratio_sum += r
            assert loss[b, t].item() == pytest.approx(-w * a * lp, rel=1e-5, abs=1e-6)
            want_grad[b, t] = -w * a * weights[b][t]  # the weight is a constant: every token keeps its gradient
    assert above > 0 and (clip_low is None or below > 0)
    n = int(mask.sum())
    assert metrics["clip_frac"].item() == pytest.approx((above + below) / n, abs=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio_sum / n, rel=1e-5)
    grad = autograd(loss, mask, agg, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert (grad[mask] != 0).all()  # unlike PPO's clip, no valid token loses its gradient


# ---- errors -------------------------------------------------------------------------------------------------------
def test_bad_inputs_are_one_line_errors_naming_the_function():
    logp, behaviour, adv, mask = random_inputs(3, 4, seed=1, scale=0.1)
    with pytest.raises(ValueError, match=r"^gspo_surrogate: clip_low must be in \(0, 1\)"):
        gspo_surrogate(logp, behaviour, adv, mask, 0.0, 0.1)
    with pytest.raises(ValueError, match=r"^cispo_surrogate: clip_high must be > 0, got -1"):
        cispo_surrogate(logp, behaviour, adv, mask, None, -1)
    with pytest.raises(ValueError, match=r"^cispo_surrogate: clip_low must be in \(0, 1\] or None, got 1.5$"):
        cispo_surrogate(logp, behaviour, adv, mask, 1.5, 0.2)
    with pytest.raises(ValueError, match=r"^gspo_surrogate: behaviour_logp has shape \[3, 3\], expected \[3, 4\]"):
        gspo_surrogate(logp, behaviour[:, :3], adv, mask)
    with pytest.raises(ValueError, match=r"^cispo_surrogate: adv has shape \[2\], expected \[3, 4\] or \[3\]"):
        cispo_surrogate(logp, behaviour, adv[:2], mask)
