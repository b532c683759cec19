"""The ``reasoning_gym`` environment and reward (plugins/envs/reasoning_gym.py), and optional packages in the
registry (``palestra.registry.Requires``): listed as unavailable with the install command when missing.

The tests that generate tasks need the optional ``reasoning_gym`` package and are skipped without it; the
missing-package tests hide it from a subprocess with a meta-path finder, so they run either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from palestra import cli
from palestra.cli.plugins import describe, format_table
from palestra.config import ConfigError, build_component, load_config
from palestra.plugin_manager import PluginInfo
from palestra.registry import MissingDependency, Registration, Registry, RegistryError, Requires
from palestra.testing import check_environment, check_reward

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
INSTALL = 'pip install "palestra[reasoning-gym]"'

try:
    import reasoning_gym  # noqa: F401

    HAVE_RG = True
except ImportError:
    HAVE_RG = False
needs_rg = pytest.mark.skipif(not HAVE_RG, reason=f"needs the reasoning_gym package: {INSTALL}")

# Runs palestra's CLI with reasoning_gym hidden: importing it, or finding it with importlib.util.find_spec, fails.
HIDDEN = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "reasoning_gym" or name.startswith("reasoning_gym."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
"""


def hidden(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDDEN + code], capture_output=True, text=True, cwd=REPO, timeout=120)


