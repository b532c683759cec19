"""The contract test kit (``palestra.testing``): every built-in component passes it, each mistake a plugin author
would make is caught with one line naming the component, the method and the rule, the pytest plugin gives a
plugin's own tests the ``palestra_contract`` fixture, and the example plugin's tests use it.
"""

from __future__ import annotations

import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plugin_installs
import pytest
import torch

from palestra import Observation, RewardOutput, StepResult
from palestra.plugin_manager import get_registry
from palestra.plugins.optimizers.grpo import GRPO
from palestra.plugins.policies._tiny_model import TinyTransformerPolicy
from palestra.testing import (
    RULES,
    ContractError,
    check,
    check_environment,
    check_logger,
    check_optimizer,
    check_policy,
    check_reward,
)
from palestra.testing.samples import TINY_POLICY

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]

OPENENV_GAME = {
    "package": "guess_number:app",
    "app_dir": str(REPO / "examples" / "openenv_game"),
    "action_field": "guess",
    "prompt": "{history}?",
    "max_turns": 4,
}

# ---- every built-in component passes ------------------------------------------------------------------------
# What a built-in needs beyond its defaults: the dialogue rewards read customer_service's metadata, the
# combinators need their terms, the tiny policy is made small.
SETTINGS: dict[tuple[str, str], dict[str, Any]] = {
    ("reward", "fluency"): {"environment": "customer_service"},
    ("reward", "factual"): {"environment": "customer_service"},
    ("reward", "politeness"): {"environment": "customer_service"},
    ("reward", "weighted_sum"): {
        "options": {"components": [{"name": "format"}, {"name": "correctness", "weight": 2.0}]}
    },
    # unlock_at 0.1: the second layer unlocks after the first call, so the state round-trip has progress to carry
    ("reward", "layered"): {
        "options": {
            "layers": [{"name": "format", "options": {"pattern": "[0-9]"}}, {"name": "correctness", "unlock_at": 0.1}],
            "ema_decay": 0.5,
        }
    },
    ("reward", "game_outcome"): {"environment": "textarena"},  # reads the game's outcome from the episode metadata
    ("policy", "tiny"): {"options": {k: v for k, v in TINY_POLICY.items() if k != "seed"}},
    ("environment", "dataset"): {"options": {"path": str(REPO / "examples" / "data" / "sums.jsonl")}},
    ("reward", "reasoning_gym"): {"environment": "reasoning_gym", "environment_options": {"size": 50, "eval_size": 5}},
    # the example's guess-the-number OpenEnv server, started by the environment; env_reward reads its rewards
    ("environment", "openenv"): {"options": {**OPENENV_GAME}},
    ("reward", "env_reward"): {"environment": "openenv", "environment_options": {**OPENENV_GAME}},
    ("tool", "calculator"): {"examples": [{"expression": "437 * 28"}, {"expression": "(312 + 845) / 4"}]},
    ("tool", "python"): {"examples": [{"code": "print(6 * 7)"}]},
    # the example's verifiers environment package, importable from its source folder (see the test below)
    ("environment", "verifiers"): {"options": {"env_id": "vf-small-sums"}},
    ("reward", "verifiers"): {"environment": "verifiers", "environment_options": {"env_id": "vf-small-sums"}},
    ("tool", "mcp"): {
        "options": {"command": [sys.executable, str(REPO / "tests" / "fixtures" / "mcp_server.py")]},
        "examples": {"add": [{"a": 2, "b": 3}], "echo": [{"text": "hi"}]},
    },
}
# wandb starts its offline run machinery; hf builds a model folder; mcp starts a server
SLOW = {
    ("logger", "wandb"),
    ("policy", "hf"),
    ("tool", "mcp"),
    ("environment", "openenv"),  # each instance starts a server
    ("reward", "env_reward"),
}  # wandb starts its offline run machinery; hf builds a model folder


