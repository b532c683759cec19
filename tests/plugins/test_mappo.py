"""The ``mappo`` optimiser: per-agent optimisers and normalisation, credit assignment, learning, checkpoints.

The learning checks use a small two-role environment defined here (a real Environment, driven by the real
rollout, generator, policy and optimiser): ``left`` must answer ``1``, then ``right`` (seeing left's answer)
must answer ``0``. It is learnt in seconds, so MAPPO and IPPO can both be shown to raise the reward quickly.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from palestra.config import AgentsConfig, TrainConfig
from palestra.context import TrainContext
from palestra.engine.learner import Learner
from palestra.engine.rollout import collect
from palestra.multiagent.credit import credit_plan
from palestra.multiagent.sharing import MultiAgentPolicy
from palestra.plugin_manager import get_registry
from palestra.plugins.policies.tiny import TinyTransformerPolicy
from palestra.types import Observation, RewardOutput, SamplingParams, StepResult

pytestmark = pytest.mark.usefixtures("one_thread")

AGENTS = ("left", "right")


class HandOver:
    """Two turns: ``left`` sees ``L?``, should say ``1``; ``right`` sees ``R<left's answer>?``, should say ``0``."""

    agent_ids = AGENTS
    max_turns = 2

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        self.turn = 0
        n = batch_size * group_size
        return [
            Observation(prompt="L?", agent_id="left", metadata={"task": i // group_size, "state": "L?"})
            for i in range(n)
        ]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            obs = [
                Observation(prompt=f"R{a[:1]}?", agent_id="right", turn=1, metadata={"state": f"L? {a[:1]}"})
                for a in actions
            ]
            return StepResult(observations=obs, done=[False] * len(actions), info=[{"left": {}} for _ in actions])
        return StepResult(
            observations=[None] * len(actions), done=[True] * len(actions), info=[{"right": {}} for _ in actions]
        )


def hand_over_reward(
    prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
) -> RewardOutput:
    """Role ``left``: its answer is ``1``. Role ``right`` (the team reward: the last turn): half for left's ``1``
    (read from right's prompt), half for its own ``0``."""
    scores, own = [], []
    for p, c, m in zip(prompts, completions, metadata):
        mine = float(c.startswith("1" if m["agent_id"] == "left" else "0"))
        own.append(mine)
        scores.append(mine if m["agent_id"] == "left" else 0.5 * float(p.startswith("R1")) + 0.5 * mine)
    return RewardOutput(torch.tensor(scores), {"own": torch.tensor(own)})


def tiny_policy(seed: int = 0) -> TinyTransformerPolicy:
    return TinyTransformerPolicy(
        d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=32, alphabet="01LR?", atoms=[], seed=seed
    )


def train_config(**kw: Any) -> TrainConfig:
    base = {
        "steps": 100,
        "batch_size": 16,
        "group_size": 1,
        "lr": 1e-2,
        "max_new_tokens": 2,
        "track_update_ratio": False,
    }
    return TrainConfig(**{**base, **kw})


def build(
    *,
    shared=("embedding", "encoder"),
    independent=("decoder",),
    update_frequency=1,
    credit="team",
    train: dict | None = None,
    **options: Any,
):
    torch.manual_seed(0)
    policy = MultiAgentPolicy(
        tiny_policy(), AgentsConfig(list(shared), list(independent), update_frequency, credit), AGENTS
    )
    algo = get_registry().get("optimizer", "mappo").factory(**options)
    return policy, Learner(algo, policy, TrainContext.local(train_config(**(train or {}))))


GEN = None


def rollout(policy, algo, step: int, credit: str = "team", batch: int = 16):
    global GEN
    GEN = GEN or get_registry().get("generator", "kv_cache").factory()
    ro = collect(
        HandOver(),
        policy,
        GEN,
        SamplingParams(max_new_tokens=2),
        batch,
        seed=step,
        rng=torch.Generator().manual_seed(1000 + step),
    )
    plan = credit_plan(ro.episodes, AGENTS, credit)
    team, agent_scores, metrics = plan.assign(hand_over_reward(*plan.rows))
    exp = ro.experience(
        team.scores, team.components, pad_token_id=policy.tokenizer.pad_token_id, agent_scores=agent_scores
    )
    return exp, float(team.scores.mean()), metrics


# ---- structure --------------------------------------------------------------------------------------------------
def test_per_agent_optimisers_are_separate_objects_covering_exactly_their_parameters() -> None:
    policy, algo = build()
    groups = policy.parameter_groups()
    assert set(algo.optimizers) == {"shared", "left", "right", "critic"}
    assert len({id(o) for o in algo.optimizers.values()}) == 4
    for name, params in groups.items():
        held = [p for g in algo.optimizers[name].param_groups for p in g["params"]]
        assert [id(p) for p in held] == [id(p) for p in params]
    critic = [p for g in algo.optimizers["critic"].param_groups for p in g["params"]]
    assert [id(p) for p in critic] == [id(p) for p in algo.algorithm.critic.parameters()]
    assert not {id(p) for p in critic} & {id(p) for p in policy.parameters()}, "the critic is its own network"
    assert {id(p) for p in policy.agent_parameters("left")} == {
        id(policy.for_agent("left").lm_head.weight),
        id(policy.for_agent("left").norm.weight),
    }
    _, single = build(per_agent_optimizer=False)
    assert set(single.optimizers) == {"policy", "critic"}


def test_each_agent_is_clipped_on_its_own() -> None:
    policy, algo = build(train={"max_grad_norm": 1e-3})
    exp, _, _ = rollout(policy, algo, 0)
    metrics = algo.update(algo.prepare(exp))
    for name in ("left", "right", "critic"):
        assert metrics[f"grad/norm/{name}"] > 1e-3  # the pre-clip norm is reported...
    for p in policy.agent_parameters("left"):
        assert p.grad is None  # ... and gradients are cleared after the step


def test_a_non_finite_loss_skips_the_update_and_leaves_every_parameter_alone() -> None:
    policy, algo = build()
    exp = algo.prepare(rollout(policy, algo, 0)[0])
    exp.advantages = exp.advantages.clone()
    exp.advantages[0] = float("nan")
    before = [p.detach().clone() for p in [*policy.parameters(), *algo.algorithm.critic.parameters()]]
    metrics = algo.update(exp)
    assert metrics["train/skipped"] == 1.0
    after = [*policy.parameters(), *algo.algorithm.critic.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# ---- normalisation ------------------------------------------------------------------------------------------------
def test_reward_and_value_normalisation_keep_per_agent_statistics() -> None:
    from palestra.kernels import RunningMoments, normalize_rewards

    policy, algo = build()
    exp, _, _ = rollout(policy, algo, 0)
    left = torch.tensor([a == "left" for a in exp.agent_ids])
    # Very different scales per agent: left's rewards around 100, right's around 0.
    exp.rewards = torch.where(left, 100.0 + torch.arange(len(left)).float(), torch.linspace(-1, 1, len(left)))
    rewards = exp.rewards.clone()
    algo.prepare(exp)
    mom = algo.algorithm.reward_moments
    assert mom.num_segments == 2
    torch.testing.assert_close(mom.mean[0], rewards[left].double().mean())
    torch.testing.assert_close(mom.mean[1], rewards[~left].double().mean())
    assert mom.count.tolist() == [float(left.sum()), float((~left).sum())]
    # The kernel with segment ids is what normalised them: each agent's rewards have mean 0 on its own.
    check = RunningMoments(num_segments=2)
    normed = normalize_rewards(rewards, check, segment_ids=(~left).long(), clip=5.0)
    assert abs(float(normed[left].mean())) < 1e-5 and abs(float(normed[~left].mean())) < 1e-5
    # The value normaliser saw each agent's returns (the reward on the last token, gamma 1) on its own.
    vn_mean, _ = algo.algorithm.value_normalizer.stats()
    assert abs(float(vn_mean[0])) < 1.0 and abs(float(vn_mean[1])) < 1.0  # normalised rewards, not 100
    # Advantages are whitened within each agent.
    for seg in (left, ~left):
        adv = exp.advantages[seg][exp.completion_mask[seg]]
        assert abs(float(adv.mean())) < 1e-4


# ---- credit ----------------------------------------------------------------------------------------------------------
def test_team_credit_gives_every_row_the_episode_reward_and_role_credit_each_agent_its_own() -> None:
    policy, algo = build()
    team, _, metrics = rollout(policy, algo, 3, credit="team")
    role, _, _ = rollout(policy, algo, 3, credit="role")
    assert team.agent_ids == ["left", "right"] * 16 == role.agent_ids
    for e in range(16):
        left_text = policy.tokenizer.decode(team.completion_ids[2 * e][team.completion_mask[2 * e]].tolist())
        right_text = policy.tokenizer.decode(team.completion_ids[2 * e + 1][team.completion_mask[2 * e + 1]].tolist())
        left_ok, right_ok = float(left_text.startswith("1")), float(right_text.startswith("0"))
        episode = 0.5 * left_ok + 0.5 * right_ok
        assert float(team.rewards[2 * e]) == float(team.rewards[2 * e + 1]) == episode
        assert float(role.rewards[2 * e]) == left_ok and float(role.rewards[2 * e + 1]) == episode
    assert team.metadata[1]["state"].startswith("L? ") and team.metadata[1]["agent_id"] == "right"
    assert set(metrics) == {"reward/agent/left", "reward/agent/right"}


# ---- learning --------------------------------------------------------------------------------------------------------
@pytest.mark.learning
@pytest.mark.parametrize("ippo", [False, True])
def test_mappo_and_ippo_raise_the_reward_quickly(ippo: bool) -> None:
    policy, algo = build(ippo=ippo, update_frequency=2, entropy_coef=0.0)
    rewards = []
    for step in range(40):
        exp, mean, _ = rollout(policy, algo, step)
        algo.update(algo.prepare(exp))
        rewards.append(mean)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.4, rewards
    assert last > 0.8 and last - first > 0.4, f"ippo={ippo}: {first:.2f} -> {last:.2f}: {rewards}"


# ---- checkpoints -----------------------------------------------------------------------------------------------------
def test_state_dict_round_trip_is_exact() -> None:
    policy, algo = build(update_frequency=3)
    for step in range(2):  # leaves an open accumulation window
        exp, _, _ = rollout(policy, algo, step)
        algo.update(algo.prepare(exp))
    state = copy.deepcopy(algo.state_dict())
    assert set(state["optimizers"]) == {"shared", "left", "right", "critic"} and algo.algorithm.pending == 2
    policy_state = copy.deepcopy(policy.state_dict())

    other_policy, other = build(update_frequency=3)
    other_policy.load_state_dict(policy_state)
    other.load_state_dict(state)
    exp, _, _ = rollout(policy, algo, 5)
    twin = copy.deepcopy(exp)
    m1 = algo.update(algo.prepare(exp))
    m2 = other.update(other.prepare(twin))
    assert m1 == m2 and m1["shared/stepped"] == 1.0
    for (name, a), b in zip(policy.state_dict().items(), other_policy.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(algo.algorithm.critic.state_dict().items(), other.algorithm.critic.state_dict().values()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(
        algo.algorithm.value_normalizer.state_dict()["moments"]["mean"],
        other.algorithm.value_normalizer.state_dict()["moments"]["mean"],
        rtol=0,
        atol=0,
    )


# ---- the shared learner loop: MAPPO gets every memory and precision switch -------------------------------------
def updated_state(train: dict, steps: int = 2) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    policy, algo = build(update_frequency=2, train=train)
    metrics = []
    for step in range(steps):
        exp, _, _ = rollout(policy, algo, step)
        metrics.append(algo.update(algo.prepare(exp)))
    return [p.detach().clone() for p in [*policy.parameters(), *algo.algorithm.critic.parameters()]], metrics


def first_step_gradients(train: dict) -> list[torch.Tensor]:
    """Every trained tensor's gradient in one update, read from AdamW's first moment (exp_avg = 0.1 * grad)."""
    policy, algo = build(train={"max_grad_norm": None, **train})
    exp, _, _ = rollout(policy, algo, 0)
    algo.update(algo.prepare(exp))
    return [
        opt.state[t]["exp_avg"] / 0.1 for name, opt in algo.optimizers.items() for t in algo.optimizer_set.stepped[name]
    ]


def test_token_budget_and_offload_give_the_plain_update() -> None:
    """Token-budget packs (rows trimmed, micro-batches shuffled) and the CPU master copies give the plain update's
    gradient: MAPPO's per-agent row weights make each micro-batch's share whatever the plan."""
    plain = first_step_gradients({"grad_accum": 1})
    assert len(plain) > 10 and any(float(g.abs().sum()) > 0 for g in plain)
    for train in ({"grad_accum": 4}, {"token_budget": 12}, {"offload_optimizer": True}):
        other = first_step_gradients(train)
        for a, b in zip(plain, other):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, t=train: f"{t}: {m}")
    _, metrics = updated_state({"token_budget": 12})
    assert metrics[-1]["memory/token_budget"] == 12.0
    assert metrics[0]["shared/stepped"] == 0.0 and metrics[-1]["shared/stepped"] == 1.0  # update_frequency 2


def test_auto_micro_batch_backs_off_on_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from palestra.scale import micro_batching

    monkeypatch.setattr(micro_batching, "free_memory_bytes", lambda device: 10**12)  # a budget of the whole batch
    policy, algo = build(train={"auto_micro_batch": True})
    exp = algo.prepare(rollout(policy, algo, 0)[0])
    calls = {"n": 0}
    loss = algo.algorithm.loss

    def failing_once(batch, scores):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CPU out of memory (simulated)")
        return loss(batch, scores)

    monkeypatch.setattr(algo.algorithm, "loss", failing_once)
    metrics = algo.update(exp)
    assert metrics["train/skipped"] == 0.0 and algo.planner.auto_budget_cap is not None
    assert metrics["memory/token_budget"] == float(algo.planner.auto_budget_cap)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_mappo(precision: str) -> None:
    after, metrics = updated_state({"precision": precision}, steps=2)
    before, _ = updated_state({"precision": precision}, steps=0)
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "nothing was trained"
    assert all(torch.isfinite(p).all() for p in after)
    assert all(m["train/skipped"] == 0.0 for m in metrics)
    if precision == "fp16":
        assert "amp/loss_scale" in metrics[-1] and metrics[-1]["amp/loss_scale"] > 0
