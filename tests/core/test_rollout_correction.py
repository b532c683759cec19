"""Rollout correction (palestra.rl.rollout_correction and the learner's use of it): behaviour log-probs from a
deliberately perturbed copy of the policy, the weights, masks and gap metrics against float64 hand formulas
(plain Python over tokens), the corrected loss's gradient against a float64 autograd of the formula, and a short
training run with the correction on."""

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

from palestra.config import ConfigError, check_options
from palestra.plugin_manager import get_registry
from palestra.rl.rollout_correction import RolloutCorrectionOptions, rollout_mismatch

torch.set_num_threads(1)

REWARDS = [1.0, 0.0, 0.5, 0.2, 0.9, 1.0]
GROUPS = [0, 0, 0, 7, 7, 7]
LENGTHS = [5, 3, 4, 1, 5, 2]


def perturbed(policy: ToyPolicy, scale: float, seed: int = 11) -> ToyPolicy:
    """A copy of ``policy`` with every weight moved by N(0, scale): a sampler that is not quite the learner."""
    other = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def batch_from(behaviour: ToyPolicy, seed: int = 1):
    """The 2-group batch with behaviour log-probs from ``behaviour`` (float64 path, stored in float32)."""
    batch = make_batch(REWARDS, GROUPS, lengths=LENGTHS, seed=seed)
    batch.behaviour_logprobs = reference_logprobs(behaviour, batch).float()
    return batch


def hand_weights(learner, behaviour, mask, level, mode, threshold, low):
    """Float64 weights, truncated and rejected flags, token by token in plain Python."""
    B, T = mask.shape
    w = [[0.0] * T for _ in range(B)]
    truncated = [[False] * T for _ in range(B)]
    rejected = [[False] * T for _ in range(B)]
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        seq = sum(float(learner[b, t]) - float(behaviour[b, t]) for t in valid)
        for t in valid:
            log_rho = seq if level == "sequence" else float(learner[b, t]) - float(behaviour[b, t])
            rho = math.exp(log_rho)
            if mode == "truncate":
                w[b][t] = min(rho, threshold)
                truncated[b][t] = rho > threshold
            else:
                rejected[b][t] = not (low <= rho <= threshold)
                w[b][t] = 0.0 if rejected[b][t] else rho
    return torch.tensor(w, dtype=torch.float64), torch.tensor(truncated), torch.tensor(rejected)


def token_mean(x, mask) -> float:
    vals = [float(x[b, t]) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    return sum(vals) / len(vals)


# ---- the weights and the gap, as functions ----------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_weights_masks_and_gap_match_hand_formulas(level, mode):
    policy = ToyPolicy()
    batch = batch_from(perturbed(policy, 0.3))
    learner = reference_logprobs(policy, batch)
    mu, mask = batch.behaviour_logprobs.double(), batch.completion_mask
    threshold, low = 1.5, 0.6
    opts = RolloutCorrectionOptions(
        level=level, mode=mode, threshold=threshold, mask_low=low if mode == "mask" else None
    )
    weights, metrics = rollout_mismatch(learner.float(), batch.behaviour_logprobs, mask, opts)
    want, truncated, rejected = hand_weights(learner, mu, mask, level, mode, threshold, low)
    torch.testing.assert_close(weights.double(), want, rtol=2e-5, atol=1e-6)

    gaps = [abs(float(learner[b, t]) - float(mu[b, t])) for b in range(6) for t in range(5) if mask[b, t]]
    k3 = torch.tensor(
        [
            [math.exp(float(learner[b, t] - mu[b, t])) - 1 - float(learner[b, t] - mu[b, t]) for t in range(5)]
            for b in range(6)
        ]
    )
    assert float(metrics["logp_gap_mean"]) == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)
    assert float(metrics["logp_gap_max"]) == pytest.approx(max(gaps), rel=1e-5)
    assert float(metrics["kl"]) == pytest.approx(token_mean(k3, mask), rel=1e-4)
    assert float(metrics["is_weight_mean"]) == pytest.approx(token_mean(want, mask), rel=1e-5)
    assert float(metrics["truncated_frac"]) == pytest.approx(token_mean(truncated.double(), mask))
    assert float(metrics["masked_frac"]) == pytest.approx(token_mean(rejected.double(), mask))
    # the perturbation is big enough that the bounds act, and not so big that they act everywhere
    acted = truncated if mode == "truncate" else rejected
    assert 0 < token_mean(acted.double(), mask) < 1
    if level == "sequence":  # one weight per row
        for b in range(6):
            row = want[b][mask[b]]
            assert torch.all(row == row[0])


