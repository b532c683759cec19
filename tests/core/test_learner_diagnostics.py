"""The learner's training diagnostics (what precedes an entropy collapse), each against a float64 hand computation
on a constructed batch: tied and nearly tied reward groups and their advantages, the entropy bonus's share of the
gradient norm, the logit and hidden-state norms; the probe's cadence, and that it leaves the update unchanged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from algo_helpers import (  # the algorithm tests' toy policy (tests/plugins)
    ToyPolicy,
    learner_for,
    make_batch,
    reference_logprobs,
    train_config,
)

from palestra.plugin_manager import get_registry
from palestra.rl.stats import group_tie_stats

torch.set_num_threads(1)

# three groups of three: an exact tie, a near tie (std 2.4e-4), rewards that differ
REWARDS = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5005, 0.0, 1.0, 0.5]
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 2]
LENGTHS = [5, 3, 4, 1, 5, 2, 4, 4, 3]


def grpo(**options):
    return get_registry().get("optimizer", "grpo").factory(**options)


def pstd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def test_group_tie_stats_by_hand():
    rewards = torch.tensor([2.0, 0.3, 2.0, 0.3001, 2.0, 7.0, 1.0, 0.0])
    groups = torch.tensor([4, 9, 4, 9, 4, 5, 6, 6])  # 4: exact tie, 9: near tie (rows not consecutive), 5: one row
    adv = torch.tensor(
        [[0.0, 0.0], [0.5, -1.5], [0.0, 0.0], [-2.0, 3.0], [0.0, 0.0], [1.0, 1.0], [4.0, 4.0], [-4.0, -4.0]]
    )
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [0, 1], [1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    stats = group_tie_stats(rewards, groups, adv, mask, tie_std=0.01)
    assert pstd([0.3, 0.3001]) < 0.01 and pstd([1.0, 0.0]) > 0.01
    # groups of two rows or more: 4, 9, 6; tied: 4 and 9; near: 9, whose valid tokens are |0.5|, |-2|, |3|
    assert stats == pytest.approx(
        {"tied_group_frac": 2 / 3, "near_tie_group_frac": 1 / 3, "adv_abs_mean_near_tie": (0.5 + 2.0 + 3.0) / 3}
    )
    # per-row advantages count once per valid token
    row_adv = torch.tensor([0.0, 1.0, 0.0, -3.0, 0.0, 1.0, 4.0, -4.0])
    assert group_tie_stats(rewards, groups, row_adv, mask, 0.01)["adv_abs_mean_near_tie"] == pytest.approx(
        (1 + 3 + 3) / 3
    )
    assert group_tie_stats(rewards, torch.arange(8), row_adv, mask, 0.01) == {}  # no group of two rows


def test_update_logs_the_group_diagnostics_of_the_batch():
    policy = ToyPolicy()
    algo = grpo(diagnostics_every=0)
    algo = learner_for(algo, policy, train_config())
    batch = make_batch(REWARDS, GROUPS, lengths=LENGTHS)
    batch.behaviour_logprobs = reference_logprobs(policy, batch).float()
    batch = algo.prepare(batch)
    metrics = algo.update(batch)
    assert metrics["diag/tied_group_frac"] == pytest.approx(2 / 3)
    assert metrics["diag/near_tie_group_frac"] == pytest.approx(1 / 3)
    # GRPO's near-tie advantages: (r - mean) / (sample std + 1e-4), blown up from differences of 5e-4
    r = batch.rewards[3:6].double().tolist()  # as stored (float32): 0.5005 is not exact, and the spread is small
    mean = sum(r) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in r) / 2)
    adv = [abs(v - mean) / (std + 1e-4) for v in r]
    want = sum(a * n for a, n in zip(adv, LENGTHS[3:6])) / sum(LENGTHS[3:6])
    assert metrics["diag/adv_abs_mean_near_tie"] == pytest.approx(want, rel=1e-4)
    assert want > 0.5  # the point of the metric: a 5e-4 reward spread became advantages of order 1
    assert "diag/entropy_grad_share" not in metrics and "diag/logit_norm" not in metrics


# ---- the probe: entropy's share of the gradient, logit and hidden norms --------------------------------------
def float64_scores(policy64: ToyPolicy, batch):
    """Differentiable float64 log-probs and entropies [B, T] (0 where masked), and the hidden states and logits."""
    p, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    hidden, _ = policy64.trunk(ids, mask, (mask.long().cumsum(-1) - 1).clamp(min=0))
    states = hidden[:, p - 1 : p + t - 1]
    logits = policy64.head(states)
    logq = torch.log_softmax(logits, -1)
    logp = logq.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    ent = -(logq.exp() * logq).sum(-1)
    zero = torch.zeros_like(logp)
    m = batch.completion_mask
    return torch.where(m, logp, zero), torch.where(m, ent, zero), states, logits


def grad_norm(loss, params) -> float:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return math.sqrt(sum(float(g.square().sum()) for g in grads if g is not None))


def test_the_probe_matches_float64_and_leaves_the_update_unchanged():
    coef = 0.05
    policy = ToyPolicy()
    shifts = torch.randn(len(REWARDS), 5, generator=torch.Generator().manual_seed(3)) * 0.4
    batch = make_batch(REWARDS, GROUPS, lengths=LENGTHS)
    batch.behaviour_logprobs = torch.where(
        batch.completion_mask,
        reference_logprobs(policy, batch) + shifts.double(),
        torch.zeros(batch.completion_mask.shape, dtype=torch.float64),
    ).float()
    twin = copy.deepcopy(policy)
    algo = grpo(entropy_coef=coef, clip_eps=0.2, diagnostics_every=1)
    algo = learner_for(algo, policy, train_config(lr=0.05))
    batch = algo.prepare(batch)
    other_batch = copy.deepcopy(batch)

    policy64 = copy.deepcopy(policy).double()
    params = list(policy64.parameters())
    logp, ent, states, logits = float64_scores(policy64, batch)
    m = batch.completion_mask.double()
    adv = batch.advantages.double()[:, None].expand_as(logp)
    ratio = torch.exp(logp - batch.behaviour_logprobs.double())
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) - coef * ent
    loss = (per_token * m).sum() / m.sum()
    entropy_term = -coef * (ent * m).sum() / m.sum()
    share = grad_norm(entropy_term, params) / grad_norm(loss, params)
    valid = batch.completion_mask
    logit_norm = float(logits.detach()[valid].norm(dim=-1).mean())
    hidden_norm = float(states.detach()[valid].norm(dim=-1).mean())

    metrics = algo.update(batch)
    assert metrics["diag/entropy_grad_share"] == pytest.approx(share, rel=1e-4)
    assert 0 < share < 1
    assert metrics["diag/logit_norm"] == pytest.approx(logit_norm, rel=1e-5)
    assert metrics["diag/hidden_norm"] == pytest.approx(hidden_norm, rel=1e-5)

    # the same update without the probe: the same weights, bit for bit
    plain = grpo(entropy_coef=coef, clip_eps=0.2, diagnostics_every=0)
    plain = learner_for(plain, twin, train_config(lr=0.05))
    plain.update(other_batch)
    for (name, a), b in zip(policy.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


def test_the_probe_runs_every_n_updates_and_costs_nothing_without_an_entropy_bonus():
    policy = ToyPolicy()
    algo = grpo(diagnostics_every=3)
    algo = learner_for(algo, policy, train_config(grad_accum=3))
    seen = []
    for step in range(5):
        batch = make_batch(REWARDS, GROUPS, lengths=LENGTHS, seed=step)
        batch.behaviour_logprobs = reference_logprobs(policy, batch).float()
        metrics = algo.update(algo.prepare(batch))
        seen.append("diag/logit_norm" in metrics)
        if seen[-1]:
            assert metrics["diag/entropy_grad_share"] == 0.0  # entropy_coef 0: the bonus adds no gradient
    assert seen == [True, False, False, True, False]
