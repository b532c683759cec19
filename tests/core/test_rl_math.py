"""palestra.rl, the RL math every algorithm shares, each function against a float64 hand computation (plain
Python loops) on fresh random inputs, with clipping active, fully masked rows and T=1."""

from __future__ import annotations

import math

import pytest
import torch

from palestra.rl import (
    aggregate,
    clipped_surrogate,
    explained_variance,
    group_size_of,
    kl_divergence,
    last_token_rewards,
    lr_factor,
    masked_mean,
    value_loss,
)

torch.set_num_threads(1)

SHAPES = [(6, 7, 3), (4, 1, 2), (5, 4, 1), (1, 9, 1)]  # (B, T, unused): T=1, one row


def random_mask(B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # a fully masked row
    return mask


def random_rows(B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    return a, b, random_mask(B, T, seed + 1)


# ---- KL estimators, token rewards, groups ---------------------------------------------------------------
def test_kl_estimators_match_schulman_formulas():
    logp = torch.tensor([[-1.0, -2.0, -0.3]])
    ref = torch.tensor([[-1.5, -0.5, -9.0]])
    mask = torch.tensor([[True, True, False]])
    d = [(-1.5) - (-1.0), (-0.5) - (-2.0)]  # log(pi_ref / pi) per valid token
    want = {
        "k1": [-d[0], -d[1], 0.0],
        "k2": [0.5 * d[0] ** 2, 0.5 * d[1] ** 2, 0.0],
        "k3": [math.exp(d[0]) - 1 - d[0], math.exp(d[1]) - 1 - d[1], 0.0],
    }
    for est, values in want.items():
        got = kl_divergence(logp, ref, mask, est)
        torch.testing.assert_close(got, torch.tensor([values]), rtol=1e-6, atol=1e-7)
    assert (kl_divergence(logp, ref, mask, "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown estimator 'k4'"):
        kl_divergence(logp, ref, mask, "k4")


def test_group_size_of_checks_structure():
    assert group_size_of(torch.tensor([3, 3, 1, 1, 9, 9]), "grpo") == 2
    with pytest.raises(
        ValueError,
        match=r"^grpo: batch.group_ids \[6\] must keep each group's rows consecutive; group 0 appears again at row 4$",
    ):
        group_size_of(torch.tensor([0, 0, 1, 1, 0, 0]), "grpo")
    with pytest.raises(ValueError, match=r"same size \(train.group_size\); got sizes \[1, 2, 3\]"):
        group_size_of(torch.tensor([0, 0, 0, 1, 1, 2]), "grpo")


def test_last_token_rewards():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    out = last_token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]]


# ---- the clipped surrogate -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,A", SHAPES)
@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_clipped_surrogate_by_hand(B, T, A, clip_high):
    m = random_mask(B, T, seed=3 + T)
    g = torch.Generator().manual_seed(B + T)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + torch.randn(B, T, generator=g) * 0.4).requires_grad_(True)  # ratios well outside the clip
    adv = torch.randn(B, T, generator=g)
    clip = 0.2
    hi = clip_high if clip_high is not None else clip
    loss, metrics = clipped_surrogate(logp, old, adv, m, clip_low=clip, clip_high=clip_high)
    want, grads, n, n_clip, kl, rsum = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)], 0, 0, 0.0, 0.0
    for b in range(B):
        for t in range(T):
            if not m[b, t]:
                continue
            lr = logp[b, t].double().item() - old[b, t].double().item()
            ratio, a = math.exp(lr), adv[b, t].double().item()
            unclipped, clipped = ratio * a, min(max(ratio, 1 - clip), 1 + hi) * a
            want[b][t] = -min(unclipped, clipped)
            # the clipped branch is active (the token's gradient is cut) when the ratio left the range in A's direction
            is_clipped = (ratio < 1 - clip and a < 0) or (ratio > 1 + hi and a > 0)
            grads[b][t] = 0.0 if is_clipped else -ratio * a  # d(-r a)/d logp = -r a
            n, n_clip, kl, rsum = n + 1, n_clip + is_clipped, kl + (ratio - 1) - lr, rsum + ratio
    torch.testing.assert_close(loss.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad.double(), torch.tensor(grads, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(n_clip / max(n, 1), abs=1e-6)
    assert metrics["approx_kl"].item() == pytest.approx(kl / max(n, 1), rel=1e-4, abs=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(rsum / max(n, 1), rel=1e-5, abs=1e-6)
    if n:
        assert 0 < n_clip < n or B * T < 10  # clipping really active in the larger cases


def test_clipped_surrogate_per_row_advantage_and_errors():
    logp, old = torch.randn(3, 4), torch.randn(3, 4)
    adv = torch.randn(3)
    a, _ = clipped_surrogate(logp, old, adv, None)
    b, _ = clipped_surrogate(logp, old, adv[:, None].expand(3, 4), None)
    assert torch.equal(a, b)
    with pytest.raises(
        ValueError,
        match=r"^clipped_surrogate: behaviour_logp has shape \[3, 5\], expected \[3, 4\] \(the shape of logp\)$",
    ):
        clipped_surrogate(logp, torch.zeros(3, 5), adv, None)
    with pytest.raises(ValueError, match=r"^clipped_surrogate: adv has shape \[2\], expected \[3, 4\] or \[3\]"):
        clipped_surrogate(logp, old, torch.zeros(2), None)


# ---- the value loss ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,A", SHAPES)
@pytest.mark.parametrize("clip,delta", [(0.2, None), (0.2, 1.0), (None, None), (None, 0.5)])
def test_value_loss_by_hand(B, T, A, clip, delta):
    ret, old, m = random_rows(B, T, seed=11 + B)
    g = torch.Generator().manual_seed(T)
    values = (old + torch.randn(B, T, generator=g) * 0.5).requires_grad_(True)
    ret = ret * 2

    def f(e):
        if delta is None:
            return 0.5 * e * e
        return 0.5 * e * e if abs(e) <= delta else delta * (abs(e) - 0.5 * delta)

    loss, metrics = value_loss(values, old, ret, m, clip=clip, huber_delta=delta)
    want, n, n_clip = [[0.0] * T for _ in range(B)], 0, 0
    for b in range(B):
        for t in range(T):
            if not m[b, t]:
                continue
            v, o, r = values[b, t].double().item(), old[b, t].double().item(), ret[b, t].double().item()
            plain = f(r - v)
            if clip is None:
                want[b][t] = plain
            else:
                vc = o + min(max(v - o, -clip), clip)
                want[b][t] = max(plain, f(r - vc))
                n_clip += f(r - vc) > plain
            n += 1
    torch.testing.assert_close(loss.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert metrics["value_clip_frac"].item() == pytest.approx(n_clip / max(n, 1), abs=1e-6)
    loss.sum().backward()  # differentiable in values
    assert values.grad is not None and not values.grad[~m].any()


# ---- aggregation, masked means, explained variance -----------------------------------------------------------
@pytest.mark.parametrize("B,T,A", SHAPES)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_by_hand(B, T, A, agg):
    x, _, m = random_rows(B, T, seed=B * T)
    norm = 5
    rows = [[x[b, t].double().item() for t in range(T) if m[b, t]] for b in range(B)]
    if agg == "token_mean":
        flat = [v for r in rows for v in r]
        want = sum(flat) / max(len(flat), 1)
    elif agg == "seq_mean_token_mean":
        want = sum(sum(r) / max(len(r), 1) for r in rows) / B
    else:
        want = sum(sum(r) / norm for r in rows) / B
    assert aggregate(x, m, agg, norm).item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match=r"^aggregate: unknown loss aggregation 'mean'; choose one of token_mean, "):
        aggregate(x, m, "mean")


def test_masked_mean_and_explained_variance_by_hand():
    values, returns, m = random_rows(7, 5, seed=4)
    valid = [
        (values[b, t].double().item(), returns[b, t].double().item()) for b in range(7) for t in range(5) if m[b, t]
    ]
    n = len(valid)
    assert masked_mean(values, m).item() == pytest.approx(sum(v for v, _ in valid) / n, rel=1e-5)
    assert masked_mean(m, m).item() == 1.0  # a bool tensor counts as float32
    assert masked_mean(values, torch.zeros_like(m)).item() == 0.0  # nothing valid: 0, not NaN

    def var(xs: list[float]) -> float:
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    want = 1 - var([r - v for v, r in valid]) / var([r for _, r in valid])
    assert explained_variance(values, returns, m) == pytest.approx(want, rel=1e-9)
    assert explained_variance(returns, returns, m) == pytest.approx(1.0)
    assert explained_variance(values, torch.ones_like(returns), m) == 0.0  # returns that do not vary
    assert explained_variance(values, returns, torch.zeros_like(m)) == 0.0


def test_lr_schedules_by_hand():
    lin = lr_factor("linear", 2, 6)
    assert [lin(s) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cos = lr_factor("cosine", 0, 4)
    assert [cos(s) for s in range(4)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)], rel=1e-12
    )
    assert [lr_factor("constant", 3, 10)(s) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_factor("step", 0, 4)(0)