def test_no_perturbation_gives_unit_weights_and_masks_nothing():
    policy = ToyPolicy()
    batch = batch_from(policy)  # the sampler is the learner
    learner = reference_logprobs(policy, batch).float()
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            weights, m = rollout_mismatch(
                learner,
                batch.behaviour_logprobs,
                batch.completion_mask,
                RolloutCorrectionOptions(level=level, mode=mode),
            )
            torch.testing.assert_close(weights, batch.completion_mask.float())
            assert float(m["masked_frac"]) == 0.0 and float(m["truncated_frac"]) == 0.0
            assert float(m["is_weight_mean"]) == 1.0
            assert float(m["logp_gap_max"]) == 0.0 and float(m["kl"]) == 0.0


def test_a_long_sequence_ratio_does_not_overflow():
    learner = torch.full((1, 400), -0.1)
    behaviour = torch.full((1, 400), -1.1)  # sum of log-ratios 400: exp would be inf
    mask = torch.ones(1, 400, dtype=torch.bool)
    w, m = rollout_mismatch(learner, behaviour, mask, RolloutCorrectionOptions(level="sequence", threshold=3.0))
    assert torch.all(w == 3.0) and float(m["truncated_frac"]) == 1.0
    w, m = rollout_mismatch(learner, behaviour, mask, RolloutCorrectionOptions(level="sequence", mode="mask"))
    assert torch.all(w == 0.0) and float(m["masked_frac"]) == 1.0
    assert math.isfinite(float(m["kl"]))


def test_bad_options_name_the_key():
    opts = {"rollout_correction": {"level": "sequence", "mode": "mask", "threshold": 2.0, "mask_low": 3.0}}
    with pytest.raises(
        ConfigError, match=r"^grpo\.rollout_correction\.mask_low: must be below threshold \(2\.0\), got 3\.0$"
    ):
        get_registry().get("optimizer", "grpo").factory(**opts)
    with pytest.raises(ConfigError, match=r"^grpo\.rollout_correction\.threshold: must be >= 1"):
        check_options(
            get_registry().get("optimizer", "grpo").options, {"rollout_correction": {"threshold": 0.5}}, where="grpo"
        )
    with pytest.raises(ConfigError, match=r"^ppo\.rollout_correction\.mask_low: only mode 'mask' uses a lower bound"):
        get_registry().get("optimizer", "ppo").factory(rollout_correction={"level": "token", "mask_low": 0.5})


# ---- the corrected loss and its gradient ------------------------------------------------------------------------
def float64_logprobs(policy64: ToyPolicy, batch) -> torch.Tensor:
    """Differentiable float64 log-probs [B, T] (0 where masked) of a float64 copy of the toy policy."""
    p, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    hidden, _ = policy64.trunk(ids, mask, (mask.long().cumsum(-1) - 1).clamp(min=0))
    logq = torch.log_softmax(policy64.head(hidden[:, p - 1 : p + t - 1]), -1)
    logp = logq.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    return torch.where(batch.completion_mask, logp, torch.zeros_like(logp))