def builtins() -> list[Any]:
    registry = get_registry()
    out = []
    for kind in RULES:
        for reg in (r for r in registry if r.kind == kind and r.distribution == "palestra"):
            marks = [pytest.mark.slow] if (kind, reg.name) in SLOW else []
            if not reg.available:  # an optional package is missing: the listing says how to install it
                marks.append(pytest.mark.skip(reason=f"{kind} {reg.name!r} needs: {reg.requires.install}"))
            out.append(pytest.param(kind, reg.name, id=f"{kind}-{reg.name}", marks=marks))
    return out


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    import tiny_hf  # tests/fixtures: on sys.path by pyproject's [tool.pytest.ini_options] pythonpath

    return tiny_hf.build_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama sequence classifier (one logit) and its tokenizer, for the reward_model reward."""
    transformers = pytest.importorskip("transformers")
    import tiny_hf

    tokenizer = tiny_hf.build_tokenizer(add_bos=True, pad=True)
    model = tiny_hf._init_model(
        transformers.LlamaConfig,
        transformers.LlamaForSequenceClassification,
        0,
        vocab_size=len(tokenizer),
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tiny_hf._save(model, tokenizer, tmp_path_factory.mktemp("classifier"))


@pytest.mark.parametrize(("kind", "name"), builtins())
def test_every_builtin_component_keeps_the_contract(
    kind: str, name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = dict(SETTINGS.get((kind, name), {}))
    if name == "verifiers":  # the verifiers components play an installed verifiers environment package
        if kind == "agent":
            pytest.skip(
                "check_agent plays its own sample task; the verifiers agent plays only the verifiers "
                "environment's tasks (tests/plugins/test_verifiers_env.py runs it through the endpoint)"
            )
        monkeypatch.syspath_prepend(str(REPO / "examples" / "verifiers" / "vf-small-sums"))
    if (kind, name) == ("policy", "hf"):
        settings["options"] = {"path": str(request.getfixturevalue("hf_model_dir"))}
    if (kind, name) == ("reward", "judge"):  # the tiny Qwen2 as the judge: random answers, so mostly neutral scores
        settings["options"] = {
            "path": str(request.getfixturevalue("hf_model_dir")),
            "device": "cpu",
            "max_new_tokens": 3,
        }
    if (kind, name) == ("reward", "reward_model"):
        settings["options"] = {"path": str(request.getfixturevalue("classifier_dir")), "device": "cpu"}
    try:
        check(kind, name, settings.pop("options", None), **settings)
    except ContractError as e:
        if e.rule == "builds from its options" and _missing_package(e):
            pytest.skip(f"{kind} {name!r} needs an optional package: {e}")
        raise


def _missing_package(e: BaseException) -> bool:
    """True when building failed because an optional package is not installed (somewhere in the cause chain)."""
    while e is not None:
        if isinstance(e, ImportError):
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False


def test_the_builtins_of_every_kind_are_checked() -> None:
    checked = {(v.values[0], v.values[1]) for v in builtins()}
    registry = get_registry()
    for kind in RULES:
        assert {(r.kind, r.name) for r in registry if r.kind == kind and r.distribution == "palestra"} <= checked
    assert len(checked) >= 20


# ---- seeded mistakes: each is caught, in one line ------------------------------------------------------------
def caught(run: Callable[[], None]) -> ContractError:
    with pytest.raises(ContractError) as info:
        run()
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        f"{info.value.kind} {info.value.label!r}.{info.value.method}: rule "
    )
    return info.value


def expect(error: ContractError, kind: str, label: str, method: str, rule: str) -> None:
    assert (error.kind, error.label, error.method, error.rule) == (kind, label, method, rule), str(error)
    assert rule in RULES[kind]


# rewards ------------------------------------------------------------------------------------------------------
class ListReward:
    """Returns a plain list: the trainer converts it, the kit wants the real thing."""

    def __call__(self, prompts, completions, metadata):
        return [float(len(c) > 0) for c in completions]


class ShortReward:
    """Drops the last row."""

    def __call__(self, prompts, completions, metadata):
        return torch.ones(max(0, len(completions) - 1))


class NaNReward:
    """Divides by the completion's length: NaN on the empty completion."""

    def __call__(self, prompts, completions, metadata):
        return torch.tensor([len(c) / len(c) if c else float("nan") for c in completions])


class IntReward:
    def __call__(self, prompts, completions, metadata):
        return torch.tensor([len(c) for c in completions])  # int64


class MutatingReward:
    """Pops the answer out of the metadata it reads."""

    def __call__(self, prompts, completions, metadata):
        return torch.tensor([float(m.pop("answer", None) is not None) for m in metadata])


class TensorMetricReward:
    def __call__(self, prompts, completions, metadata):
        scores = torch.zeros(len(completions))
        return RewardOutput(scores, metrics={"mean": scores.mean()})  # a tensor, not a float (and NaN when empty)


