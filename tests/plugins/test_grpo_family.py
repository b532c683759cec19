"""DAPO, GSPO and CISPO (plugins/optimizers/grpo_family.py) and the ``overlong`` reward (plugins/rewards/length.py).

Losses against float64 hand computations on the tiny real policy of ``algo_helpers`` (log-probs from a plain-torch
path that does not use palestra's kernels), with clipping active; DAPO's dynamic sampling (which rows an update
trains on, the gradient it gives, the no-op when every group ties); micro-batching invariance; a few real steps each.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from algo_helpers import Masked, ToyPolicy, learner_for, make_batch, reference_scores, with_behaviour
from algo_helpers import train_config as base_config

from palestra.config import ConfigError
from palestra.engine.algorithm import Algorithm
from palestra.engine.learner import Learner
from palestra.plugin_manager import get_registry

torch.set_num_threads(1)

FAMILY = ["dapo", "gspo", "cispo"]
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.2, 0.2, 0.0, 1.0, 1.0]  # group 7 ties: DAPO drops it
GROUPS = [0, 0, 0, 7, 7, 7, 9, 9, 9]
LENGTHS = [5, 3, 4, 1, 5, 2, 4, 5, 2]
REPO = Path(__file__).resolve().parents[2]


def train_config(**overrides):
    return base_config(**{"batch_size": 3, "group_size": 3, **overrides})  # the batches here: 3 groups of 3


def build(name: str, **options) -> Algorithm:
    return get_registry().get("optimizer", name).factory(**options)


def shifted_batch(policy: ToyPolicy, seed: int = 1, scale: float = 0.4, rewards=REWARDS):
    """Three groups of three; behaviour log-probs off the policy's by N(0, scale) so that ratios clip."""
    batch = make_batch(rewards, GROUPS, lengths=LENGTHS, seed=seed)
    shifts = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(seed + 100)) * scale
    return with_behaviour(policy, batch, shifts)


def group_adv(rewards, g: int = 3, eps: float = 1e-4) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, g)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).reshape(-1)


def first_moment_grads(algo: Learner, policy: ToyPolicy) -> list[torch.Tensor]:
    """The gradient of the one step taken: AdamW's first moment after one step is (1 - beta1) * grad."""
    return [algo.optimizer.state[p]["exp_avg"] / 0.1 for p in policy.parameters()]


# ---- registry and options ----------------------------------------------------------------------------------------
def test_registry_and_defaults():
    names = get_registry().names("optimizer")
    assert set(FAMILY) <= set(names)
    d, g, c = build("dapo"), build("gspo"), build("cispo")
    assert (d.options.clip_eps, d.options.clip_eps_high, d.options.loss_agg, d.options.dynamic_sampling) == (
        0.2,
        0.28,
        "token_mean",
        True,
    )
    assert (g.options.clip_eps, g.options.clip_eps_high, g.options.loss_agg) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert (c.options.clip_eps, c.options.clip_eps_high, c.options.loss_agg) == (None, 4.0, "token_mean")
    assert all(a.options.beta == 0.0 and a.options.scale == "group" and not a.needs_reference for a in (d, g, c))


def test_option_errors_name_the_option():
    with pytest.raises(ConfigError, match=r"^dapo\.tie_tolerance: must be >= 0"):
        build("dapo", tie_tolerance=-1.0)
    with pytest.raises(ConfigError, match=r"^gspo\.clip_eps: must be < 1"):
        build("gspo", clip_eps=1.5)
    with pytest.raises(ConfigError, match=r"^cispo\.clip_eps_high: must be > 0"):
        build("cispo", clip_eps_high=0.0)
    with pytest.raises(ConfigError, match=r"^gspo\.loss_agg: expected one of .*seq_mean_token_sum"):
        build("gspo", loss_agg="sum")
    policy = ToyPolicy()
    with pytest.raises(ConfigError, match=r"^train\.group_size: cispo's group-relative advantages need at least 2"):
        learner_for(build("cispo"), policy, train_config(group_size=1))