@pytest.mark.parametrize(
    "level,mode,moved",
    [
        ("token", "truncate", False),
        ("sequence", "mask", False),
        ("token", "mask", True),
        ("sequence", "truncate", True),
    ],
)
def test_corrected_grpo_loss_and_gradient_match_float64(level, mode, moved):
    """``-w * min(r A, clip(r) A)`` with ``r = pi / pi_old`` and ``w`` from ``pi_old / mu``: in the only pass
    ``pi_old`` is this forward's (r = 1); ``moved`` sets ``batch.old_logprobs`` as a later pass has them."""
    policy = ToyPolicy()
    algo = (
        get_registry()
        .get("optimizer", "grpo")
        .factory(
            clip_eps=0.2,
            rollout_correction={
                "level": level,
                "mode": mode,
                "threshold": 1.5,
                "mask_low": 0.6 if mode == "mask" else None,
            },
        )
    )
    algo = learner_for(algo, policy, train_config())
    batch = algo.prepare(batch_from(perturbed(policy, 0.3)))
    policy64 = copy.deepcopy(policy).double()
    logp64 = float64_logprobs(policy64, batch)
    old = logp64.detach()
    if moved:
        shift = torch.randn(old.shape, generator=torch.Generator().manual_seed(5)) * 0.3
        old = torch.where(batch.completion_mask, old + shift, torch.zeros_like(old))
        batch.old_logprobs = old.float()
    w, _, rejected = hand_weights(old, batch.behaviour_logprobs.double(), batch.completion_mask, level, mode, 1.5, 0.6)
    adv = batch.advantages.double()[:, None].expand_as(old)
    ratio = torch.exp(logp64 - old.float().double())
    hand = -w * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    m = batch.completion_mask.double()
    hand_loss = (hand * m).sum() / m.sum()
    hand_loss.backward()

    loss, metrics = algo.loss(batch)
    loss.backward()
    assert loss.item() == pytest.approx(hand_loss.item(), rel=1e-5, abs=1e-7)
    for (name, p), p64 in zip(policy.named_parameters(), policy64.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert metrics["rollout/masked_frac"] == pytest.approx(token_mean(rejected.double(), batch.completion_mask))
    if moved:
        assert 0 < metrics["policy/clip_frac"] < 1  # the proximal ratio clips on some tokens
    else:
        assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/clip_frac"] == 0.0


def test_without_correction_the_ratio_is_against_the_behaviour_and_the_gap_is_still_logged():
    policy = ToyPolicy()
    algo = get_registry().get("optimizer", "grpo").factory(clip_eps=0.2)
    algo = learner_for(algo, policy, train_config())
    batch = algo.prepare(batch_from(perturbed(policy, 0.3)))
    learner = reference_logprobs(policy, batch)
    _, metrics = algo.loss(batch)
    ratio = torch.exp(learner - batch.behaviour_logprobs.double())
    assert metrics["policy/ratio_mean"] == pytest.approx(token_mean(ratio, batch.completion_mask), rel=1e-5)
    gap = (learner - batch.behaviour_logprobs.double()).abs()
    assert metrics["rollout/logp_gap_mean"] == pytest.approx(token_mean(gap, batch.completion_mask), rel=1e-5)
    assert "rollout/is_weight_mean" not in metrics


# ---- the update: micro-batches, passes ---------------------------------------------------------------------------
def test_update_reports_the_pre_update_gap_over_micro_batches_and_passes():
    """grad_accum=2 and two passes: the gap is the first pass's, its max the max over micro-batches, and the
    second pass's proximal log-probs are the ones scored before the first step."""
    policy = ToyPolicy()
    algo = get_registry().get("optimizer", "grpo").factory(rollout_correction={"level": "token"}, diagnostics_every=0)
    algo = learner_for(algo, policy, train_config(grad_accum=2, updates_per_batch=2, lr=0.05))
    batch = algo.prepare(batch_from(perturbed(policy, 0.3)))
    learner = reference_logprobs(policy, batch)
    gap = (learner - batch.behaviour_logprobs.double()).abs()
    metrics = algo.update(batch)
    torch.testing.assert_close(batch.old_logprobs.double(), learner, rtol=1e-5, atol=1e-6)
    mask = batch.completion_mask
    assert metrics["rollout/logp_gap_mean"] == pytest.approx(token_mean(gap, mask), rel=1e-5)
    assert metrics["rollout/logp_gap_max"] == pytest.approx(float(gap[mask].max()), rel=1e-5)
    w = torch.clamp(torch.exp(learner - batch.behaviour_logprobs.double()), max=2.0)
    assert metrics["rollout/is_weight_mean"] == pytest.approx(token_mean(w, mask), rel=1e-5)
    assert policy is algo.policy and not torch.equal(reference_logprobs(policy, batch), learner)  # it stepped


def test_a_few_training_steps_with_correction_log_the_metrics(tmp_path, one_thread):
    from palestra.config import validate_config
    from palestra.engine.trainer import Trainer

    raw = {
        "run": {"name": "rc", "seed": 0, "output_dir": "runs"},
        "environment": {
            "name": "arithmetic",
            "options": {"difficulty": 1, "terms": 2, "operations": ["+"], "prompt": "{question} ="},
        },
        "reward": {"name": "format", "options": {"tag": "answer"}},
        "policy": {
            "name": "tiny",
            "options": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 256, "seed": None},
        },
        "optimizer": {
            "name": "grpo",
            "options": {
                "entropy_coef": 0.01,
                "diagnostics_every": 2,
                "rollout_correction": {"level": "sequence", "mode": "mask", "threshold": 2.0},
            },
        },
        "loggers": [],
        "train": {
            "steps": 3,
            "batch_size": 4,
            "group_size": 4,
            "max_new_tokens": 6,
            "updates_per_batch": 2,
            "eval_size": 4,
            "eval_every": 0,
            "save_every": 0,
            "device": "cpu",
        },
    }
    history = Trainer(validate_config(raw), run_dir=tmp_path).train().history
    assert len(history) == 3
    for step, metrics in enumerate(history):
        for key in (
            "rollout/logp_gap_mean",
            "rollout/logp_gap_max",
            "rollout/kl",
            "rollout/is_weight_mean",
            "rollout/truncated_frac",
            "rollout/masked_frac",
            "diag/tied_group_frac",
            "policy/clip_frac",
        ):
            assert math.isfinite(metrics[key]), (step, key)
        # the sampler is the learner here: float noise only, nothing rejected
        assert metrics["rollout/logp_gap_max"] < 1e-3 and metrics["rollout/masked_frac"] == 0.0
        assert ("diag/entropy_grad_share" in metrics) == (step % 2 == 0)


