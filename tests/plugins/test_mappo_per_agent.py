"""MAPPO's per-agent math (palestra.plugins.optimizers.mappo.per_agent) against float64 hand computations (plain
Python loops over rows and agents) on random inputs.

Edge cases throughout: fully masked rows, T=1, one agent, an agent absent from the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from palestra.plugins.optimizers.mappo.per_agent import (
    ValueNormalizer,
    normalize_advantages_per_agent,
    per_agent_clip_grad_norm,
    per_agent_gae,
    per_agent_mean,
)

torch.set_num_threads(1)


def batch(B, T, num_agents, seed, full_mask_rows=(0,)):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    for r in full_mask_rows:
        if r < B:
            mask[r] = False  # a fully masked row
    agent = torch.randint(0, num_agents, (B,), generator=g)
    return rewards, values, mask, agent


# ---- hand references (float64, Python lists) ------------------------------------------------------------------
def hand_gae(r, v, m, boot, gamma, lam):
    B, T = len(r), len(r[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(T) if m[b][t]]
        next_v, next_a = boot[b], 0.0
        for t in reversed(steps):
            delta = r[b][t] + gamma * next_v - v[b][t]
            next_a = delta + gamma * lam * next_a
            adv[b][t] = next_a
            next_v = v[b][t]
    ret = [[adv[b][t] + v[b][t] if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return adv, ret


def hand_moments(xs):
    n = len(xs)
    mean = sum(xs) / n
    return n, mean, sum((x - mean) ** 2 for x in xs) / n


def as_list(t):
    return t.double().tolist()


SHAPES = [(6, 7, 3), (4, 1, 2), (5, 4, 1), (1, 9, 1)]  # (B, T, agents): T=1, one agent, one row


# ---- ValueNormalizer ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,A", SHAPES)
def test_value_normalizer_matches_running_moments_by_hand(B, T, A):
    vn = ValueNormalizer(A + 1, eps=1e-5)  # agent A never appears: identity for it
    seen = {a: [] for a in range(A + 1)}
    for step in range(3):
        r, _, m, agent = batch(B, T, A, seed=10 + step)
        r = r * (step + 1) * 5 + 3.0  # shifting scale, as returns do during training
        vn.update(r, agent, mask=m)
        for b in range(B):
            seen[int(agent[b])] += [x for x, ok in zip(as_list(r[b]), m[b].tolist()) if ok]
    x = torch.randn(B, T)
    ids = torch.randint(0, A + 1, (B,))
    out = vn.normalize(x, ids)
    back = vn.denormalize(out, ids)
    assert out.dtype == torch.float32
    for b in range(B):
        a = int(ids[b])
        if seen[a]:
            n, mean, var = hand_moments(seen[a])
            assert vn.count[a].item() == n
            std = math.sqrt(var + 1e-5)
        else:
            mean, std = 0.0, 1.0
        for t in range(T):
            assert out[b, t].item() == pytest.approx((x[b, t].item() - mean) / std, rel=1e-5, abs=1e-5)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-4)


def test_value_normalizer_state_dict_is_exact_and_merge_is_exact():
    r, _, m, agent = batch(8, 5, 3, seed=1)
    full = ValueNormalizer(3).update(r, agent, m)
    clone = ValueNormalizer(3)
    clone.load_state_dict(full.state_dict())
    for k in ("count", "mean", "m2"):
        assert torch.equal(getattr(clone.moments, k), getattr(full.moments, k))
    x = torch.randn(8, 5)
    assert torch.equal(clone.normalize(x, agent), full.normalize(x, agent))
    # Two "ranks" holding halves merge to the statistics of the whole batch.
    a = ValueNormalizer(3).update(r[:4], agent[:4], m[:4])
    b = ValueNormalizer(3).update(r[4:], agent[4:], m[4:])
    a.moments.merge(b.moments)
    torch.testing.assert_close(a.moments.mean, full.moments.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.moments.m2, full.moments.m2, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="num_agents=3, this normalizer has 2"):
        ValueNormalizer(2).load_state_dict(full.state_dict())


def test_value_normalizer_errors_are_one_line():
    vn = ValueNormalizer(2)
    with pytest.raises(
        ValueError, match=r"ValueNormalizer.update: agent_index has shape \[3\], expected \[4\] or \[4, 2\]"
    ):
        vn.update(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"agent_index has value 2; ids must lie in \[0, 2\)"):
        vn.normalize(torch.zeros(2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"mask has shape \[4\], expected \[4, 2\] \(the shape of returns\)"):
        vn.update(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))


# ---- GAE --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,A", SHAPES)
@pytest.mark.parametrize("normalized", [False, True])
def test_per_agent_gae_matches_hand_recursion(B, T, A, normalized):
    r, v, m, agent = batch(B, T, A, seed=B * 100 + T)
    boot = torch.randn(B)
    gamma, lam = 0.97, 0.9
    vn = None
    v_true, boot_true = v.double(), boot.double()
    if normalized:
        vn = ValueNormalizer(A).update(torch.randn(40) * 4 + 2, torch.arange(40) % A)
        mean, std = (t.double() for t in vn.stats())
        v_true = v.double() * std[agent][:, None] + mean[agent][:, None]
        boot_true = boot.double() * std[agent] + mean[agent]
    adv, ret = per_agent_gae(r, v, m, agent, gamma, lam, bootstrap_value=boot, value_normalizer=vn)
    hadv, hret = hand_gae(as_list(r), as_list(v_true), m.tolist(), as_list(boot_true), gamma, lam)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == (B, T)
    torch.testing.assert_close(adv.double(), torch.tensor(hadv, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), torch.tensor(hret, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert not adv[~m].any() and not ret[~m].any()


def test_per_agent_gae_errors():
    r = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"per_agent_gae: values has shape \[3, 5\], expected \[3, 4\]"):
        per_agent_gae(r, torch.zeros(3, 5), None, None, 1.0, 1.0)
    with pytest.raises(ValueError, match="agent_index is required with value_normalizer"):
        per_agent_gae(r, r, None, None, 1.0, 1.0, value_normalizer=ValueNormalizer(2))
    with pytest.raises(ValueError, match=r"bootstrap_value has shape \[2\], expected \[3\]"):
        per_agent_gae(r, r, None, torch.zeros(3, dtype=torch.long), 1.0, 1.0, bootstrap_value=torch.zeros(2))


# ---- advantage normalisation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,A", [*SHAPES, (7, 3, 4)])
def test_normalize_advantages_per_agent_by_hand(B, T, A):
    adv, _, m, agent = batch(B, T, A, seed=7 + B)
    adv = adv * (agent[:, None].float() * 10 + 1)  # very different scales per agent
    out = normalize_advantages_per_agent(adv, m, agent, num_agents=A)
    eps = 1e-8
    want = [[0.0] * T for _ in range(B)]
    for a in range(A):
        cells = [(b, t) for b in range(B) for t in range(T) if int(agent[b]) == a and m[b, t]]
        xs = [adv[b, t].double().item() for b, t in cells]
        if not xs:
            continue
        mean = sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1)
        for (b, t), x in zip(cells, xs):
            want[b][t] = (x - mean) / math.sqrt(var + eps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    for a in range(A):  # each agent with >= 2 valid positions ends with mean 0 and unit (unbiased) std
        sel = (agent[:, None] == a).expand(B, T) & m
        if int(sel.sum()) >= 2:
            assert abs(out[sel].double().mean().item()) < 1e-5
            assert out[sel].double().std().item() == pytest.approx(1.0, abs=1e-4)


# ---- per-agent gradient clipping and metrics ------------------------------------------------------------------
def test_per_agent_clip_grad_norm_by_hand():
    torch.manual_seed(0)
    small, big, idle = torch.nn.Linear(3, 2), torch.nn.Linear(4, 4), torch.nn.Linear(2, 2)
    (small(torch.randn(5, 3)).sum() * 0.01 + big(torch.randn(5, 4)).sum() * 100).backward()
    before = {
        "small": math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in small.parameters())),
        "big": math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in big.parameters())),
    }
    small_grads = [p.grad.clone() for p in small.parameters()]
    norms = per_agent_clip_grad_norm(
        {"small": small.parameters(), "big": list(big.parameters()), "idle": idle.parameters()}, max_norm=1.0
    )
    assert norms["small"] == pytest.approx(before["small"], rel=1e-5)
    assert norms["big"] == pytest.approx(before["big"], rel=1e-5)
    assert norms["idle"] == 0.0
    assert before["small"] < 1.0 < before["big"]
    for p, g in zip(small.parameters(), small_grads):  # the quiet agent is untouched by the loud one
        assert torch.equal(p.grad, g)
    after = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in big.parameters()))
    assert after == pytest.approx(1.0, rel=1e-4)
    shared = torch.nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shape \[2, 3\] is in both param_groups\['a'\] and param_groups\['b'\]"):
        per_agent_clip_grad_norm({"a": [shared], "b": [shared]}, 1.0)


def test_per_agent_mean_with_absent_agent():
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 9.0]])
    m = torch.tensor([[True, True], [True, False], [False, False]])
    out = per_agent_mean(x, m, torch.tensor([0, 0, 1]), num_agents=3)
    torch.testing.assert_close(out, torch.tensor([2.0, 0.0, 0.0]))