class RandomReward:
    """Draws from the global generator: another instance scores the same rows differently."""

    def __call__(self, prompts, completions, metadata):
        return torch.tensor([random.random() for _ in completions])


class OverMaxReward:
    max_score = 1.0

    def __call__(self, prompts, completions, metadata):
        return torch.full((len(completions),), 2.0)


class ForgetfulReward:
    """A moving average whose state_dict leaves out the average: a resumed run would score differently."""

    def __init__(self) -> None:
        self.calls, self.average = 0, 0.0

    def __call__(self, prompts, completions, metadata):
        raw = torch.tensor([float(len(c)) for c in completions])
        self.calls += 1
        self.average = 0.5 * self.average + 0.5 * float(raw.mean()) if len(completions) else self.average
        return raw - self.average

    def state_dict(self):
        return {"calls": self.calls}  # "average" is missing

    def load_state_dict(self, state):
        self.calls = state["calls"]


@pytest.mark.parametrize(
    ("reward", "rule", "detail"),
    [
        (ListReward, "scores are a float tensor", "returned a list of 4; expected a float tensor of shape [4]"),
        (ShortReward, "one score per row", "scores has shape [3] for 4 rows; expected [4]"),
        (NaNReward, "scores are finite", "row 1 scored nan"),
        (IntReward, "scores are a float tensor", "returned a torch.int64 tensor of shape [4]"),
        (MutatingReward, "metadata is read-only", "the call changed its input: metadata[0]: keys differ"),
        (TensorMetricReward, "metrics are finite numbers", "metric 'mean' is a torch.float32 tensor of shape []"),
        (RandomReward, "same rows, same scores", "a second fresh instance scored differently"),
        (OverMaxReward, "scores within max_score", "scored 2.0 above max_score=1.0"),
    ],
)
def test_a_broken_reward_is_caught(reward: type, rule: str, detail: str) -> None:
    error = caught(lambda: check_reward(reward))
    expect(error, "reward", reward.__name__, "__call__", rule)
    assert detail in str(error)


def test_the_reward_message_names_the_plugin_the_method_and_the_rule() -> None:
    assert str(caught(lambda: check_reward(ListReward, name="shout"))) == (
        "reward 'shout'.__call__: rule 'scores are a float tensor': returned a list of 4; expected a float tensor of "
        "shape [4] (e.g. torch.tensor(values, dtype=torch.float32))"
    )


def test_a_state_dict_missing_a_key_is_caught() -> None:
    error = caught(lambda: check_reward(ForgetfulReward))
    expect(error, "reward", "ForgetfulReward", "load_state_dict", "state round-trip")
    assert "continues" not in str(error) and "scores differently: output.scores: tensors differ" in str(error)


# environments -----------------------------------------------------------------------------------------------------
class CopyEnv:
    """A correct single-turn environment; the broken ones below each change one thing."""

    agent_ids = ("assistant",)
    max_turns = 1

    def __init__(self) -> None:
        self.rows = 0

    def task(self, rng: random.Random) -> str:
        return str(rng.randint(0, 99))

    def reset(self, batch_size, *, seed=None, group_size=1):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        rng = random.Random(seed)
        tasks = [self.task(rng) for _ in range(batch_size)]
        obs = [Observation(prompt=f"copy {t}", metadata={"answer": t}) for t in tasks for _ in range(group_size)]
        self.rows = len(obs)
        return obs

    def step(self, actions):
        return StepResult([None] * self.rows, [True] * self.rows, [{"assistant": {}} for _ in range(self.rows)])


class IgnoresGroupSize(CopyEnv):
    def reset(self, batch_size, *, seed=None, group_size=1):
        return super().reset(batch_size, seed=seed)


class UnseededEnv(CopyEnv):
    def reset(self, batch_size, *, seed=None, group_size=1):
        return super().reset(
            batch_size, seed=None, group_size=group_size
        )  # random.Random(None): fresh tasks every time


class DrawsPerRow(CopyEnv):
    """A new task for every row, so the rows of a group do not share one."""

    def reset(self, batch_size, *, seed=None, group_size=1):
        return super().reset(batch_size * group_size, seed=seed)


class ShortStep(CopyEnv):
    def step(self, actions):
        n = self.rows - 1
        return StepResult([None] * n, [True] * n, [{} for _ in range(n)])