# Each palestra command in one interpreter (one start-up, not five): {command: [exit code, stdout, stderr]}.
COMMANDS = """
import contextlib, io, json
from palestra.cli import main
from palestra.plugin_manager import reset
out = {}
for argv in ARGS:
    reset()
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out[" ".join(argv)] = [code, stdout.getvalue(), stderr.getvalue()]
from palestra.plugins.envs.reasoning_gym import ReasoningGymEnv
try:
    ReasoningGymEnv()
except ImportError as e:
    out["direct"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def cli_hidden(*commands: list[str]) -> dict[str, Any]:
    result = hidden(f"ARGS = {list(commands)!r}\n" + COMMANDS)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def env(**options: Any) -> Any:
    return build_component("environment", {"name": "reasoning_gym", "options": options}, path="environment")


def reward(**options: Any) -> Any:
    return build_component("reward", {"name": "reasoning_gym", "options": options}, path="reward")


def answered(observations: list[Any], wrong: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """The right answer for each row in the answer tag, except rows in ``wrong`` (the right answer plus one, or 'x')."""
    out = []
    for i, o in enumerate(observations):
        answer = o.metadata["answer"]
        if i in wrong:
            answer = str(int(answer) + 1) if answer.lstrip("-").isdigit() else "x"
        out.append(f"<answer>{answer}</answer>")
    return out


# ---- the package missing ------------------------------------------------------------------------------------
def test_importing_the_plugin_does_not_import_reasoning_gym() -> None:
    code = (
        "import sys, palestra.plugins.envs.reasoning_gym as m; from palestra.plugin_manager import get_registry; "
        "get_registry(); print('reasoning_gym' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_without_the_package_it_is_listed_unavailable_and_asking_for_it_is_one_line() -> None:
    runs = cli_hidden(["plugins", "--all"], ["plugins", "--all", "--json"],
                      ["config", "show", "environment.name=reasoning_gym"],
                      ["config", "show", "reward.name=reasoning_gym"])  # fmt: skip
    code, table, err = runs["plugins --all"]
    assert code == 0, err
    line = next(li for li in table.splitlines() if li.startswith("reasoning_gym (built-in)"))
    assert line.endswith(f"environments: reasoning_gym (unavailable: {INSTALL})")
    assert f"rewards: reasoning_gym (unavailable: {INSTALL})" in table
    rows = json.loads(runs["plugins --all --json"][1])
    row = next(r for r in rows if r["name"] == "reasoning_gym")
    assert row["environments"] == ["reasoning_gym"] and row["error"] is None
    assert row["unavailable"] == [
        {"kind": "environment", "name": "reasoning_gym", "requires": "reasoning_gym", "install": INSTALL},
        {"kind": "reward", "name": "reasoning_gym", "requires": "reasoning_gym", "install": INSTALL},
    ]
    assert all(r["unavailable"] == [] for r in rows if r["name"] != "reasoning_gym")
    for key in ("environment", "reward"):
        code, out, err = runs[f"config show {key}.name=reasoning_gym"]
        assert code == 2 and out == ""
        assert err.strip() == (
            f"palestra config: error: {key}.name: {key} 'reasoning_gym' needs the Python package 'reasoning_gym', "
            f"which is not installed; install it with: {INSTALL}"
        )
    kind, message = runs["direct"]
    assert kind == "MissingDependency"
    assert message == (
        "the reasoning_gym environment needs the Python package "
        f"'reasoning_gym', which is not installed; install it with: {INSTALL}"
    )


def test_a_registration_can_require_a_package() -> None:
    def factory(**options: Any) -> str:
        return "built"

    registry = Registry()
    missing = Requires(factory, module="palestra_no_such_package", install="pip install no-such")
    present = Requires(factory, module="json", install="pip install json")
    registry.add(Registration("environment", "gone", missing, None, "needs a package", "extra", "extra-dist"))
    registry.add(Registration("environment", "here", present, None, "has its package", "extra", "extra-dist"))
    with pytest.raises(RegistryError) as info:
        registry.get("environment", "gone")
    assert str(info.value) == (
        "environment 'gone' needs the Python package 'palestra_no_such_package', which is not installed; "
        "install it with: pip install no-such"
    )
    assert registry.get("environment", "here").factory() == "built" and registry.get("environment", "here").available
    assert ("environment", "gone") in registry and registry.names("environment") == ["gone", "here"]
    with pytest.raises(MissingDependency, match=r"^test_a_registration_can_require_a_package.<locals>.factory needs "):
        missing()
    info_ = PluginInfo(
        name="extra",
        module="extra",
        distribution="extra-dist",
        version="1.0",
        builtin=False,
        hooks=("register_environments",),
    )
    row = describe(info_, registry)
    assert row["environments"] == ["gone", "here"]
    assert row["unavailable"] == [
        {
            "kind": "environment",
            "name": "gone",
            "requires": "palestra_no_such_package",
            "install": "pip install no-such",
        }
    ]
    assert "environments: gone (unavailable: pip install no-such), here" in format_table([row])


# ---- the environment and the reward ------------------------------------------------------------------------
@needs_rg
def test_basic_arithmetic_scored_by_its_own_scorer() -> None:
    e = env(
        task="basic_arithmetic",
        size=100,
        eval_size=10,
        task_options={"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]}},
    )
    obs = e.reset(4, seed=1, group_size=2)
    assert obs[0].prompt.endswith("\n\nPut only the final answer in <answer></answer>.") and obs[0].stop == [
        "</answer>"
    ]
    assert obs[0].prompt.startswith(obs[0].metadata["question"])
    assert all(
        o.metadata["task"] == "basic_arithmetic" and o.metadata["entry"]["answer"] == o.metadata["answer"] for o in obs
    )
    assert all(o.metadata["entry"]["metadata"]["num_terms"] == 2 for o in obs)  # task_options reached the data set
    r = reward()
    out = r([o.prompt for o in obs], answered(obs, wrong={1, 4}), [o.metadata for o in obs])
    assert out.scores.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert out.metrics == {"score/basic_arithmetic": 0.75, "scorer_errors": 0.0}
    assert r(["p"], ["no tag at all"], [obs[0].metadata]).scores.tolist() == [0.0]
    # the correctness reward reads the same metadata
    correctness = build_component("reward", {"name": "correctness"}, path="reward")
    assert (
        correctness([o.prompt for o in obs], answered(obs, wrong={1, 4}), [o.metadata for o in obs]).scores.tolist()
        == out.scores.tolist()
    )
    step = e.step(["x"] * 8)
    assert step.done == [True] * 8 and step.info[0] == {"assistant": {"expected": obs[0].metadata["answer"]}}


@needs_rg
def test_a_weighted_mix() -> None:
    e = env(
        tasks={"chain_sum": 1.0, "leg_counting": 3.0},
        task_options={"chain_sum": {"max_terms": 2}},
        size=200,
        eval_size=20,
    )
    obs = e.reset(40, seed=0)
    by_task = [o.metadata["task"] for o in obs]
    assert set(by_task) == {"chain_sum", "leg_counting"} and by_task.count("leg_counting") > by_task.count("chain_sum")
    out = reward()([o.prompt for o in obs], answered(obs, wrong={0}), [o.metadata for o in obs])
    assert out.scores.tolist() == [0.0] + [1.0] * 39
    assert set(out.metrics) == {"score/chain_sum", "score/leg_counting", "scorer_errors"}
    assert next(o.metadata["task_options"] for o in obs if o.metadata["task"] == "chain_sum") == {"max_terms": 2}


@needs_rg
def test_held_out_entries_come_from_their_own_seed_and_seeds_repeat() -> None:
    e = env(task="basic_arithmetic", size=300, eval_size=30)
    train = {o.metadata["question"] for o in e.reset(300, seed=0)}
    held = {o.metadata["question"] for o in e.held_out().reset(30, seed=0)}
    assert len(train) > 250 and len(held) == 30 and not train & held
    assert {
        o.metadata["question"]
        for o in env(task="basic_arithmetic", size=300, eval_size=30, split="eval").reset(30, seed=3)
    } == held
    again = env(task="basic_arithmetic", size=300, eval_size=30)
    assert [o.prompt for o in e.reset(5, seed=7)] == [o.prompt for o in again.reset(5, seed=7)]
    assert [o.prompt for o in e.reset(5, seed=7)] != [o.prompt for o in e.reset(5, seed=8)]


@needs_rg
def test_the_environment_and_reward_keep_the_contract() -> None:
    check_environment("reasoning_gym", {"size": 50, "eval_size": 5}, reward="reasoning_gym")
    check_reward("reasoning_gym", environment="reasoning_gym", environment_options={"size": 50, "eval_size": 5})


@needs_rg
def test_bad_options_are_one_line_each() -> None:
    def error(*overrides: str, build: bool = False) -> str:
        """The one-line error loading the config with ``overrides`` (and building its environment, if ``build``)."""

        def load() -> None:
            cfg = load_config(None, ["environment.name=reasoning_gym", *overrides])
            if build:
                build_component("environment", cfg.environment, path="environment")

        with pytest.raises(ConfigError) as info:
            load()
        return str(info.value)

    assert error("environment.options.task=basic_arithmetc", build=True).startswith(
        "environment.options.task: unknown reasoning_gym task 'basic_arithmetc'; did you mean 'basic_arithmetic', "
    )
    assert error("environment.options.task=chain_sum", "environment.options.tasks={leg_counting: 1}") == (
        "environment.options.task: set task or tasks (a weighted mix), not both"
    )
    assert (
        error("environment.options.tasks={chain_sum: 0}")
        == "environment.options.tasks.chain_sum: weights must be > 0, got 0.0"
    )
    assert error("environment.options.task_options={chain_sum: {max_terms: 2}}", build=True) == (
        "environment.options.task_options.chain_sum: 'chain_sum' is not one of the tasks (basic_arithmetic)"
    )
    # a misspelt task is named, not the task_options it leaves without a task (issue 23)
    assert error(
        "environment.options.task=no_such_task", "environment.options.task_options={basic_arithmetic: {}}", build=True
    ).startswith("environment.options.task: unknown reasoning_gym task 'no_such_task'; ")
    assert error("environment.options.task_options={basic_arithmetic: {seed: 3}}").startswith(
        "environment.options.task_options.basic_arithmetic.seed: is set by the environment"
    )
    assert error("environment.options.task_options={basic_arithmetic: {max_termz: 3}}", build=True).startswith(
        "environment.options.task_options.basic_arithmetic: reasoning_gym rejects the task options: "
    )
    assert (
        error("environment.options.prompt=Solve it", build=False)
        == "environment.options.prompt: must contain {question}"
    )


@needs_rg
def test_the_reward_names_rows_from_another_environment() -> None:
    from palestra.checked_reward import RewardError

    with pytest.raises(
        RewardError, match=r"raised on row 0 .*metadata has no 'entry'; the reasoning_gym reward scores rows"
    ):
        reward()(["p"], ["<answer>1</answer>"], [{"answer": "1"}])


@needs_rg
def test_two_training_steps_on_the_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    code = cli.main(["train", "--config", str(REPO / "examples" / "reasoning_gym.yaml"), "train.steps=2",
                     "train.batch_size=4", "train.group_size=2", "train.eval_size=4", "environment.options.eval_size=8",
                     f"run.output_dir={out}"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "trained 2 steps in " in captured.out and "reasoning_gym" in captured.out
    metrics = [json.loads(line) for line in (out / "reasoning_gym" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