def test_a_loss_of_its_own_gets_the_correction_from_the_learner():
    """The learner corrects through the batch it hands the loss (weighted advantages, proximal old_logprobs), so a
    loss written without any correction helper is corrected like GRPO's."""
    from palestra.plugins.optimizers.grpo import GRPO
    from palestra.rl import aggregate, clipped_surrogate

    class Bare(GRPO):  # its own surrogate, aggregated by hand
        name = "bare"

        def loss(self, batch, scores):
            per_token, _ = clipped_surrogate(
                scores.logprobs, batch.old_logprobs, batch.advantages, batch.completion_mask
            )
            return aggregate(per_token, batch.completion_mask, "token_mean"), {}

    policy = ToyPolicy()
    options = {"rollout_correction": {"level": "token", "threshold": 1.5}}
    bare = learner_for(Bare(**options), policy, train_config())
    batch = bare.prepare(batch_from(perturbed(policy, 0.3)))
    loss, metrics = bare.loss(batch)
    assert "rollout/is_weight_mean" in metrics
    assert loss.item() == pytest.approx(
        learner_for(GRPO(**options), policy, train_config()).loss(batch)[0].item(), rel=1e-6
    )
    assert abs(learner_for(Bare(), policy, train_config()).loss(batch)[0].item() - loss.item()) > 1e-4