class UnknownAgent(CopyEnv):
    def reset(self, batch_size, *, seed=None, group_size=1):
        obs = super().reset(batch_size, seed=seed, group_size=group_size)
        for o in obs:
            o.agent_id = "user"
        return obs


class TwoTurnsStuck(CopyEnv):
    """Two turns, but the second observation still says turn 0."""

    max_turns = 2

    def reset(self, batch_size, *, seed=None, group_size=1):
        self.turn = 0
        return super().reset(batch_size, seed=seed, group_size=group_size)

    def step(self, actions):
        self.turn += 1
        if self.turn == 2:
            return super().step(actions)
        return StepResult([Observation(prompt="again") for _ in actions], [False] * len(actions), [{} for _ in actions])


class StrangerInfo(CopyEnv):
    def step(self, actions):
        return StepResult([None] * self.rows, [True] * self.rows, [{"judge": {}} for _ in range(self.rows)])


class ListAgents(CopyEnv):
    # a list where the protocol asks for a tuple: the mistake this case checks is reported
    agent_ids = ["assistant"]  # type: ignore[assignment]  # noqa: RUF012 - deliberately mutable, see above


class EmptyBatchCrash(CopyEnv):
    def reset(self, batch_size, *, seed=None, group_size=1):
        if batch_size == 0:
            raise ZeroDivisionError("division by zero")
        return super().reset(batch_size, seed=seed, group_size=group_size)


class HalfStateful(CopyEnv):
    def state_dict(self):
        return {}


@pytest.mark.parametrize(
    ("env", "method", "rule", "detail"),
    [
        (
            IgnoresGroupSize,
            "reset",
            "one observation per row",
            "reset returned 2 observations; it must return a list of batch_size*group_size = 4",
        ),
        (UnseededEnv, "reset", "same seed, same tasks", "a second reset on the same instance differs"),
        (
            DrawsPerRow,
            "reset",
            "groups share a task",
            "rows 0 and 1 are in one group (group_size=2) but their prompt differs",
        ),
        (ShortStep, "step", "one result per row", "step returned 3 rows for a batch of 4"),
        (UnknownAgent, "reset", "observations", "agent 'user', not one of agent_ids ('assistant',)"),
        (TwoTurnsStuck, "step", "turns count up", "row 0 went from turn 0 to turn 0"),
        (StrangerInfo, "step", "info by agent", "info[0] has an entry for 'judge'"),
        (ListAgents, "agent_ids", "agent ids", "agent_ids is ['assistant']; expected a non-empty tuple"),
        (EmptyBatchCrash, "reset", "empty batch", "raised ZeroDivisionError (expected [] or ValueError)"),
        (HalfStateful, "state_dict", "state round-trip", "has only one of state_dict and load_state_dict"),
    ],
)
def test_a_broken_environment_is_caught(env: type, method: str, rule: str, detail: str) -> None:
    error = caught(lambda: check_environment(env))
    expect(error, "environment", env.__name__, method, rule)
    assert detail in str(error)


def test_the_environment_message_names_the_plugin_the_method_and_the_rule() -> None:
    assert str(caught(lambda: check_environment(IgnoresGroupSize, name="keyword_env"))) == (
        "environment 'keyword_env'.reset: rule 'one observation per row': reset returned 2 observations; it must "
        "return a list of batch_size*group_size = 4 Observation (2 tasks x 2)"
    )


def test_a_correct_environment_passes_and_its_metadata_reaches_the_reward() -> None:
    check_environment(CopyEnv, reward="correctness", reward_options={"tag": None})
    error = caught(lambda: check_environment(CopyEnv, reward="factual"))  # reads customer_service's metadata
    expect(error, "environment", "CopyEnv", "step", "metadata reaches the reward")
    assert "KeyError: 'gold_value'" in str(error)


# optimizers ---------------------------------------------------------------------------------------------------
class RowAdvantagesAsColumns(GRPO):
    """Gives advantages of shape [B, 1], neither per row nor per token."""

    def advantages(self, batch):
        batch = super().advantages(batch)
        batch.advantages = batch.advantages[:, None]
        return batch


