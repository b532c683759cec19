"""The ``verifiers`` environment, reward and agent (plugins/envs/verifiers_env.py) over three verifiers environment
packages written for these tests (tests/plugins/vf_envs/: single-turn, tool, multi-turn), each pip-installed into a
temporary site exactly as a verifiers environment package is installed, and found by its id as verifiers finds one."""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from train_processes import error_line, palestra, write_config

pytest.importorskip("verifiers.v1")

from palestra.errors import ConfigError
from palestra.plugins.envs.verifiers_env import (
    RESULT_KEY,
    VerifiersEnv,
    VerifiersReward,
    build_trace,
    loaded_env,
    prompt_messages,
)
from palestra.testing import check_environment, check_reward

PACKAGES = Path(__file__).parent / "vf_envs"
REVERSE = {"env_id": "vf-reverse-word", "env_args": {"num_tasks": 12, "seed": 3}}


def install(source: Path, site: Path, work: Path) -> None:
    """``pip install --no-deps --no-build-isolation --target site`` from a copy (pip writes build files beside it)."""
    copy = work / source.name
    shutil.copytree(source, copy)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(copy)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def vf_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The three test environments installed into one site folder, on sys.path for the in-process tests."""
    site = tmp_path_factory.mktemp("vf-site")
    work = tmp_path_factory.mktemp("vf-build")
    for package in sorted(PACKAGES.iterdir()):
        install(package, site, work)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))
    for name in [m for m in sys.modules if m.startswith("vf_")]:
        del sys.modules[name]


def test_the_packages_are_installed_as_distributions_verifiers_finds_by_id(vf_site: Path) -> None:
    import verifiers.v1 as vf

    assert {p.name for p in vf_site.glob("*.dist-info")} == {
        "vf_reverse_word-0.1.0.dist-info", "vf_calc_tool-0.1.0.dist-info", "vf_guess_number-0.1.0.dist-info"
    }  # fmt: skip
    from verifiers.v1.utils.loaders import taskset_class

    assert taskset_class("vf-reverse-word").__name__ == "ReverseTaskset"
    assert vf.environment_class("vf-guess-number").__name__ == "GuessEnv"


def test_tasks_come_from_the_taskset_group_rows_share_one_and_seeds_reproduce(vf_site: Path) -> None:
    env = VerifiersEnv(**REVERSE)
    first = env.reset(3, seed=7, group_size=2)
    assert len(first) == 6
    for g in range(3):
        assert first[2 * g].metadata == first[2 * g + 1].metadata
        assert first[2 * g].messages == first[2 * g + 1].messages
    again = VerifiersEnv(**REVERSE).reset(3, seed=7, group_size=2)
    assert [o.metadata for o in again] == [o.metadata for o in first]
    obs = first[0]
    word = obs.metadata["task"]["word"]
    assert [m.role for m in obs.messages or []] == ["system", "user"]
    assert obs.messages is not None and obs.messages[1].content == (
        f"Reverse the word '{word}'. Reply with the reversed word inside <answer></answer>."
    )
    assert obs.metadata["answer"] == word[::-1]
    result = env.step(["x"] * 6)
    assert result.done == [True] * 6


def test_the_held_out_split_is_the_last_tasks_and_training_never_draws_them(vf_site: Path) -> None:
    env = VerifiersEnv(**REVERSE, eval_examples=4)
    train_rows = {o.metadata["verifiers"]["index"] for o in env.reset(8, seed=1)}
    assert train_rows <= set(range(8))
    eval_rows = {o.metadata["verifiers"]["index"] for o in env.held_out().reset(8, seed=1)}
    assert eval_rows == {8, 9, 10, 11}


def test_the_reward_is_verifiers_weighted_sum_with_each_function_a_component(vf_site: Path) -> None:
    env = VerifiersEnv(**REVERSE)
    obs = env.reset(1, seed=0, group_size=4)
    word = obs[0].metadata["task"]["word"]
    completions = [f"<answer>{word[::-1]}</answer>", f"<answer>{word}</answer>", word[::-1], ""]
    out = VerifiersReward()([o.prompt for o in obs], completions, [o.metadata for o in obs])
    # exact has weight 1.0 and tags 0.2 in the package (tests/plugins/vf_envs/vf-reverse-word)
    assert out.scores.tolist() == pytest.approx([1.2, 0.2, 0.0, 0.0])
    assert out.components["exact"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.components["tags"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.metrics["weight/exact"] == 1.0 and out.metrics["weight/tags"] == pytest.approx(0.2)
    expected_chars = sum(len(c) for c in completions) / 4
    assert out.metrics["metric/reply_chars"] == pytest.approx(expected_chars)
    assert out.metrics["score_errors"] == 0.0


def test_the_reward_matches_verifiers_own_scoring_of_the_same_trace(vf_site: Path) -> None:
    """verifiers' Task.score on a trace of the conversation, recorded through its own Trace API, gives the same
    numbers as the reward (trace.reward is verifiers' weighted sum)."""
    import verifiers.v1 as vf

    env = VerifiersEnv(**REVERSE)
    obs = env.reset(2, seed=5)
    for o in obs:
        task = loaded_env(env.key).tasks[o.metadata["verifiers"]["index"]]
        reply = f"<answer>{task.data.answer}</answer>"
        trace = build_trace(
            task, [(m, False) for m in prompt_messages(task)] + [(vf.AssistantMessage(content=reply), True)]
        )
        asyncio.run(task.score(trace))
        out = VerifiersReward()([o.prompt], [reply], [o.metadata])
        assert out.scores.item() == pytest.approx(trace.reward)
        assert {k: r.score for k, r in trace.rewards.items() if r} == {k: v.item() for k, v in out.components.items()}


def test_a_result_an_agent_scored_is_reported_as_it_is(vf_site: Path) -> None:
    env = VerifiersEnv(env_id="vf-calc-tool")
    obs = env.reset(1, seed=0)
    meta = {**obs[0].metadata, RESULT_KEY: {"rewards": {"correct": [1.0, 1.0], "used_tool": [1.0, 0.1]}}}
    out = VerifiersReward()([obs[0].prompt], ["42"], [meta])
    assert out.scores.tolist() == pytest.approx([1.1])
    assert out.components["used_tool"].tolist() == [1.0]


def test_a_tool_environment_without_the_agent_is_one_line(vf_site: Path) -> None:
    env = VerifiersEnv(env_id="vf-calc-tool")
    assert env.needs_agent and VerifiersEnv(**REVERSE).needs_agent is False
    obs = env.reset(1, seed=0)
    with pytest.raises(ConfigError) as e:
        VerifiersReward()([obs[0].prompt], ["42"], [obs[0].metadata])
    assert str(e.value) == (
        "reward verifiers: verifiers environment 'vf-calc-tool' runs tool or multi-turn episodes; add "
        "`agent: {name: verifiers}` to the config so they run as verifiers rollouts"
    )


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (
            {"env_id": "vf-not-there"},
            "environment.options.env_id: verifiers environment 'vf-not-there' is not installed (no module "
            "'vf_not_there'); install its package (pip install vf-not-there, or prime env install "
            "<owner>/vf-not-there)",
        ),
        (
            {"env_id": "vf-reverse-word", "env_args": {"num_tasks": "many"}},
            "environment.options.env_args: verifiers environment 'vf-reverse-word' rejects them: num_tasks: Input "
            "should be a valid integer, unable to parse string as an integer",
        ),
        (
            {"env_id": "vf-reverse-word", "env_args": {"num_tasks": 0}},
            "environment.options.env_args: verifiers environment 'vf-reverse-word' failed to load its tasks: "
            "ValueError: num_tasks must be at least 1",
        ),
        (
            {"env_id": "vf-reverse-word", "env_args": {"id": "other"}},
            "verifiers.env_args: must not set 'id' (env_id names the environment)",
        ),
    ],
)
def test_a_bad_environment_is_one_line_naming_the_option(vf_site: Path, options: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as e:
        VerifiersEnv(**options)
    assert str(e.value) == line


def test_an_unknown_taskset_field_is_one_line(vf_site: Path) -> None:
    with pytest.raises(ConfigError) as e:
        VerifiersEnv(env_id="vf-reverse-word", env_args={"num_taskz": 3})
    assert str(e.value).startswith(
        "environment.options.env_args: verifiers environment 'vf-reverse-word' rejects them: num_taskz: "
    )


def test_a_package_that_fails_to_import_is_one_line(vf_site: Path, tmp_path: Path) -> None:
    (tmp_path / "vf_broken.py").write_text("import not_a_module_anywhere\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        with pytest.raises(ConfigError) as e:
            VerifiersEnv(env_id="vf-broken")
    finally:
        sys.path.remove(str(tmp_path))
    assert str(e.value) == (
        "environment.options.env_id: verifiers environment 'vf-broken' fails to import: ModuleNotFoundError: No "
        "module named 'not_a_module_anywhere'"
    )


def test_the_contract_kit_passes_on_the_environment_and_the_reward(vf_site: Path) -> None:
    check_environment(VerifiersEnv, dict(REVERSE), reward=VerifiersReward)
    check_reward(VerifiersReward, {}, environment=VerifiersEnv, environment_options=dict(REVERSE))


@pytest.mark.slow
def test_a_training_run_on_a_verifiers_environment_logs_each_reward_component(
    tmp_path: Path, vf_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    sections = {
        "environment": {"name": "verifiers", "options": dict(REVERSE)},
        "reward": {"name": "verifiers"},
    }
    raw = raw_config(sections=sections, steps=3, save_every=3)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=vf_site)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "r" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/exact" in r]
    assert len(steps) == 3, records[:2]
    for r in steps:  # each reward function of the package is a component; its weight and the metric are logged
        assert 0.0 <= r["reward/exact"] <= 1.0 and 0.0 <= r["reward/tags"] <= 1.0
        assert r["curriculum/weight/exact"] == 1.0 and r["curriculum/weight/tags"] == pytest.approx(0.2)
        assert r["curriculum/metric/reply_chars"] >= 0.0
    assert {"eval/exact", "eval/tags"} <= set(records[0])  # held-out scoring before training, by component


def test_a_training_run_naming_a_missing_environment_is_one_line_and_writes_nothing(
    tmp_path: Path, vf_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    sections = {
        "environment": {"name": "verifiers", "options": {"env_id": "vf-not-there"}},
        "reward": {"name": "verifiers"},
    }
    raw = raw_config(sections=sections, steps=1)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=vf_site)
    assert result.returncode == 2
    assert error_line(result).endswith(
        "environment.options.env_id: verifiers environment 'vf-not-there' is not installed (no module "
        "'vf_not_there'); install its package (pip install vf-not-there, or prime env install <owner>/vf-not-there)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


# ---- tool and multi-turn environments: verifiers rollouts against the rollout endpoint ---------------------------
@pytest.fixture
def bridge() -> Iterator[Callable[..., Any]]:
    """``bridge(**env_options)``: the verifiers environment played by the verifiers agent through the real endpoint
    (HTTP on 127.0.0.1, the openai client), closed at the end of the test."""
    from palestra.agents.bridge import AgentEnvironment
    from palestra.agents.server import AgentServer
    from palestra.plugins.envs.verifiers_env import VerifiersAgent
    from palestra.plugins.tools.parsers import HermesParser

    made: list[Any] = []

    def make(*, agent_turns: int = 3, requests: int = 4, **options: Any) -> Any:
        agent = VerifiersAgent(max_turns=agent_turns)
        env = AgentEnvironment(VerifiersEnv(**options), agent, AgentServer(), HermesParser(), max_turns=requests,
                               request_timeout_s=30)  # fmt: skip
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()


def scored(env: Any, respond: Callable[[Any], str], batch: int) -> tuple[list[Any], Any]:
    """Episodes of ``env`` with ``respond`` as the policy, and the verifiers reward of their rows."""
    from palestra.engine.rollout import run_episodes
    from palestra.multiagent.credit import reward_rows

    episodes = run_episodes(env, lambda obs: [respond(o) for o in obs], batch, seed=0)
    prompts, completions, metadata = reward_rows(episodes)
    return episodes, VerifiersReward()(prompts, completions, metadata)


def assert_one_sequence(episode: Any) -> None:
    """Each turn's conversation is the last one's plus the exact sampled text (the agent echoed back the assistant
    messages it was answered, content and tool_calls, so the endpoint put the sampled text back): the episode trains
    as one token sequence, not per-turn rows."""
    from palestra.types import Message

    for before, after in zip(episode.turns, episode.turns[1:]):
        seen = list(before.observation.messages or [])
        assert (after.observation.messages or [])[: len(seen) + 1] == [*seen, Message("assistant", before.completion)]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_tool_environment_runs_its_toolset_through_the_endpoints_tool_calls(vf_site: Path, bridge: Any) -> None:
    """The model's hermes tool calls reach the package's own @vf.tool methods; their results come back as tool
    messages; verifiers scores the whole conversation (the right number after two tool calls: 1.0 + 0.1)."""

    def respond(obs: Any) -> str:
        numbers = [int(n) for n in re_numbers(obs.metadata["task"]["prompt"])]  # pens per box, boxes, loose pens
        last = obs.messages[-1]
        if last.role == "user":
            return call("calc_multiply", a=numbers[1], b=numbers[0])
        if "calc_add" not in "".join(m.content for m in obs.messages):
            return call("calc_add", a=int(last.content), b=numbers[2])
        return f"There are {last.content} pens."

    episodes, out = scored(bridge(env_id="vf-calc-tool"), respond, 2)
    assert out.scores.tolist() == pytest.approx([1.1, 1.1])
    assert out.components["correct"].tolist() == [1.0, 1.0] and out.components["used_tool"].tolist() == [1.0, 1.0]
    for ep in episodes:
        assert len(ep.turns) == 3
        tool_messages = [m for m in ep.turns[-1].observation.messages or [] if m.role == "tool"]
        assert len(tool_messages) == 2 and ep.turns[-1].observation.tools is not None
        assert {t["function"]["name"] for t in ep.turns[0].observation.tools or []} == {"calc_add", "calc_multiply"}
        assert_one_sequence(ep)


def test_a_bad_tool_call_is_an_error_message_to_the_model_and_a_wrong_answer(vf_site: Path, bridge: Any) -> None:
    seen: list[str] = []

    def respond(obs: Any) -> str:
        if obs.messages[-1].role == "tool":
            seen.append(obs.messages[-1].content)
            return "I do not know."
        return call("calc_divide", a=1, b=2)

    _, out = scored(bridge(env_id="vf-calc-tool"), respond, 1)
    assert seen == ["Error: unknown tool 'calc_divide'; the tools are calc_add, calc_multiply"]
    assert out.scores.tolist() == pytest.approx([0.1])  # a tool message came back: used_tool, but no right number


def test_a_request_past_the_endpoints_limit_ends_the_conversation_where_it_is(vf_site: Path, bridge: Any) -> None:
    """agent.max_turns=2 requests: the third is refused (HTTP 400, code max_turns); the agent stops there and
    verifiers scores the conversation so far (a tool was used, no answer: 0.1), not an error."""
    episodes, out = scored(
        bridge(env_id="vf-calc-tool", agent_turns=8, requests=2), lambda o: call("calc_add", a=1, b=2), 2
    )
    assert out.scores.tolist() == pytest.approx([0.1, 0.1])
    for ep in episodes:
        assert len(ep.turns) == 2
        assert ep.last.info["agent_truncated"] is True and ep.last.info["agent_error"] is None


def test_a_multi_turn_environment_plays_its_user_turns_between_the_models(vf_site: Path, bridge: Any) -> None:
    """The package's Env.run answers each guess with a user turn ("No, higher. ..."); the model's second guess is
    right: solved 1.0, quick 1/2 (one wrong guess first); a target of 1 is right at once (quick 1.0)."""

    def respond(obs: Any) -> str:
        target = obs.metadata["task"]["target"]
        return "1" if obs.turn == 0 else f"Then {target}."

    episodes, out = scored(bridge(env_id="vf-guess-number", env_args={"high": 9}), respond, 3)
    for ep, total in zip(episodes, out.scores.tolist()):
        target = ep.metadata["task"]["target"]
        if target == 1:
            assert len(ep.turns) == 1 and total == pytest.approx(1.5)
        else:
            assert len(ep.turns) == 2 and total == pytest.approx(1.25)
            assert ep.turns[1].observation.messages is not None
            assert ep.turns[1].observation.messages[-1].content == "No, higher. Guess again: one number."
            assert_one_sequence(ep)


def test_a_single_turn_environment_through_the_agent_scores_as_without_it(vf_site: Path, bridge: Any) -> None:
    _, out = scored(bridge(**REVERSE), lambda obs: f"<answer>{obs.metadata['answer']}</answer>", 2)
    assert out.scores.tolist() == pytest.approx([1.2, 1.2])


def re_numbers(text: str) -> list[str]:
    import re

    return re.findall(r"\d+", text)


AGENT_RUNS = [
    pytest.param({"env_id": "vf-reverse-word", "env_args": {"num_tasks": 8}}, ["exact", "tags"], id="single-turn"),
    pytest.param({"env_id": "vf-calc-tool", "env_args": {"num_tasks": 8}}, ["correct", "used_tool"], id="tool"),
    pytest.param({"env_id": "vf-guess-number", "env_args": {"num_tasks": 8}}, ["solved", "quick"], id="multi-turn"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("options", "components"), AGENT_RUNS)
def test_a_training_run_plays_each_kind_of_verifiers_environment_through_the_agent(
    tmp_path: Path, vf_site: Path, raw_config: Callable[..., dict[str, Any]], options: dict[str, Any],
    components: list[str],
) -> None:  # fmt: skip
    sections = {"environment": {"name": "verifiers", "options": options}, "reward": {"name": "verifiers"}}
    raw = raw_config(sections=sections, steps=2, save_every=2, batch_size=2, group_size=2)
    raw["policy"]["options"]["max_len"] = 1024  # the tool env's prompt carries its two tools' descriptions
    raw["agent"] = {"name": "verifiers", "options": {"max_turns": 3}, "max_turns": 3}
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=vf_site)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trajectory: one token sequence per episode" in result.stdout and "per-turn rows" not in result.stderr
    records = [json.loads(line) for line in (tmp_path / "runs" / "r" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "agents/requests_per_episode" in r]
    assert len(steps) == 2, records[:2]
    for r in steps:
        assert r["agents/error_rate"] == 0.0 and r["agents/requests_per_episode"] >= 1.0
        assert all(f"reward/{name}" in r for name in components), sorted(r)
        assert r["curriculum/score_errors"] == 0.0


@pytest.mark.parametrize("env_id", ["vf-calc-tool", "vf-guess-number"])
def test_the_contract_kit_passes_on_tool_and_multi_turn_environments_behind_the_agent(
    vf_site: Path, bridge: Any, env_id: str
) -> None:
    check_environment(lambda: bridge(env_id=env_id, env_args={"num_tasks": 6}), {}, reward=VerifiersReward)


@pytest.mark.slow
def test_the_example_trains_with_its_package_installed(tmp_path: Path) -> None:
    """examples/verifiers_sums.yaml for 2 steps, its environment package pip-installed as its header says."""
    site, work = tmp_path / "site", tmp_path / "build"
    work.mkdir()
    install(PACKAGES.parents[2] / "examples" / "verifiers" / "vf-small-sums", site, work)
    example = PACKAGES.parents[2] / "examples" / "verifiers_sums.yaml"
    args = ["--config", str(example), "train.steps=2", "train.eval_size=4", f"run.output_dir={tmp_path / 'runs'}"]
    result = palestra(args, tmp_path, site=site)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out reward on 4 tasks" in result.stdout and "correct" in result.stdout
    metrics = [
        json.loads(line) for line in (tmp_path / "runs" / "verifiers_sums" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics if "reward/correct" in m] == [1, 2]


def test_a_tool_environment_trained_without_the_agent_is_one_line(
    tmp_path: Path, vf_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    sections = {
        "environment": {"name": "verifiers", "options": {"env_id": "vf-calc-tool"}},
        "reward": {"name": "verifiers"},
    }
    raw = raw_config(sections=sections, steps=1, batch_size=2, group_size=2)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=vf_site)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result).endswith(
        "reward verifiers: verifiers environment 'vf-calc-tool' runs tool or multi-turn episodes; add "
        "`agent: {name: verifiers}` to the config so they run as verifiers rollouts"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # the held-out scoring before training
