"""The built-in RL algorithms (palestra.engine.learner + plugins/optimizers) on a tiny real policy.

Every loss and advantage is checked against a float64 hand computation written out here (log-probs from
a plain-torch path that does not use palestra's kernels), with clipping active.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from algo_helpers import (
    Masked,
    ToyPolicy,
    learner_for,
    make_batch,
    reference_logprobs,
    reference_scores,
    train_config,
    with_behaviour,
)

from palestra.config import ConfigError
from palestra.engine.algorithm import Algorithm
from palestra.plugin_manager import get_registry
from palestra.plugins.optimizers.grpo import GRPO

ALL = ["reinforce", "ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp"]
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.2, 1.0]
GROUPS = [0, 0, 0, 7, 7, 7]
LENGTHS = [5, 3, 4, 1, 5, 2]


def build(name: str, **options) -> Algorithm:
    return get_registry().get("optimizer", name).factory(**options)


def shifted_batch(policy: ToyPolicy, seed: int = 1, scale: float = 0.4, **kw):
    """The standard 2-group batch; behaviour log-probs off the policy's by N(0, scale) so that ratios clip."""
    batch = make_batch(
        kw.pop("rewards", REWARDS), kw.pop("groups", GROUPS), lengths=kw.pop("lengths", LENGTHS), seed=seed, **kw
    )
    shifts = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(seed + 100)) * scale
    return with_behaviour(policy, batch, shifts)


def group_norm(rewards, group_size: int, scale: bool, eps: float) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    if scale:
        centred = centred / (r.std(1, unbiased=True, keepdim=True) + eps)
    return centred.reshape(-1)


def clipped_surrogate(logp, behaviour, adv, low, high):
    """Hand PPO surrogate per token (float64): -min(r A, clip(r) A)."""
    ratio = torch.exp(logp - behaviour)
    adv = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    clipped = ((ratio < 1 - low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    return loss, ratio, clipped


# ---- registry and options -----------------------------------------------------------------------------
def test_registry_has_all_six_algorithms():
    names = get_registry().names("optimizer")
    for name in ALL:
        assert name in names
        algo = build(name)
        assert isinstance(algo, Algorithm) and algo.name == name


def test_options_errors_name_the_option():
    with pytest.raises(ConfigError, match=r"^grpo\.clip_eps: must be < 1, got 2\.0$"):
        build("grpo", clip_eps=2.0)
    with pytest.raises(ConfigError, match=r"^ppo\.bogus: unknown key"):
        build("ppo", bogus=1)
    with pytest.raises(ConfigError, match=r"^dr_grpo\.loss_agg: expected one of"):
        build("dr_grpo", loss_agg="sum")


def test_defaults():
    g, d = build("grpo"), build("dr_grpo")
    assert (g.options.scale, g.options.loss_agg, g.options.beta, g.options.clip_eps) == (
        "group",
        "token_mean",
        0.0,
        0.2,
    )
    assert (d.options.scale, d.options.loss_agg) == ("none", "seq_mean_token_sum_norm")
    assert not g.needs_reference and build("grpo", beta=0.1).needs_reference
    assert build("ppo").needs_value_head and not g.needs_value_head


# ---- the learner's schedule (the schedule functions: tests/core/test_rl_math.py) ---------------------------
def test_the_learner_follows_the_lr_schedule():
    policy = ToyPolicy()
    algo = learner_for(build("grpo"), policy, train_config(lr=0.1, warmup_steps=2, steps=6, lr_schedule="linear"))
    lrs = []
    for _ in range(4):
        batch = algo.prepare(shifted_batch(policy))
        lrs.append(algo.update(batch)["lr"])
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.075])