# ---- DAPO ------------------------------------------------------------------------------------------------------------
def test_dapo_trains_only_on_informative_groups_with_clip_higher():
    policy = ToyPolicy()
    algo = learner_for(build("dapo", entropy_coef=0.01), policy, train_config())
    batch = algo.prepare(shifted_batch(policy))
    adv = group_adv(REWARDS)
    torch.testing.assert_close(batch.advantages.double(), adv, rtol=1e-5, atol=1e-6)
    assert not batch.advantages[3:6].any()  # the tied group

    rows = algo.rows_for_update(batch)
    assert rows.group_ids.tolist() == [0, 0, 0, 9, 9, 9]
    kept = torch.tensor([0, 1, 2, 6, 7, 8])
    logp, ent = reference_scores(policy, rows)
    ratio = torch.exp(logp - rows.behaviour_logprobs.double())
    a = adv[kept][:, None].expand_as(ratio)
    per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a) - 0.01 * ent
    m = Masked(rows.completion_mask)
    clipped = ((ratio > 1.28) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    only_higher = (ratio > 1.2) & (ratio <= 1.28) & (a > 0)  # kept by clip-higher, cut by a symmetric 0.2
    assert 0 < m.token_mean(clipped.double()) < 1 and (only_higher & rows.completion_mask).any()
    loss, metrics = algo.loss(rows)
    assert loss.item() == pytest.approx(m.token_mean(per_token), rel=1e-5, abs=1e-6)
    assert metrics["policy/clip_frac"] == pytest.approx(m.token_mean(clipped.double()), abs=1e-6)

    # The update's gradient is that loss's gradient: the tied group plays no part, not even through the entropy.
    twin = ToyPolicy()
    learner_for(build("dapo", entropy_coef=0.01), twin, train_config()).loss(rows)[0].backward()
    metrics = algo.update(batch)
    for got, p in zip(first_moment_grads(algo, policy), twin.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-7)
    assert metrics["dapo/kept_groups_frac"] == pytest.approx(2 / 3)
    assert metrics["dapo/empty_update"] == 0.0 and metrics["train/skipped"] == 0.0


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_dapo_row_weights_give_the_selection_gradient_when_rows_are_too_few_to_split(loss_agg):
    """6 kept rows cannot fill grad_accum=9 micro-batches: every row stays, weighted; the gradient is the same."""
    grads = []
    for k in (1, 9):
        policy = ToyPolicy()
        algo = learner_for(build("dapo", loss_agg=loss_agg, entropy_coef=0.01), policy, train_config(grad_accum=k))
        batch = algo.prepare(shifted_batch(policy))
        rows = algo.rows_for_update(batch)
        assert rows.batch_size == (6 if k == 1 else 9) and ("dapo_row_weight" in rows.extras) == (k == 9)
        metrics = algo.update(batch)
        grads.append((first_moment_grads(algo, policy), metrics))
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert grads[0][1]["loss"] == pytest.approx(grads[1][1]["loss"], rel=1e-5)


def test_dapo_update_is_a_no_op_when_every_group_ties(caplog):
    policy = ToyPolicy()
    algo = learner_for(build("dapo"), policy, train_config(lr_schedule="linear", warmup_steps=2, steps=4))
    before = [p.detach().clone() for p in policy.parameters()]
    batch = algo.prepare(shifted_batch(policy, rewards=[0.5] * 3 + [0.0] * 3 + [1.0] * 3))
    with caplog.at_level("INFO", logger="palestra.plugins.optimizers.grpo_family"):
        metrics = algo.update(batch)
    assert metrics["dapo/empty_update"] == 1.0 and metrics["dapo/kept_groups_frac"] == 0.0
    assert metrics["train/skipped"] == 0.0 and metrics["loss"] == 0.0
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters()))
    assert not algo.optimizer.state  # no optimiser step
    assert algo.scheduler.last_epoch == 0  # nor a schedule step
    assert [r.getMessage() for r in caplog.records] == [
        "dapo.update: every one of the 3 groups has tied rewards; no update this step"
    ]