class ForgetfulBaseline(GRPO):
    """A running baseline it does not checkpoint (extra_state left out)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.baseline = 0.0

    def advantages(self, batch):
        self.baseline = 0.5 * self.baseline + 0.5 * float(batch.rewards.mean())
        batch.advantages = batch.rewards - self.baseline
        return batch


class PlainSGD:
    """A protocol-only algorithm (no palestra.Algorithm): the learner calls hooks it does not have."""

    name, needs_reference, needs_value_head, routes_agents, shared_update_window, refill_rounds = (
        "plain_sgd",
        False,
        False,
        False,
        False,
        0,
    )

    def bind(self, policy, context):
        pass

    def groups_short(self, batch):
        return 0

    def advantages(self, batch):
        batch.advantages = batch.rewards - batch.rewards.mean()
        return batch

    def loss(self, batch, scores):
        return -(scores.logprobs.sum(-1) * batch.advantages).mean(), {}

    def extra_state(self):
        return {}

    def load_extra_state(self, state):
        pass


class IgnoresAdvantages(GRPO):
    """A loss that does not use the advantages (so a NaN advantage does not make it NaN)."""

    def loss(self, batch, scores):
        return -self.aggregate(scores.logprobs, batch.completion_mask), {}


class Frozen(GRPO):
    def loss(self, batch, scores):
        return (scores.logprobs * 0.0).sum(), {}


class NoFlags(GRPO):
    routes_agents = None  # type: ignore[assignment]


class HalfRefill(GRPO):
    """Says it refills, but cannot say how many groups it lacks."""

    refill_rounds = 2  # type: ignore[assignment]
    groups_short = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("optimizer", "method", "rule", "detail"),
    [
        (RowAdvantagesAsColumns, "prepare", "prepare fills advantages", "expected floats of shape [4] or [4, "),
        (ForgetfulBaseline, "load_state_dict", "state round-trip", "continues differently: advantages: tensors differ"),
        (PlainSGD, "Algorithm", "protocol", "PlainSGD does not subclass palestra.Algorithm"),
        (IgnoresAdvantages, "update", "NaN loss skips the step", "a NaN loss returned train/skipped=0.0; expected 1.0"),
        (Frozen, "update", "parameters change", "no parameter of the policy changed"),
        (NoFlags, "routes_agents", "protocol", "routes_agents is None; expected a bool"),
        (HalfRefill, "groups_short", "protocol", "has no groups_short() method"),
    ],
)
def test_a_broken_optimizer_is_caught(optimizer: type, method: str, rule: str, detail: str) -> None:
    error = caught(lambda: check_optimizer(optimizer))
    expect(error, "optimizer", optimizer.__name__, method, rule)
    assert detail in str(error)


def test_the_optimizer_check_runs_a_real_update_on_the_policy_given() -> None:
    check_optimizer(
        "grpo",
        {"beta": 0.05},
        policy=TinyTransformerPolicy,
        policy_options={**TINY_POLICY, "seed": 3},
        train={"updates_per_batch": 2, "grad_accum": 2},
    )


# policies ---------------------------------------------------------------------------------------------------
def small_tiny(cls: type) -> Callable[[], Any]:
    return lambda: cls(**{**TINY_POLICY, "seed": None})


class UnmaskedScores(TinyTransformerPolicy):
    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs):
        out = super().score(prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs)
        out.logprobs = out.logprobs - (~completion_mask).float()  # -1 on padding instead of 0
        return out


class RightPadded(TinyTransformerPolicy):
    def encode_observations(self, observations):
        ids, mask = super().encode_observations(observations)
        order = torch.argsort(~mask, dim=-1, stable=True)  # real tokens first, padding after
        return ids.gather(-1, order), mask.gather(-1, order)


class ForgetsWeights(TinyTransformerPolicy):
    def load_state_dict(self, state, strict=True, assign=False):
        return None  # loads nothing


class NoAgentIds(TinyTransformerPolicy):  # the pre-2.0 signature: the learner's agent_ids would be a TypeError
    def score(
        self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature=1.0, entropy=True, values=False
    ):
        return super().score(
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature=temperature,
            entropy=entropy,
            values=values,
        )


class NoAgentIdsInDecode(TinyTransformerPolicy):  # the kv_cache generator hands every decode step the rows' agent ids
    def decode_step(self, input_ids, attention_mask, position_ids, cache):
        return super().decode_step(input_ids, attention_mask, position_ids, cache)


@pytest.mark.parametrize(
    ("policy", "method", "rule"),
    [
        (UnmaskedScores, "score", "masked tokens score 0"),
        (RightPadded, "encode_observations", "left padding"),
        (ForgetsWeights, "load_state_dict", "state round-trip"),
        (NoAgentIds, "score", "score takes agent_ids"),
        (NoAgentIdsInDecode, "generate", "generates"),
    ],
)
def test_a_broken_policy_is_caught(policy: type, method: str, rule: str) -> None:
    expect(
        caught(lambda: check_policy(small_tiny(policy), name=policy.__name__)), "policy", policy.__name__, method, rule
    )


# loggers ----------------------------------------------------------------------------------------------------
class ListLogger:
    def __init__(self) -> None:
        self.lines: list[str] | None = None

    def open(self, run_dir, config):
        self.lines = []

    def log(self, metrics, step):
        assert self.lines is not None
        self.lines.append(f"{step} {metrics}")

    def close(self):
        self.lines = None


class StrictJsonLogger(ListLogger):
    def log(self, metrics, step):
        import json

        json.dumps(dict(metrics), allow_nan=False)  # ValueError on NaN


class ClosesOnce(ListLogger):
    def close(self):
        if self.lines is None:
            raise RuntimeError("already closed")
        self.lines = None


class WritesHere(ListLogger):
    def open(self, run_dir, config):
        super().open(run_dir, config)
        Path("metrics.txt").write_text("")  # the working directory, not the run directory


@pytest.mark.parametrize(
    ("logger", "method", "rule"),
    [
        (StrictJsonLogger, "log", "non-finite values"),
        (ClosesOnce, "close", "close is idempotent"),
        (WritesHere, "log", "writes under the run directory"),
    ],
)
def test_a_broken_logger_is_caught(logger: type, method: str, rule: str, tmp_path: Path) -> None:
    check_logger(ListLogger, run_dir=tmp_path / "good")
    expect(caught(lambda: check_logger(logger, run_dir=tmp_path / "bad")), "logger", logger.__name__, method, rule)


# ---- the kit itself ---------------------------------------------------------------------------------------
def test_a_registered_name_is_built_with_validated_options_and_a_bad_option_is_one_line() -> None:
    error = caught(lambda: check_reward("format", {"tagg": "answer"}))
    expect(error, "reward", "format", "build", "builds from its options")
    assert "reward.options.tagg" in str(error)
    with pytest.raises(ValueError, match=r"^palestra.testing.check: no check for kind 'generator'"):
        check("generator", "kv_cache")


def test_every_rule_is_in_the_docs_table() -> None:
    text = (REPO / "docs" / "testing-plugins.md").read_text()
    for kind, rules in RULES.items():
        for rule in rules:
            assert f"| `{rule}` |" in text, f"docs/testing-plugins.md: the {kind} rule {rule!r} is not in its table"


def test_the_pytest_plugin_is_loaded_through_its_entry_point(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("palestra")
    assert plugin is not None, "the pytest11 entry point is not installed: reinstall palestra (pip install -e .)"
    assert plugin.__name__ == "palestra.testing.pytest_plugin"


@pytest.mark.slow
def test_the_fixture_fails_a_test_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text(
        "import torch\n\n"
        "class Shout:\n"
        "    def __call__(self, prompts, completions, metadata):\n"
        "        return [1.0 for _ in completions]\n\n"
        "def test_shout(palestra_contract):\n"
        "    palestra_contract('reward', Shout)\n\n"
        "def test_format(palestra_contract):\n"
        "    palestra_contract('reward', 'format')\n"
    )
    result = plugin_installs.run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"], [], tmp_path, OMP_NUM_THREADS="1"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 passed" in result.stdout
    line = (
        "reward 'Shout'.__call__: rule 'scores are a float tensor': returned a list of 4; expected a float "
        "tensor of shape [4] (e.g. torch.tensor(values, dtype=torch.float32))"
    )
    failure = result.stdout.split(" test_shout _")[1].split("\n=")[0]  # the FAILURES section of test_shout
    assert [text for text in failure.splitlines()[1:] if text.strip()] == [line], result.stdout  # the line alone


@pytest.mark.slow
@pytest.mark.pip_install
def test_the_example_plugins_own_tests_use_the_kit_and_pass(sites: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(REPO / "examples" / "palestra-example-plugin" / "tests", tmp_path / "tests")
    result = plugin_installs.run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], [sites["example"]], tmp_path, OMP_NUM_THREADS="1"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout and "palestra_contract" in (tmp_path / "tests" / "test_contract.py").read_text()