# ---- GRPO / Dr.GRPO ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_grpo_loss_matches_hand_computation(loss_agg):
    policy = ToyPolicy()
    algo = learner_for(
        build("grpo", loss_agg=loss_agg, clip_eps=0.2, clip_eps_high=0.28, entropy_coef=0.01),
        policy,
        train_config(max_new_tokens=7),
    )
    batch = algo.prepare(shifted_batch(policy))

    adv = group_norm(REWARDS, 3, scale=True, eps=1e-4)
    torch.testing.assert_close(batch.advantages.double(), adv, rtol=1e-5, atol=1e-6)

    logp, ent = reference_scores(policy, batch)
    per_token, ratio, clipped = clipped_surrogate(logp, batch.behaviour_logprobs.double(), adv, 0.2, 0.28)
    per_token = per_token - 0.01 * ent
    m = Masked(batch.completion_mask)
    agg = {
        "token_mean": m.token_mean,
        "seq_mean_token_mean": m.seq_mean_token_mean,
        "seq_mean_token_sum_norm": lambda x: m.seq_mean_token_sum_norm(x, 7),
    }[loss_agg]
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(agg(per_token), rel=1e-5, abs=1e-6)
    # Metrics are token means whatever loss_agg is.
    assert 0 < m.token_mean(clipped.double()) < 1  # clipping is active on some tokens, not all
    assert metrics["policy/clip_frac"] == pytest.approx(m.token_mean(clipped.double()), abs=1e-6)
    assert metrics["policy/ratio_mean"] == pytest.approx(m.token_mean(ratio), rel=1e-5)
    assert metrics["policy/entropy"] == pytest.approx(m.token_mean(ent), rel=1e-5)
    assert "policy/kl" not in metrics


def test_grpo_kl_term_to_reference():
    policy, reference = ToyPolicy(0), ToyPolicy(5)
    algo = learner_for(build("grpo", beta=0.3), policy, train_config(), reference=reference)
    batch = algo.prepare(shifted_batch(policy))
    ref = reference_logprobs(reference, batch)
    torch.testing.assert_close(batch.ref_logprobs.double(), ref, rtol=1e-5, atol=1e-6)

    logp = reference_logprobs(policy, batch)
    adv = group_norm(REWARDS, 3, scale=True, eps=1e-4)
    surrogate, _, _ = clipped_surrogate(logp, batch.behaviour_logprobs.double(), adv, 0.2, 0.2)
    k3 = torch.exp(ref - logp) - 1 - (ref - logp)
    m = Masked(batch.completion_mask)
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(m.token_mean(surrogate + 0.3 * k3), rel=1e-5, abs=1e-6)
    assert metrics["policy/kl"] == pytest.approx(m.token_mean(k3), rel=1e-5)


def test_grpo_needs_reference_when_beta_positive():
    with pytest.raises(ValueError, match="needs a frozen reference policy"):
        learner_for(build("grpo", beta=0.1), ToyPolicy())


def test_dr_grpo_differs_from_grpo_in_scale_and_aggregation():
    policy = ToyPolicy()
    grpo, dr = build("grpo"), build("dr_grpo")
    grpo = learner_for(grpo, policy, train_config(max_new_tokens=6))
    dr = learner_for(dr, policy, train_config(max_new_tokens=6))
    b_g = grpo.prepare(shifted_batch(policy))
    b_d = dr.prepare(shifted_batch(policy))
    adv_g, adv_d = group_norm(REWARDS, 3, True, 1e-4), group_norm(REWARDS, 3, False, 0.0)
    torch.testing.assert_close(b_d.advantages.double(), adv_d, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(b_g.advantages.double(), b_d.advantages.double(), atol=1e-3)

    logp = reference_logprobs(policy, b_g)
    m = Masked(b_g.completion_mask)
    beh = b_g.behaviour_logprobs.double()
    want_g = m.token_mean(clipped_surrogate(logp, beh, adv_g, 0.2, 0.2)[0])
    want_d = m.seq_mean_token_sum_norm(clipped_surrogate(logp, beh, adv_d, 0.2, 0.2)[0], 6)
    loss_g, _ = grpo.loss(b_g)
    loss_d, _ = dr.loss(b_d)
    assert loss_g.item() == pytest.approx(want_g, rel=1e-5, abs=1e-6)
    assert loss_d.item() == pytest.approx(want_d, rel=1e-5, abs=1e-6)
    assert abs(want_g - want_d) > 1e-3
    # Dr.GRPO's constant normaliser: the same row gives the same per-row loss whatever the others' lengths.
    dr_long = learner_for(build("dr_grpo", loss_norm_length=12), policy, train_config())
    assert dr_long.loss(b_d)[0].item() == pytest.approx(loss_d.item() * 6 / 12, rel=1e-5)


def test_group_errors_reach_the_user():
    policy = ToyPolicy()
    algo = learner_for(build("grpo"), policy, train_config())
    with pytest.raises(ValueError, match="group 0 appears again at row 4"):
        algo.prepare(shifted_batch(policy, groups=[0, 0, 1, 1, 0, 0]))


# ---- the update loop ------------------------------------------------------------------------------------------
def test_update_reports_pre_clip_norm_and_update_ratio():
    policy = ToyPolicy()
    algo = learner_for(build("grpo"), policy, train_config(max_grad_norm=1e-3, lr=0.05))
    batch = algo.prepare(shifted_batch(policy))

    twin = copy.deepcopy(policy)  # the unclipped gradient, computed outside update()
    loss, _ = learner_for(build("grpo"), twin, train_config(max_grad_norm=1e-3, lr=0.05)).loss(batch)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in twin.parameters() if p.grad is not None))
    assert norm > 1e-2  # so that clipping to 1e-3 matters

    before = [p.detach().clone() for p in policy.parameters()]
    metrics = algo.update(batch)
    assert metrics["grad/norm"] == pytest.approx(norm, rel=1e-5)
    # AdamW's first moment after one step is (1 - beta1) * the clipped gradient.
    m1 = math.sqrt(sum(float(algo.optimizer.state[p]["exp_avg"].double().square().sum()) for p in policy.parameters()))
    assert m1 == pytest.approx(0.1 * 1e-3, rel=1e-4)
    delta = math.sqrt(sum(float((p.detach() - b).double().square().sum()) for p, b in zip(policy.parameters(), before)))
    theta = math.sqrt(sum(float(b.double().square().sum()) for b in before))
    assert metrics["grad/update_ratio"] == pytest.approx(delta / theta, rel=1e-6)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert set(metrics) >= {
        "loss",
        "policy/entropy",
        "policy/clip_frac",
        "policy/ratio_mean",
        "grad/norm",
        "grad/update_ratio",
        "lr",
    }
    assert all(isinstance(v, float) for v in metrics.values())


