"""Multi-agent policies (palestra.multiagent.sharing): parameter sharing by layer group, routing, update_frequency.

Everything runs on the real tiny policy and the real customer_service environment (no stand-ins).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from palestra.config import AgentsConfig, ConfigError, load_config
from palestra.context import TrainContext
from palestra.engine.learner import Learner
from palestra.engine.rollout import collect, generate_by_agent
from palestra.engine.trainer import Trainer
from palestra.multiagent.credit import credit_plan, reward_rows
from palestra.multiagent.sharing import MultiAgentPolicy, wrap_policy
from palestra.plugin_manager import get_registry
from palestra.plugins.envs.customer_service import (
    CustomerServiceEnv,
    tiny_policy_options,
)
from palestra.plugins.policies.tiny import TinyTransformerPolicy
from palestra.types import Observation, RewardOutput, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "customer_service_mappo.yaml")
AGENTS = ("intent", "retrieval", "response")
SMALL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_len": 128}


def tiny(seed: int = 0, **extra) -> TinyTransformerPolicy:
    return TinyTransformerPolicy(**{**tiny_policy_options(), **SMALL, "seed": seed, **extra})


def sharing(shared: list[str], independent: list[str], **kw) -> AgentsConfig:
    return AgentsConfig(shared_layers=shared, independent_layers=independent, **kw)


def params_of(view: torch.nn.Module, prefix: str) -> list[torch.nn.Parameter]:
    return [p for n, p in view.named_parameters(remove_duplicate=False) if n == prefix or n.startswith(prefix + ".")]


GROUP_PREFIXES = {"embedding": ["embed"], "encoder": ["blocks"], "decoder": ["norm", "lm_head"]}
LAYOUTS = [
    (["embedding", "encoder"], ["decoder"]),  # the example
    (["embedding", "encoder", "decoder"], []),  # all shared
    ([], ["embedding", "encoder", "decoder"]),  # all separate
    (["decoder"], ["embedding", "encoder"]),
]


# ---- layouts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shared", "independent"), LAYOUTS)
def test_shared_groups_are_one_tensor_and_independent_groups_are_per_agent_copies(shared, independent) -> None:
    policy = MultiAgentPolicy(tiny(), sharing(shared, independent), AGENTS)
    views = [policy.for_agent(a) for a in AGENTS]
    assert views[0] is not views[1] and views[1] is not views[2]
    for group, prefixes in GROUP_PREFIXES.items():
        for prefix in prefixes:
            tensors = [params_of(v, prefix) for v in views]
            for a, b in zip(tensors[0], tensors[1]):
                if group in shared:
                    assert a is b, f"{prefix} should be one tensor for every agent"
                else:
                    assert a is not b and torch.equal(a, b), f"{prefix}: per-agent copies, initialised identical"
    groups = policy.parameter_groups()
    assert set(groups) == ({"shared"} if shared else set()) | (set(AGENTS) if independent else set())
    flat = [id(p) for ps in groups.values() for p in ps]
    assert len(flat) == len(set(flat)) == len(list(policy.parameters())), "every parameter in exactly one group"
    n_shared = sum(p.numel() for p in groups.get("shared", []))
    n_own = sum(p.numel() for p in groups.get("intent", []))
    assert sum(p.numel() for p in policy.parameters()) == n_shared + len(AGENTS) * n_own


def test_tied_embedding_is_untied_only_when_embedding_and_decoder_differ_in_sharing() -> None:
    split = MultiAgentPolicy(tiny(), sharing(["embedding", "encoder"], ["decoder"]), AGENTS)
    assert split.untied == ["lm_head.weight"]
    for a in AGENTS:
        v = split.for_agent(a)
        assert v.lm_head.weight is not v.embed.weight and torch.equal(v.lm_head.weight, v.embed.weight)
    assert split.for_agent("intent").embed.weight is split.for_agent("response").embed.weight
    assert split.for_agent("intent").lm_head.weight is not split.for_agent("response").lm_head.weight
    same = MultiAgentPolicy(tiny(), sharing(["embedding", "encoder", "decoder"], []), AGENTS)
    assert same.untied == [] and same.for_agent("response").lm_head.weight is same.for_agent("intent").embed.weight
    separate = MultiAgentPolicy(tiny(), sharing([], ["embedding", "encoder", "decoder"]), AGENTS)
    assert separate.untied == []
    for a in AGENTS:  # still tied within each agent's own copy
        assert separate.for_agent(a).lm_head.weight is separate.for_agent(a).embed.weight


# ---- bad configs ----------------------------------------------------------------------------------------------
def test_unknown_layer_name_is_an_error_naming_it_with_its_key_path_and_the_valid_names() -> None:
    with pytest.raises(ConfigError) as e:
        MultiAgentPolicy(tiny(), sharing(["embedding", "encodr"], ["decoder"]), AGENTS)
    assert str(e.value) == (
        "agents.shared_layers[1]: unknown layer group 'encodr'; "
        "the policy's layer groups are embedding, encoder, decoder"
    )
    with pytest.raises(ConfigError, match=r"^agents\.independent_layers\[0\]: unknown layer group 'head'"):
        MultiAgentPolicy(tiny(), sharing(["embedding", "encoder"], ["head"]), AGENTS)


def test_a_group_in_both_lists_or_in_neither_is_a_one_line_error() -> None:
    with pytest.raises(
        ConfigError, match=r"^agents: layer group\(s\) decoder are in both shared_layers and independent_layers$"
    ):
        MultiAgentPolicy(tiny(), sharing(["embedding", "encoder", "decoder"], ["decoder"]), AGENTS)
    with pytest.raises(ConfigError, match=r"^agents: layer group\(s\) encoder are in neither") as e:
        MultiAgentPolicy(tiny(), sharing(["embedding"], ["decoder"]), AGENTS)
    assert "\n" not in str(e.value)


def test_the_trainer_reports_a_bad_layer_name_from_the_config_before_training(tmp_path) -> None:
    config = load_config(EXAMPLE, ["agents.shared_layers=[embedding, encoderr]", "loggers=[]"])
    with pytest.raises(ConfigError, match=r"^agents\.shared_layers\[1\]: unknown layer group 'encoderr'"):
        Trainer(config, run_dir=tmp_path)


def test_an_optimizer_that_cannot_route_rows_is_refused_for_independent_layers() -> None:
    class Plain:  # a third-party optimiser (the PolicyOptimizer protocol) that calls policy.score without agent ids
        name = "plain"
        routes_agents = False
        shared_update_window = False

    with pytest.raises(
        ConfigError, match=r"^agents\.independent_layers: optimizer 'plain' scores rows without agent ids"
    ):
        wrap_policy(tiny(), sharing(["embedding", "encoder"], ["decoder"]), CustomerServiceEnv(), Plain())
    every = wrap_policy(tiny(), sharing(["embedding", "encoder", "decoder"], []), CustomerServiceEnv(), Plain())
    assert isinstance(every, MultiAgentPolicy)  # all shared: any view scores every row alike


def test_update_frequency_needs_an_optimiser_that_honours_it() -> None:
    grpo = get_registry().get("optimizer", "grpo").factory()
    windowed = AgentsConfig(shared_layers=["embedding", "encoder"], independent_layers=["decoder"], update_frequency=10)
    with pytest.raises(
        ConfigError, match=r"^agents\.update_frequency: optimizer 'grpo' steps every parameter every update"
    ):
        wrap_policy(tiny(), windowed, CustomerServiceEnv(), grpo)
    mappo = get_registry().get("optimizer", "mappo").factory()
    assert isinstance(wrap_policy(tiny(), windowed, CustomerServiceEnv(), mappo), MultiAgentPolicy)


def test_the_built_in_optimisers_train_each_agents_own_layers(tmp_path) -> None:
    # GRPO (the Algorithm base) routes every row to its agent's parameters: each agent's own decoder moves.
    config = load_config(
        EXAMPLE,
        [
            "optimizer.name=grpo",
            "optimizer.options={}",
            "loggers=[]",
            "train.steps=1",
            "train.batch_size=2",
            "train.group_size=2",
            "train.max_new_tokens=4",
            "agents.update_frequency=1",
        ],
    )  # grpo steps every parameter every update
    trainer = Trainer(config, run_dir=tmp_path)
    heads = {a: [p.detach().clone() for p in trainer.policy.for_agent(a).output_head().parameters()] for a in AGENTS}
    trainer.step()
    for a in AGENTS:
        after = list(trainer.policy.for_agent(a).output_head().parameters())
        assert any(not torch.equal(x, y) for x, y in zip(heads[a], after)), a


# ---- routing ----------------------------------------------------------------------------------------------------
def diverged(seed: int = 0) -> MultiAgentPolicy:
    """Independent decoders made different, so that routing to the wrong agent would show."""
    policy = MultiAgentPolicy(tiny(seed), sharing(["embedding", "encoder"], ["decoder"]), AGENTS)
    with torch.no_grad():
        for i, a in enumerate(AGENTS):
            policy.for_agent(a).lm_head.weight.add_(torch.randn_like(policy.for_agent(a).lm_head.weight) * (i + 1))
    return policy


def test_score_routes_each_row_to_its_agents_parameters() -> None:
    policy = diverged()
    env = CustomerServiceEnv()
    obs = env.reset(3, seed=1)
    ids, mask = policy.encode_observations(obs)
    completion = torch.randint(3, 40, (3, 4))
    cmask = torch.ones(3, 4, dtype=torch.bool)
    agents = ["response", "intent", "response"]
    got = policy.score(ids, mask, completion, cmask, agent_ids=agents)
    for row, a in enumerate(agents):
        want = policy.for_agent(a).score(
            ids[row : row + 1], mask[row : row + 1], completion[row : row + 1], cmask[row : row + 1]
        )
        torch.testing.assert_close(got.logprobs[row], want.logprobs[0])
        torch.testing.assert_close(got.entropy[row], want.entropy[0])
    with pytest.raises(ValueError, match="pass agent_ids"):
        policy.score(ids, mask, completion, cmask)


def test_generation_of_mixed_agent_rows_matches_each_agents_own_generation() -> None:
    policy = diverged()
    backend = get_registry().get("generator", "kv_cache").factory()
    base = CustomerServiceEnv().reset(4, seed=3)
    obs = [
        Observation(prompt=o.prompt, agent_id=a, stop=o.stop)
        for o, a in zip(base, ["response", "intent", "response", "retrieval"])
    ]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    mixed = generate_by_agent(backend, policy, obs, greedy)
    for i, o in enumerate(obs):
        alone = backend.generate(policy.for_agent(o.agent_id), [o], greedy)
        assert mixed.texts[i] == alone.texts[0]
        n = int(alone.completion_mask.sum())
        assert torch.equal(mixed.completion_ids[i, :n], alone.completion_ids[0, :n])
        torch.testing.assert_close(mixed.logprobs[i, :n], alone.logprobs[0, :n])
    assert (
        len({mixed.texts[0], mixed.texts[1], mixed.texts[3]}) > 1
    )  # the decoders differ, so the agents answer differently


def test_decode_step_runs_the_view_of_the_agent_the_rows_name_and_refuses_a_mix() -> None:
    policy = diverged()
    ids, mask = policy.encode_observations(CustomerServiceEnv().reset(2, seed=5))
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    for a in AGENTS:
        got, _ = policy.decode_step(ids, mask, positions, None, agent_ids=[a, a])
        want, _ = policy.for_agent(a).decode_step(ids, mask, positions, None)
        assert torch.equal(got, want)
    with pytest.raises(
        ValueError, match=r"the rows name agents 'intent', 'response'; one call decodes one agent's rows"
    ):
        policy.decode_step(ids, mask, positions, None, agent_ids=["intent", "response"])


def test_a_single_agent_policy_samples_every_agents_rows_in_one_batch() -> None:
    policy = tiny(1)
    backend = get_registry().get("generator", "kv_cache").factory()
    base = CustomerServiceEnv().reset(4, seed=3)
    obs = [
        Observation(prompt=o.prompt, agent_id=a, stop=o.stop)
        for o, a in zip(base, ["response", "intent", "response", "retrieval"])
    ]
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    mixed = generate_by_agent(backend, policy, obs, params, rng=torch.Generator().manual_seed(4))
    whole = backend.generate(policy, obs, params, generator=torch.Generator().manual_seed(4))
    assert mixed.texts == whole.texts and torch.equal(mixed.completion_ids, whole.completion_ids)
    assert torch.equal(mixed.logprobs, whole.logprobs)


# ---- update_frequency -----------------------------------------------------------------------------------------------
def mappo_setup(update_frequency: int, per_agent_optimizer: bool = True, *overrides: str):
    torch.manual_seed(0)
    policy = MultiAgentPolicy(
        tiny(), sharing(["embedding", "encoder"], ["decoder"], update_frequency=update_frequency), AGENTS
    )
    algo = get_registry().get("optimizer", "mappo").factory(per_agent_optimizer=per_agent_optimizer)
    config = load_config(
        EXAMPLE,
        [
            "train.lr=0.01",
            "train.max_new_tokens=4",
            "train.track_update_ratio=false",
            "train.updates_per_batch=1",
            *overrides,
        ],
    )  # one update() call = one window slot
    learner = Learner(algo, policy, TrainContext.local(config.train))
    env = CustomerServiceEnv()
    reward = get_registry().get("reward", "fluency").factory()
    return policy, learner, env, reward


def one_update(policy, learner, env, reward, step: int) -> dict[str, float]:
    ro = collect(
        env,
        policy,
        get_registry().get("generator", "kv_cache").factory(),
        SamplingParams(max_new_tokens=4),
        4,
        seed=step,
        rng=torch.Generator().manual_seed(step),
    )
    scores = reward(*ro.reward_rows())
    batch = learner.prepare(ro.experience(scores, pad_token_id=policy.tokenizer.pad_token_id))
    return learner.update(batch)


@pytest.mark.parametrize("per_agent_optimizer", [True, False])
def test_shared_layers_step_every_update_frequency_updates_and_independent_ones_every_update(
    per_agent_optimizer,
) -> None:
    policy, algo, env, reward = mappo_setup(3, per_agent_optimizer)
    shared = policy.shared_parameters()
    own = policy.agent_parameters("response")
    stepped = []
    for step in range(6):
        before_shared = [p.detach().clone() for p in shared]
        before_own = [p.detach().clone() for p in own]
        metrics = one_update(policy, algo, env, reward, step)
        moved = any(not torch.equal(a, p) for a, p in zip(before_shared, shared))
        stepped.append(moved)
        assert metrics["shared/stepped"] == float(moved)
        assert any(not torch.equal(a, p) for a, p in zip(before_own, own)), (
            f"update {step}: the response decoder must step"
        )
    assert stepped == [False, False, True, False, False, True]


def test_update_frequency_steps_with_the_mean_of_the_windows_gradients() -> None:
    """With plain SGD semantics checked through AdamW's first step: the accumulated buffer holds the sum, the step
    uses sum / N, so the shared layers' first step equals one taken on the averaged gradient."""
    policy, learner, env, reward = mappo_setup(2, True, "train.max_grad_norm=null")
    algo = learner.algorithm
    shared = policy.shared_parameters()
    one_update(policy, learner, env, reward, 0)
    assert algo.pending == 1 and any(float(a.abs().sum()) > 0 for a in algo.shared_accum)
    window = [a.clone() for a in algo.shared_accum]
    twin = copy.deepcopy((policy, learner))
    one_update(policy, learner, env, reward, 1)
    assert algo.pending == 0 and all(float(a.abs().sum()) == 0 for a in algo.shared_accum)
    # The twin recomputes update 1's gradient: the mean of the window is what the shared step saw.
    t_policy, t_learner = twin
    t_learner.algorithm.update_frequency = 10**9  # accumulate only
    one_update(t_policy, t_learner, env, reward, 1)
    mean = [a / 2 for a in t_learner.algorithm.shared_accum]  # (update 0's gradient + update 1's) / 2
    assert not torch.equal(mean[0], window[0] / 2), "two different gradients in the window"
    state = learner.optimizers["shared"].state[shared[0]]
    torch.testing.assert_close(state["exp_avg"], (1 - 0.9) * mean[0])  # AdamW's first moment after one step