def test_dapo_without_dynamic_sampling_is_grpo_with_clip_higher():
    policy = ToyPolicy()
    dapo, grpo = build("dapo", dynamic_sampling=False), build("grpo", clip_eps_high=0.28)
    dapo = learner_for(dapo, policy, train_config())
    grpo = learner_for(grpo, policy, train_config())
    batch = dapo.prepare(shifted_batch(policy))
    assert dapo.rows_for_update(batch) is batch
    assert dapo.loss(batch)[0].item() == pytest.approx(grpo.loss(batch)[0].item(), rel=1e-6)


def test_dapo_tie_tolerance():
    policy = ToyPolicy()
    rewards = [1.0, 0.0, 0.5, 0.2, 0.2005, 0.2, 0.0, 1.0, 1.0]
    for tol, groups in ((0.0, [0, 7, 9]), (1e-3, [0, 9])):
        algo = learner_for(build("dapo", tie_tolerance=tol), policy, train_config())
        rows = algo.rows_for_update(algo.prepare(shifted_batch(policy, rewards=rewards)))
        assert sorted(set(rows.group_ids.tolist())) == groups


# ---- DAPO's refill ---------------------------------------------------------------------------------------------------
def test_dapo_refill_options_are_checked():
    with pytest.raises(ConfigError, match=r"^dapo\.refill_rounds: must be >= 0"):
        build("dapo", refill_rounds=-1)
    algo = build("dapo", dynamic_sampling=False, refill_rounds=2)
    with pytest.raises(ConfigError, match=r"^optimizer\.options\.refill_rounds: refills replace the tied groups"):
        algo = learner_for(algo, ToyPolicy(), train_config())


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_dapo_with_refill_counts_the_groups_short_and_keeps_the_first_informative_ones(batch_size):
    """Groups 0 and 9 carry a signal, 7 ties: an update of ``batch_size`` groups lacks max(0, batch_size - 2) and
    trains on the first min(batch_size, 2) informative groups, in sampling order."""
    policy = ToyPolicy()
    algo = learner_for(build("dapo", refill_rounds=1), policy, train_config(batch_size=batch_size))
    assert algo.algorithm.refill_rounds == 1 and build("dapo").refill_rounds == 0
    batch = algo.prepare(shifted_batch(policy))
    assert algo.algorithm.groups_short(batch) == max(0, batch_size - 2)
    rows = algo.rows_for_update(batch)
    assert rows.group_ids.tolist() == [0, 0, 0, 9, 9, 9][: 3 * min(batch_size, 2)]
    torch.testing.assert_close(
        rows.advantages.double(), group_adv(REWARDS)[[0, 1, 2, 6, 7, 8]][: rows.batch_size], rtol=1e-5, atol=1e-6
    )


def refill_trainer(tmp_path, *overrides):
    from palestra.config import load_config
    from palestra.engine.trainer import Trainer

    config = load_config(REPO / "examples" / "dapo.yaml", [
        "optimizer.options.dynamic_sampling=true", "optimizer.options.refill_rounds=2", "train.batch_size=4",
        "train.group_size=4", "train.steps=2", "train.eval_size=4", f"run.output_dir={tmp_path}", "loggers=[]",
        *overrides,
    ])  # fmt: skip
    return Trainer(config, run_dir=tmp_path / "run")


def test_the_trainer_refills_with_new_tasks_while_every_group_ties(tmp_path):
    """From random weights no completion is in the task's format (the example's reward without its overlong
    penalty), so every group ties at 0: both refill rounds are drawn, each
    a rollout of its own tasks and samples (reproducible from the step and the round), numbered after the last."""
    from palestra.rl import group_size_of

    trainer = refill_trainer(tmp_path, 'reward={name: format, options: {pattern: "^<answer>-?[0-9]+</answer>$"}}')
    generate_s = trainer.sampler.rollout(0).generate_s
    sampled = trainer.sampler.sample(0)
    batch, metrics = sampled.batch, sampled.metrics
    assert batch.batch_size == 3 * 16 and group_size_of(batch.group_ids, "test") == 4
    assert batch.group_ids.unique().numel() == 12
    assert not batch.rewards.any()
    assert metrics["rollout/refill_rounds"] == 2.0 and metrics["rollout/groups_short"] == 4.0
    assert metrics["perf/generate_s"] > generate_s  # the refills' sampling time counts in the step's
    again = trainer.sampler.rollout(0, refill=1).batch
    width = again.completion_ids.shape[1]
    assert torch.equal(batch.completion_ids[16:32, :width], again.completion_ids)
    prompts = [m["question"] for m in batch.metadata]
    assert prompts[16:32] != prompts[:16] and prompts[32:] != prompts[16:32]  # new tasks, not the same ones resampled

    metrics = trainer.step()  # and a whole step through the update
    assert metrics["rollout/refill_rounds"] == 2.0 and metrics["dapo/empty_update"] == 1.0