def test_the_update_ratio_can_be_switched_off_and_the_step_is_the_same():
    runs = []
    for track in (True, False):
        torch.manual_seed(0)
        policy = ToyPolicy()
        algo = learner_for(build("grpo"), policy, train_config(track_update_ratio=track, lr=0.05))
        metrics = algo.update(algo.prepare(shifted_batch(policy)))
        assert ("grad/update_ratio" in metrics) is track
        runs.append([p.detach().clone() for p in policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_non_finite_loss_skips_the_step_with_one_warning_line(caplog):
    policy = ToyPolicy()
    algo = learner_for(build("grpo"), policy, train_config())
    batch = algo.prepare(shifted_batch(policy))
    batch.advantages[2] = float("nan")
    before = [p.detach().clone() for p in policy.parameters()]
    with caplog.at_level("WARNING", logger="palestra.engine.learner"):
        metrics = algo.update(batch)
    assert metrics["train/skipped"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters()))
    assert [r.getMessage() for r in caplog.records] == [
        "grpo.update: skipped the optimiser step: non-finite loss (nan) in pass 0, micro-batch 0 (6 rows)"
    ]


def test_a_partly_taken_update_counts_and_reports_its_good_passes(caplog):
    """Bug: with updates_per_batch=2 and a non-finite second pass, update reported train/skipped=1.0 although the
    first pass had stepped (weights moved, AdamW's step 1), and the LR schedule, replay and metrics ignored it."""

    class NaNFromSecondCall(GRPO):
        calls = 0

        def loss(self, batch, scores):
            loss, metrics = super().loss(batch, scores)
            self.calls += 1
            return (loss * float("nan") if self.calls > 1 else loss), metrics

    policy = ToyPolicy()
    learner = learner_for(
        NaNFromSecondCall(replay_capacity=2, replay_rows=2), policy, train_config(updates_per_batch=2)
    )
    batch = learner.prepare(shifted_batch(policy))
    before = [p.detach().clone() for p in policy.parameters()]
    with caplog.at_level("WARNING", logger="palestra.engine.learner"):
        metrics = learner.update(batch)
    assert any(not torch.equal(a, p) for a, p in zip(before, policy.parameters()))  # the first pass stepped
    assert max(int(s["step"]) for s in learner.optimizer.state.values()) == 1
    assert metrics["train/skipped"] == 0.0 and metrics["train/skipped_passes"] == 1.0
    assert learner.scheduler.last_epoch == 1  # the schedule follows the step that was taken
    assert learner.replay.stored_rows == 6  # the batch joined the replay buffer
    assert math.isfinite(metrics["loss"]) and "grad/norm" in metrics  # the good pass's metrics
    assert [r.getMessage() for r in caplog.records] == [
        "grpo.update: skipped the optimiser step: non-finite loss (nan) in pass 1, micro-batch 0 (6 rows)"
    ]


def test_the_learner_needs_a_train_context():
    from palestra.engine.learner import Learner

    with pytest.raises(TypeError, match=r"context must be a palestra\.TrainContext, got TrainConfig"):
        Learner(build("grpo"), ToyPolicy(), train_config())


# ---- RLOO ------------------------------------------------------------------------------------------------------
def test_rloo_advantages_and_loss_match_hand_computation():
    policy, reference = ToyPolicy(0), ToyPolicy(5)
    algo = learner_for(build("rloo", kl_coef=0.1, clip_eps=0.15), policy, train_config(), reference=reference)
    batch = algo.prepare(shifted_batch(policy))
    beh = batch.behaviour_logprobs.double()
    ref = reference_logprobs(reference, batch)
    seq = torch.tensor(REWARDS, dtype=torch.float64) - 0.1 * (beh - ref).sum(-1)  # k1 summed over tokens
    adv = torch.empty(6, dtype=torch.float64)
    for i in range(6):
        start = (i // 3) * 3
        others = [seq[j] for j in range(start, start + 3) if j != i]
        adv[i] = seq[i] - sum(others) / 2
    torch.testing.assert_close(batch.advantages.double(), adv, rtol=1e-5, atol=1e-5)

    logp = reference_logprobs(policy, batch)
    per_token, _, clipped = clipped_surrogate(logp, beh, adv, 0.15, 0.15)
    m = Masked(batch.completion_mask)
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(m.token_mean(per_token), rel=1e-5, abs=1e-6)
    assert (
        metrics["policy/clip_frac"] == pytest.approx(m.token_mean(clipped.double()), abs=1e-6)
        and metrics["policy/clip_frac"] > 0
    )
    assert metrics["policy/kl"] == pytest.approx(m.token_mean(logp - ref), rel=1e-5)  # k1 of the current policy


def test_rloo_needs_two_completions_per_prompt():
    policy = ToyPolicy()
    algo = learner_for(build("rloo", kl_coef=0.0), policy, train_config())
    with pytest.raises(ValueError, match=r"^rloo: the leave-one-out baseline needs at least 2 completions per prompt"):
        algo.prepare(shifted_batch(policy, groups=[0, 1, 2, 3, 4, 5]))


# ---- REINFORCE++ ----------------------------------------------------------------------------------------------
def test_reinforce_pp_advantages_and_loss_match_hand_computation():
    policy, reference = ToyPolicy(0), ToyPolicy(5)
    algo = learner_for(build("reinforce_pp", kl_coef=0.1, gamma=0.9), policy, train_config(), reference=reference)
    batch = algo.prepare(shifted_batch(policy))
    beh = batch.behaviour_logprobs.double()
    ref = reference_logprobs(reference, batch)
    returns = torch.zeros(6, 5, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        g = 0.0
        for t in reversed(range(n)):
            r = (REWARDS[b] if t == n - 1 else 0.0) - 0.1 * float(beh[b, t] - ref[b, t])
            g = r + 0.9 * g
            returns[b, t] = g
    valid = returns[batch.completion_mask]
    adv = torch.where(
        batch.completion_mask, (returns - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8), 0.0
    )
    torch.testing.assert_close(batch.advantages.double(), adv, rtol=1e-5, atol=1e-5)

    logp = reference_logprobs(policy, batch)
    per_token, _, clipped = clipped_surrogate(logp, beh, adv, 0.2, 0.2)
    m = Masked(batch.completion_mask)
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(m.token_mean(per_token), rel=1e-5, abs=1e-6)
    assert metrics["policy/clip_frac"] == pytest.approx(m.token_mean(clipped.double()), abs=1e-6)
    assert metrics["policy/clip_frac"] > 0


# ---- PPO ----------------------------------------------------------------------------------------------------------
def test_ppo_gae_value_clipping_and_loss_match_hand_computation():
    from algo_helpers import reference_values

    policy, reference = ToyPolicy(0), ToyPolicy(5)
    algo = learner_for(
        build("ppo", kl_coef=0.1, gamma=0.9, lam=0.8, clip_value=0.05, vf_coef=0.5),
        policy,
        train_config(),
        reference=reference,
    )
    assert policy.value_head is not None
    torch.nn.init.normal_(policy.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(3))
    batch = algo.prepare(shifted_batch(policy))

    values = reference_values(policy, batch)
    torch.testing.assert_close(batch.old_values.double(), values, rtol=1e-5, atol=1e-6)
    beh = batch.behaviour_logprobs.double()
    ref = reference_logprobs(reference, batch)
    adv = torch.zeros(6, 5, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        a = 0.0
        for t in reversed(range(n)):
            r = (REWARDS[b] if t == n - 1 else 0.0) - 0.1 * float(beh[b, t] - ref[b, t])
            v_next = float(values[b, t + 1]) if t + 1 < n else 0.0
            a = r + 0.9 * v_next - float(values[b, t]) + 0.9 * 0.8 * a
            adv[b, t] = a
    returns = adv + values
    torch.testing.assert_close(
        batch.returns.double(), torch.where(batch.completion_mask, returns, 0.0), rtol=1e-5, atol=1e-5
    )
    valid = adv[batch.completion_mask]
    white = torch.where(batch.completion_mask, (adv - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8), 0.0)
    torch.testing.assert_close(batch.advantages.double(), white, rtol=1e-5, atol=1e-5)

    # Later pass: the rollout values differ from the current ones, so value clipping is active.
    old = batch.old_values + 0.2 * torch.randn(6, 5, generator=torch.Generator().manual_seed(4)) * batch.completion_mask
    batch.old_values = old
    old = old.double()
    logp = reference_logprobs(policy, batch)
    surrogate, _, _ = clipped_surrogate(logp, beh, white, 0.2, 0.2)
    v_clip = old + (values - old).clamp(-0.05, 0.05)
    vf = torch.maximum(0.5 * (values - returns) ** 2, 0.5 * (v_clip - returns) ** 2)
    assert ((values - old).abs() > 0.05)[batch.completion_mask].any()  # clipping matters for some tokens
    m = Masked(batch.completion_mask)
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(m.token_mean(surrogate + 0.5 * vf), rel=1e-5, abs=1e-6)
    assert metrics["value/loss"] == pytest.approx(m.token_mean(vf), rel=1e-5)

    r, v = returns[batch.completion_mask], values[batch.completion_mask]
    want_ev = 1 - float((r - v).var(unbiased=False) / r.var(unbiased=False))
    out = algo.update(batch)
    assert out["value/explained_var"] == pytest.approx(want_ev, rel=1e-5)
    assert "value/loss" in out and "policy/kl" in out


# ---- REINFORCE --------------------------------------------------------------------------------------------------
def test_reinforce_per_agent_running_normalisation():
    policy = ToyPolicy()
    algo = learner_for(build("reinforce", norm_clip=1.5), policy, train_config())
    agents = ["ask", "answer"] * 3
    r1, r2 = [1.0, 10.0, 2.0, 20.0, 0.0, 30.0], [3.0, 40.0, 1.0, 10.0, 5.0, 20.0]
    algo.prepare(shifted_batch(policy, rewards=r1, agent_ids=agents))
    batch = algo.prepare(shifted_batch(policy, rewards=r2, agent_ids=agents))
    want = []
    for i, a in enumerate(agents):
        seen = torch.tensor([x for j, x in enumerate(r1 + r2) if agents[j % 6] == a], dtype=torch.float64)
        z = (r2[i] - seen.mean()) / math.sqrt(seen.var(unbiased=False) + 1e-8)
        want.append(max(-1.5, min(1.5, float(z))))
    assert batch.advantages.tolist() == pytest.approx(want, rel=1e-6)
    assert max(abs(x) for x in want) == 1.5  # the clip is exercised

    # A new agent gets its own, fresh statistics; the others' carry on.
    r3, agents3 = [2.0, 100.0, 4.0, 50.0, 6.0, 60.0], ["ask", "judge"] * 3
    batch = algo.prepare(shifted_batch(policy, rewards=r3, agent_ids=agents3))
    ask = torch.tensor([r1[0], r1[2], r1[4], r2[0], r2[2], r2[4], 2.0, 4.0, 6.0], dtype=torch.float64)
    judge = torch.tensor([100.0, 50.0, 60.0], dtype=torch.float64)
    want = [float((x - s.mean()) / math.sqrt(s.var(unbiased=False) + 1e-8)) for x, s in zip(r3, [ask, judge] * 3)]
    assert batch.advantages.tolist() == pytest.approx([max(-1.5, min(1.5, w)) for w in want], rel=1e-6)
    assert algo.algorithm.agents == {"ask": 0, "answer": 1, "judge": 2}

    grouped = learner_for(build("reinforce", normalize=False, baseline="group"), policy, train_config())
    batch = grouped.prepare(shifted_batch(policy))
    assert batch.advantages.double().tolist() == pytest.approx(group_norm(REWARDS, 3, False, 0.0).tolist(), abs=1e-6)


def test_reinforce_replay_uses_truncated_importance_weights():
    policy = ToyPolicy()
    algo = learner_for(
        build("reinforce", replay_capacity=2, replay_rows=4, replay_is_clip=1.1, entropy_coef=0.02),
        policy,
        train_config(lr=0.05),
    )
    first = algo.prepare(shifted_batch(policy, seed=1, scale=0.0))
    algo.update(first)  # the policy moves: first's behaviour log-probs are now stale
    fresh = algo.prepare(shifted_batch(policy, seed=2, scale=0.0, lengths=[2, 5, 5, 3, 4, 4]))
    plain = build("reinforce")  # c = 1: on-policy rows (ratio 1 up to rounding) do not count as truncated
    plain = learner_for(plain, policy, train_config())
    assert plain.loss(fresh)[1]["policy/clip_frac"] == 0.0
    rows = algo.rows_for_update(fresh)
    assert rows.batch_size == 10
    assert torch.equal(rows.completion_ids[:6, :5], fresh.completion_ids)
    old_rows = {tuple(r) for r in first.completion_ids.tolist()}
    assert all(tuple(r[:5]) in old_rows for r in rows.completion_ids[6:].tolist())

    logp, ent = reference_scores(policy, rows)
    ratio = torch.where(rows.completion_mask, torch.exp(logp - rows.behaviour_logprobs.double()), 1.0)
    weight = ratio.clamp(max=1.1)
    adv = rows.advantages.double()[:, None]
    per_token = -weight * adv * logp - 0.02 * ent
    m = Masked(rows.completion_mask)
    stale = ratio[6:][rows.completion_mask[6:]]
    assert (stale > 1.1).any() and (stale < 1.0).any()  # truncation is active on some replayed tokens
    loss, metrics = algo.loss(rows)
    assert loss.item() == pytest.approx(m.token_mean(per_token), rel=1e-5, abs=1e-6)
    assert metrics["policy/clip_frac"] == pytest.approx(m.token_mean((ratio > 1.1).double()), abs=1e-6)
    assert metrics["policy/clip_frac"] > 0

    with pytest.raises(ConfigError, match=r"^reinforce\.replay_rows: replay needs both"):
        build("reinforce", replay_capacity=2)


def test_grpo_replay_adds_stale_rows_with_their_reference_log_probs_to_the_clipped_loss():
    policy, reference = ToyPolicy(0), ToyPolicy(5)
    algo = learner_for(
        build("grpo", beta=0.3, replay_capacity=2, replay_rows=4), policy, train_config(lr=0.05), reference=reference
    )
    first = algo.prepare(shifted_batch(policy, seed=1, scale=0.0))
    assert algo.rows_for_update(first) is first  # nothing stored yet
    algo.update(first)  # the policy moves: first's behaviour log-probs are now stale
    fresh = algo.prepare(shifted_batch(policy, seed=2, scale=0.0, lengths=[2, 5, 5, 3, 4, 4]))
    rows = algo.rows_for_update(fresh)
    assert rows.batch_size == 10
    assert torch.equal(rows.completion_ids[:6, :5], fresh.completion_ids)
    old = {tuple(r): i for i, r in enumerate(first.completion_ids.tolist())}
    picked = [old[tuple(r[:5])] for r in rows.completion_ids[6:].tolist()]
    # a replayed row keeps the advantage and the reference log-probs of its own batch
    assert rows.advantages[6:].tolist() == first.advantages[picked].tolist()
    torch.testing.assert_close(rows.ref_logprobs[6:, :5], first.ref_logprobs[picked])

    logp = reference_logprobs(policy, rows)
    ref = rows.ref_logprobs.double()
    surrogate, _ratio, clipped = clipped_surrogate(
        logp, rows.behaviour_logprobs.double(), rows.advantages.double(), 0.2, 0.2
    )
    k3 = torch.exp(ref - logp) - 1 - (ref - logp)
    m = Masked(rows.completion_mask)
    loss, metrics = algo.loss(rows)
    assert loss.item() == pytest.approx(m.token_mean(surrogate + 0.3 * k3), rel=1e-5, abs=1e-6)
    assert clipped[6:][rows.completion_mask[6:]].any()  # the clip bounds some stale tokens
    assert metrics["policy/clip_frac"] == pytest.approx(m.token_mean(clipped.double()), abs=1e-6)

    with pytest.raises(ConfigError, match=r"^grpo\.replay_capacity: replay needs both"):
        build("grpo", replay_rows=2)
    dapo = build("dapo", replay_capacity=2, replay_rows=4)
    with pytest.raises(ConfigError, match=r"^optimizer\.options\.replay_capacity: dapo does not replay"):
        dapo = learner_for(dapo, ToyPolicy(), train_config())


def test_replay_buffer_gathers_the_drawn_rows_of_a_whole_buffer_draw_and_keeps_informative_rows_only_when_asked():
    from palestra.rl.replay import ReplayBuffer
    from palestra.types import Experience

    policy = ToyPolicy()
    algo = learner_for(build("grpo"), policy, train_config())
    # three stored batches of different completion widths, then a fresh one; rewards with one tied group each
    batches = [
        algo.prepare(shifted_batch(policy, seed=s, lengths=lengths, rewards=[1.0, 1.0, 1.0, 0.0, 1.0, 1.0]))
        for s, lengths in ((1, [2, 3, 3, 1, 2, 3]), (2, [4, 5, 5, 3, 4, 4]), (3, [1, 1, 2, 1, 1, 1]))
    ]
    fresh = algo.prepare(shifted_batch(policy, seed=4))
    pad = policy.tokenizer.pad_token_id

    buffer = ReplayBuffer(2, 5)
    for b in batches:
        buffer.add(b)
    assert buffer.stored_rows == 12  # capacity 2: the first batch is gone
    mixed = buffer.mix(fresh, torch.Generator().manual_seed(7), pad_token_id=pad)
    # the same rows as drawing from the whole buffer concatenated (the draw is a permutation of all stored rows)
    whole = Experience.concat(list(buffer.batches), pad_token_id=pad)
    want = torch.randperm(12, generator=torch.Generator().manual_seed(7))[:5].sort().values
    expect = whole.select(want)
    assert mixed.batch_size == 6 + 5
    assert torch.equal(mixed.completion_ids[:6, : fresh.completion_ids.shape[1]], fresh.completion_ids)
    width = expect.completion_ids.shape[1]
    assert torch.equal(mixed.completion_ids[6:, :width], expect.completion_ids)
    assert not mixed.completion_mask[6:, width:].any()
    assert torch.equal(mixed.advantages[6:], expect.advantages)
    assert torch.equal(mixed.behaviour_logprobs[6:, :width], expect.behaviour_logprobs)
    assert mixed.agent_ids[6:] == expect.agent_ids
    assert torch.equal(
        ReplayBuffer(1, 3).mix(fresh, torch.Generator(), pad_token_id=pad).completion_ids, fresh.completion_ids
    )

    # informative_only: the tied group's rows (advantage exactly 0) are not kept; its batch still counts in the window.
    # (A row whose reward equals its group's mean has advantage 0 too, and is dropped the same way.)
    informative = ReplayBuffer(2, 100, informative_only=True)
    for b in batches:
        informative.add(b)
    assert [b.batch_size for b in informative.batches] == [3, 3]
    assert all(bool(b.advantages.ne(0).all()) for b in informative.batches)
    kept = informative.mix(fresh, torch.Generator(), pad_token_id=pad)
    assert kept.batch_size == 6 + 6
    assert sorted(kept.rewards[6:].tolist()) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # the untied group of each batch


def test_replay_informative_only_is_an_option_and_checkpoints_keep_the_buffer():
    policy = ToyPolicy()
    learner = learner_for(
        build("grpo", replay_capacity=3, replay_rows=4, replay_informative_only=True), policy, train_config()
    )
    batch = learner.prepare(shifted_batch(policy, seed=1, rewards=[1.0, 1.0, 1.0, 0.0, 1.0, 1.0]))
    learner.update(batch)
    assert learner.replay is not None and learner.replay.stored_rows == 3
    state = learner.state_dict()
    assert set(state["extra"]) == {"replay"}
    again = learner_for(
        build("grpo", replay_capacity=3, replay_rows=4, replay_informative_only=True), policy, train_config()
    )
    again.load_state_dict(state)
    assert torch.equal(again.replay.batches[0].completion_ids, learner.replay.batches[0].completion_ids)
    with pytest.raises(KeyError, match="replay is on but the checkpoint has no replay buffer"):
        again.load_state_dict({**state, "extra": {}})
    plain = learner_for(build("grpo"), policy, train_config())
    assert plain.replay is None and plain.state_dict()["extra"] == {}


def test_reinforce_keeps_its_running_statistics_beside_the_learners_replay_buffer():
    policy = ToyPolicy()
    learner = learner_for(build("reinforce", replay_capacity=2, replay_rows=3), policy, train_config())
    learner.update(learner.prepare(shifted_batch(policy, seed=1)))
    state = learner.state_dict()
    assert set(state["extra"]) == {"replay", "agents", "moments"}
    again = learner_for(build("reinforce", replay_capacity=2, replay_rows=3), policy, train_config())
    again.load_state_dict(state)
    assert again.replay.stored_rows == 6 and again.algorithm.agents == learner.algorithm.agents
    plain = learner_for(build("reinforce"), policy, train_config())  # replay off: a buffer in the state is refused
    with pytest.raises(KeyError, match="extra state has keys"):
        plain.load_state_dict({**plain.state_dict(), "extra": state["extra"]})


# ---- every algorithm: checkpoints and gradient accumulation ----------------------------------------------------
OPTIONS = {
    "reinforce": {"replay_capacity": 2, "replay_rows": 3},
    "grpo": {"replay_capacity": 2, "replay_rows": 3},
    "dr_grpo": {"replay_capacity": 2, "replay_rows": 3, "replay_informative_only": True},
}


def _setup(name: str, seed: int = 0, **train):
    policy = ToyPolicy(seed)
    algo = build(name, **OPTIONS.get(name, {}))
    return policy, learner_for(
        algo, policy, train_config(**train), reference=ToyPolicy(5) if algo.needs_reference else None
    )


def _step(policy, algo, seed: int) -> dict[str, float]:
    batch = algo.prepare(shifted_batch(policy, seed=seed, scale=0.05))
    return algo.update(batch)


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_continues_bitwise(name):
    train = dict(updates_per_batch=2, grad_accum=2, lr_schedule="cosine", warmup_steps=1, steps=4)
    policy, algo = _setup(name, **train)
    _step(policy, algo, seed=1)
    saved_policy = copy.deepcopy(policy.state_dict())
    saved_algo = copy.deepcopy(algo.state_dict())
    metrics_a = [_step(policy, algo, seed=s) for s in (2, 3)]

    policy_b, algo_b = _setup(name, seed=42, **train)  # different initial weights and shuffling seed
    policy_b.load_state_dict(saved_policy)
    algo_b.load_state_dict(saved_algo)
    metrics_b = [_step(policy_b, algo_b, seed=s) for s in (2, 3)]
    for (k, a), b in zip(policy.state_dict().items(), policy_b.state_dict().values()):
        assert torch.equal(a, b), k
    assert metrics_a == metrics_b


@pytest.mark.parametrize("name", ALL)
def test_grad_accum_gives_the_full_batch_gradient(name):
    grads = []
    for k in (1, 2, 3):
        policy, algo = _setup(name, grad_accum=k)
        metrics = _step(policy, algo, seed=1)
        # AdamW's first moment after one step is (1 - beta1) * grad: the accumulated gradient.
        grads.append(([algo.optimizer.state[p]["exp_avg"] / 0.1 for p in policy.parameters()], metrics))
    (g1, m1) = grads[0]
    for gk, mk in grads[1:]:
        for a, b in zip(g1, gk):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert mk["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
        assert mk["grad/norm"] == pytest.approx(m1["grad/norm"], rel=1e-5)