# ---- credit assignment: one reward call per step ---------------------------------------------------------------------
class CountingReward:
    """A stateful reward as a curriculum is one: every call is a step of its state (here, a count of calls and rows)."""

    def __init__(self) -> None:
        self.inner = get_registry().get("reward", "fluency").factory()
        self.calls = 0
        self.rows = 0

    def __call__(self, prompts, completions, metadata):
        self.calls += 1
        self.rows += len(completions)
        return RewardOutput(torch.as_tensor(self.inner(prompts, completions, metadata), dtype=torch.float32))


def three_agent_rollout(step: int = 0):
    policy = diverged()
    return collect(
        CustomerServiceEnv(),
        policy,
        get_registry().get("generator", "kv_cache").factory(),
        SamplingParams(max_new_tokens=4),
        4,
        seed=step,
        rng=torch.Generator().manual_seed(step),
    )


@pytest.mark.parametrize("credit", ["team", "role"])
def test_a_credit_plan_is_scored_by_one_reward_call_over_each_needed_row_once(credit: str) -> None:
    ro = three_agent_rollout()
    plan = credit_plan(ro.episodes, AGENTS, credit)
    reward = CountingReward()
    team, agent_scores, metrics = plan.assign(reward(*plan.rows))
    assert reward.calls == 1
    # each episode's last turn (the response) is the team row and the response agent's row: scored once
    turns = {(m["turn"], m["agent_id"], p, c) for p, c, m in zip(*plan.rows)}
    assert len(turns) == len(plan.rows[0]) == len(AGENTS) * len(ro.episodes)
    plain = CountingReward()  # the definitions, each scored on its own
    assert torch.equal(team.scores, plain(*reward_rows(ro.episodes)).scores)
    own = {a: plain(*reward_rows(ro.episodes, a)).scores for a in AGENTS}
    assert metrics == {f"reward/agent/{a}": float(own[a].mean()) for a in AGENTS}
    if credit == "team":
        assert agent_scores is None
    else:
        assert {a: s.tolist() for a, s in agent_scores.items()} == {a: s.tolist() for a, s in own.items()}