def test_the_trainer_does_not_refill_a_batch_that_is_already_full(tmp_path):
    """A length reward differs between almost any two random completions: every group carries a signal."""
    trainer = refill_trainer(tmp_path, "reward={name: length, options: {target: 12, unit: chars}}")
    first = trainer.sampler.rollout(0).batch
    assert trainer.algorithm.groups_short(first) == 0
    sampled = trainer.sampler.sample(0)
    metrics = sampled.metrics
    assert torch.equal(sampled.batch.completion_ids, first.completion_ids)  # the first rollout alone
    assert metrics["rollout/refill_rounds"] == 0.0 and metrics["rollout/groups_short"] == 0.0


# ---- GSPO and CISPO -------------------------------------------------------------------------------------------------
def test_gspo_loss_matches_hand_computation():
    policy = ToyPolicy()
    algo = learner_for(build("gspo", clip_eps=0.05, clip_eps_high=0.08, entropy_coef=0.01), policy, train_config())
    batch = algo.prepare(shifted_batch(policy, scale=0.15))
    torch.testing.assert_close(batch.advantages.double(), group_adv(REWARDS), rtol=1e-5, atol=1e-6)
    adv = batch.advantages.double()  # the tied group's exact zeros (float64 rounding leaves +-1e-13 there)
    logp, ent = reference_scores(policy, batch)
    mask = batch.completion_mask
    m = Masked(mask)
    lengths = mask.sum(-1).double()
    s = torch.exp(((logp - batch.behaviour_logprobs.double()) * mask).sum(-1) / lengths)
    seq_loss = -torch.minimum(s * adv, s.clamp(0.95, 1.08) * adv)
    per_token = seq_loss[:, None].expand_as(logp) - 0.01 * ent
    clipped = ((s > 1.08) & (adv > 0)) | ((s < 0.95) & (adv < 0))
    assert 0 < int(clipped.sum()) < int((adv != 0).sum())  # some sequences clipped, not all
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(m.seq_mean_token_mean(per_token), rel=1e-5, abs=1e-6)
    assert metrics["policy/clip_frac"] == pytest.approx(
        m.token_mean(clipped[:, None].expand_as(logp).double()), abs=1e-6
    )
    assert metrics["policy/ratio_mean"] == pytest.approx(m.token_mean(s[:, None].expand_as(logp)), rel=1e-5)
    assert metrics["policy/entropy"] == pytest.approx(m.token_mean(ent), rel=1e-5)


@pytest.mark.parametrize("clip_eps", [None, 0.3])
def test_cispo_loss_matches_hand_computation(clip_eps):
    policy = ToyPolicy()
    algo = learner_for(build("cispo", clip_eps=clip_eps, clip_eps_high=0.25), policy, train_config())
    batch = algo.prepare(shifted_batch(policy))
    torch.testing.assert_close(batch.advantages.double(), group_adv(REWARDS), rtol=1e-5, atol=1e-6)
    adv = batch.advantages.double()[:, None]
    logp, _ = reference_scores(policy, batch)
    ratio = torch.exp(logp - batch.behaviour_logprobs.double())
    weight = ratio.clamp(min=None if clip_eps is None else 1 - clip_eps, max=1.25)
    m = Masked(batch.completion_mask)
    clipped = (ratio > 1.25) | (
        (ratio < 1 - clip_eps) if clip_eps is not None else torch.zeros_like(ratio, dtype=torch.bool)
    )
    assert 0 < m.token_mean(clipped.double()) < 1
    loss, metrics = algo.loss(batch)
    assert loss.item() == pytest.approx(m.token_mean(-weight * adv * logp), rel=1e-5, abs=1e-6)
    assert metrics["policy/clip_frac"] == pytest.approx(m.token_mean(clipped.double()), abs=1e-6)