def test_a_credit_plan_refuses_an_output_of_the_wrong_length_and_an_unknown_mode() -> None:
    ro = three_agent_rollout()
    plan = credit_plan(ro.episodes, AGENTS, "role")
    with pytest.raises(ValueError, match=r"scored 4 rows; the plan has 12"):
        plan.assign(RewardOutput(torch.zeros(4)))
    with pytest.raises(ValueError, match=r"^agents\.credit: expected one of team, role, got 'agent'"):
        credit_plan(ro.episodes, AGENTS, "agent")


def test_an_agent_that_acts_in_some_episodes_gets_zero_elsewhere_and_its_mean_over_its_own() -> None:
    ro = three_agent_rollout()
    ro.episodes[1].turns = ro.episodes[1].turns[:1]  # episode 1 ended after the intent turn
    plan = credit_plan(ro.episodes, AGENTS, "role")
    scores = torch.arange(len(plan.rows[0]), dtype=torch.float32) + 1
    team, per_agent, metrics = plan.assign(RewardOutput(scores))
    assert team.scores.tolist() == [1.0, 2.0, 3.0, 4.0]  # the team rows come first, in episode order
    assert per_agent["intent"][1] == 2.0  # episode 1's last turn is intent's: the same row, scored once
    assert per_agent["response"][1] == 0.0 and metrics["reward/agent/response"] == float(
        per_agent["response"][[0, 2, 3]].mean()
    )


@pytest.mark.parametrize(("credit", "calls"), [("team", 2), ("role", 2)])
def test_a_stateful_reward_is_called_once_per_step_whatever_the_credit(tmp_path, credit: str, calls: int) -> None:
    # Bug 3: role credit called the reward again for each agent, so a layered curriculum advanced 6 times in 2 steps
    # (under torchrun the extra calls saw only the rank's own rows, and the ranks' curricula diverged).
    layers = "{layers: [{name: fluency}, {name: factual, unlock_at: 0.5}]}"
    config = load_config(
        EXAMPLE,
        [
            "reward.name=layered",
            f"reward.options={layers}",
            f"agents.credit={credit}",
            "loggers=[]",
            "train.batch_size=2",
            "train.group_size=2",
            "train.max_new_tokens=4",
        ],
    )
    trainer = Trainer(config, run_dir=tmp_path)
    for _ in range(2):
        trainer.step()
    assert trainer.reward.reward.calls == calls