# ---- the learner: micro-batching, resume, a few real steps ----------------------------------------------------------
@pytest.mark.parametrize("name", FAMILY)
def test_grad_accum_gives_the_full_batch_gradient(name):
    grads = []
    for k in (1, 3):
        policy = ToyPolicy()
        algo = learner_for(build(name), policy, train_config(grad_accum=k, updates_per_batch=1))
        metrics = algo.update(algo.prepare(shifted_batch(policy, scale=0.05)))
        grads.append((first_moment_grads(algo, policy), metrics))
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert grads[1][1]["loss"] == pytest.approx(grads[0][1]["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("name", FAMILY)
def test_a_few_steps_raise_the_log_prob_of_the_best_completions(name):
    """Repeated updates on one batch: the rows with positive advantage become likelier, the negative ones less."""
    policy = ToyPolicy()
    algo = learner_for(build(name), policy, train_config(lr=0.05, updates_per_batch=2))
    batch = algo.prepare(shifted_batch(policy, scale=0.0))
    mask = batch.completion_mask
    before = (reference_scores(policy, batch)[0] * mask).sum(-1)
    for _ in range(4):
        metrics = algo.update(batch)
        assert all(math.isfinite(v) for v in metrics.values())
    change = (reference_scores(policy, batch)[0] * mask).sum(-1) - before
    adv = batch.advantages
    assert change[adv > 0.5].min() > 0 and change[adv < -0.5].max() < 0


@pytest.mark.parametrize("name", FAMILY)
def test_each_example_trains_through_the_cli(name, tmp_path, capsys):
    from palestra import cli

    out = tmp_path / "runs"
    code = cli.main(
        [
            "train",
            "--config",
            str(REPO / "examples" / f"{name}.yaml"),
            "train.steps=3",
            "train.eval_size=4",
            "train.batch_size=4",
            "train.group_size=4",
            f"run.output_dir={out}",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "\ntrained 3 steps in " in captured.out
    assert (out / name / "checkpoint.pt").is_file()


# ---- the overlong reward ------------------------------------------------------------------------------------------
def overlong(**options):
    return get_registry().get("reward", "overlong").factory(**options)


def test_overlong_is_dapos_soft_punishment():
    r = overlong(max_length=20, cache=5)
    completions = ["x" * n for n in (0, 15, 16, 18, 20, 21, 40)]
    want = [0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0]  # 0 up to 15, then (15 - n) / 5, -1 beyond 20
    got = r(["p"] * 7, completions, [{}] * 7)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want)
    assert r.max_score == 0.0
    words = overlong(max_length=4, cache=2, unit="words")
    assert words([""] * 3, ["a b", "a b c", "a b c d e"], [{}] * 3).tolist() == pytest.approx([0.0, -0.5, -1.0])


def test_overlong_options_errors():
    with pytest.raises(ConfigError, match=r"^overlong\.cache: must be <= max_length \(10\), got 11$"):
        overlong(max_length=10, cache=11)
    with pytest.raises(ConfigError, match=r"^overlong\.unit: expected one of"):
        overlong(unit="tokens")


def test_the_dapo_example_adds_the_overlong_penalty_to_the_task_reward(tmp_path):
    from palestra.config import build_component, load_config

    reward = build_component("reward", load_config(REPO / "examples" / "dapo.yaml").reward, path="reward")
    completions = ["<answer>3</answer>", "<answer>3</answer><answer>", "<answer>3</answer>" * 2]
    out = reward(["1 + 2 ="] * 3, completions, [{"answer": "3"}] * 3)
    # format 1, 0, 0 (correctness is still locked); overlong 0, (20 - 26) / 4 -> -1, -1
    assert out.scores.tolist() == pytest.approx([1.0, -1.0, -1.0])
    assert out.components["overlong"].tolist() == pytest.approx([0.0, -1.0, -1.0])
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "examples" / "dapo.yaml").read_text().replace("cache: 4", "cache: 40"))
    with pytest.raises(ConfigError, match=r"^reward\.options\.components\[1\]\.options\.cache: must be <= max_length"):
        load_config(bad)
