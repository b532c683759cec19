"""The example third-party plugin (examples/palestra-example-plugin), pip-installed outside the venv.

It must be listed by ``palestra plugins``, usable by name from a config, and its reward and environment must
do what they say.
"""

from __future__ import annotations

import json
import textwrap
import warnings

import plugin_installs
import pytest
import yaml

from palestra import plugin_manager
from palestra.config import ConfigError, build_component, load_config
from palestra.plugin_manager import PalestraPluginWarning
from palestra.types import Environment, RewardOutput

pytestmark = pytest.mark.pip_install


@pytest.fixture
def example(in_process, sites) -> None:
    """The example plugin installed and loaded in this process."""
    in_process.use(sites["example"])


REWARD = {"name": "keyword_coverage", "options": {"keywords": ["apple", "river"]}}


# ---- through the command line and a fresh interpreter ---------------------------------------------------
def test_listed_by_palestra_plugins_with_its_reward_and_environment(sites, tmp_path) -> None:
    result = plugin_installs.plugins_all_json(sites, tmp_path)
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in json.loads(result.stdout) if not r["builtin"]]
    assert row["name"] == "example" and row["distribution"] == "palestra-example-plugin" and row["version"] == "0.1.0"
    assert row["module"] == "palestra_example" and row["builtin"] is False and row["error"] is None
    assert row["hooks"] == ["register_environments", "register_rewards"]
    assert row["rewards"] == ["keyword_coverage"] and row["environments"] == ["word_usage"]
    assert row["optimizers"] == row["policies"] == row["loggers"] == row["generators"] == []


def test_config_show_resolves_the_plugin_reward_and_environment_by_name(sites, tmp_path) -> None:
    result = plugin_installs.run_palestra(
        ["config", "show", f"reward={json.dumps(REWARD)}", "environment={name: word_usage, options: {num_words: 3}}"],
        [sites["example"]],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["reward"] == {
        "name": "keyword_coverage",
        "options": {
            "keywords": ["apple", "river"],
            "metadata_key": "keywords",
            "case_sensitive": False,
            "whole_words": True,
        },
    }
    assert config["environment"]["name"] == "word_usage"
    assert config["environment"]["options"]["num_words"] == 3
    assert "apple" in config["environment"]["options"]["vocabulary"]  # the default, filled in


SCRIPT = textwrap.dedent(
    """
    import json
    from palestra.config import ConfigError, build_component, load_config

    config = load_config(
        None, ["environment={name: word_usage, options: {num_words: 2}}", "reward={name: keyword_coverage}"]
    )
    env = build_component("environment", config.environment, path="environment")
    reward = build_component("reward", config.reward, path="reward")
    observations = env.reset(2, seed=7, group_size=2)
    words = [obs.metadata["keywords"] for obs in observations]
    completions = [
        f"The {words[0][0]} and the {words[0][1]} met.",  # both words
        f"Only the {words[1][0].upper()} came.",  # one word, other case (case-insensitive by default)
        "Nothing relevant here.",
        f"The {words[3][1]}s are plural, so whole_words does not count them.",
    ]
    done = env.step(completions)
    scores = reward([o.prompt for o in observations], completions, [o.metadata for o in observations]).scores
    try:
        build_component("reward", {"name": "broken_reward"}, path="reward")
        missing = None
    except ConfigError as e:
        missing = str(e)
    print(json.dumps({
        "words": words, "done": done.done, "scores": scores.tolist(), "dtype": str(scores.dtype), "missing": missing
    }))
    """
)


def test_a_config_builds_and_scores_with_the_plugin_while_a_broken_plugin_is_installed(sites, tmp_path) -> None:
    result = plugin_installs.run_python(["-c", SCRIPT], [sites["example"], sites["broken"]], tmp_path)
    assert result.returncode == 0, result.stderr
    # One warning for the broken distribution (Python prints it with its source line), and nothing else.
    assert result.stderr.count("PalestraPluginWarning") == 1, result.stderr
    assert "'palestra-broken-plugin'" in result.stderr
    out = json.loads(result.stdout)
    assert out["words"][0] == out["words"][1] and out["words"][2] == out["words"][3]  # rows of a group share a task
    assert out["words"][0] != out["words"][2]
    assert out["done"] == [True] * 4
    assert out["scores"] == [1.0, 0.5, 0.0, 0.0] and out["dtype"] == "torch.float32"
    assert out["missing"].startswith("reward.name: no reward named 'broken_reward'")
    assert "'palestra-broken-plugin' failed to load" in out["missing"] and "\n" not in out["missing"]


# ---- in this process -----------------------------------------------------------------------------------------
def test_registration_is_attributed_to_the_plugin_and_its_distribution(example) -> None:
    registry = plugin_manager.get_registry()
    reward = registry.get("reward", "keyword_coverage")
    env = registry.get("environment", "word_usage")
    for reg in (reward, env):
        assert (reg.plugin, reg.distribution) == ("example", "palestra-example-plugin")
        assert reg.description
    assert reward.options.__name__ == "KeywordOptions" and env.options.__name__ == "WordUsageOptions"


def test_reward_options_case_sensitivity_and_whole_words(example) -> None:
    def score(options: dict, completions: list[str], metadata: list[dict] | None = None) -> list[float]:
        reward = build_component("reward", {"name": "keyword_coverage", "options": options}, path="reward")
        out = reward(["p"] * len(completions), completions, metadata or [{}] * len(completions))
        assert isinstance(out, RewardOutput)
        return out.scores.tolist()

    texts = ["An Apple fell.", "apple and river", "pineapple", "none"]
    assert score({"keywords": ["apple", "river"]}, texts) == [0.5, 1.0, 0.0, 0.0]
    assert score({"keywords": ["apple", "river"], "case_sensitive": True}, texts) == [0.0, 1.0, 0.0, 0.0]
    assert score({"keywords": ["apple"], "whole_words": False}, texts) == [1.0, 1.0, 1.0, 0.0]
    # Keywords from each row's metadata, under a configurable key.
    meta = [{"need": ["fell"]}, {"need": ["river", "sea", "lake"]}, {"need": ["x"]}, {"need": ["none"]}]
    assert score({"metadata_key": "need"}, texts, meta) == pytest.approx([1.0, 1 / 3, 0.0, 1.0])


def test_reward_errors_name_the_option_or_the_row(example) -> None:
    with pytest.raises(
        ConfigError, match=r"^reward\.options: keyword_coverage: keywords\[1\] must be a non-empty string"
    ):
        load_config(None, ['reward={name: keyword_coverage, options: {keywords: [a, " "]}}'])
    with pytest.raises(ConfigError, match=r"reward\.options\.case_sensitive: expected a boolean"):
        load_config(None, ["reward={name: keyword_coverage, options: {case_sensitive: maybe}}"])
    reward = build_component("reward", {"name": "keyword_coverage"}, path="reward")
    with pytest.raises(Exception, match=r"row 1 has no keywords"):
        reward(["p", "p"], ["a", "b"], [{"keywords": ["a"]}, {}])


def test_environment_follows_the_environment_interface(example) -> None:
    env = build_component("environment", {"name": "word_usage", "options": {"num_words": 3}}, path="environment")
    assert isinstance(env, Environment)
    assert env.agent_ids == ("assistant",) and env.max_turns == 1
    obs = env.reset(3, seed=1, group_size=2)
    assert len(obs) == 6
    again = env.reset(3, seed=1, group_size=2)
    assert [o.prompt for o in obs] == [o.prompt for o in again]  # same seed, same tasks
    for o in obs:
        assert o.agent_id == "assistant" and o.turn == 0
        assert len(set(o.metadata["keywords"])) == 3
        assert all(word in o.prompt for word in o.metadata["keywords"])
        assert o.messages is not None and o.messages[0].content == o.prompt
    with pytest.raises(ValueError, match="got 2 actions for a batch of 6 rows"):
        env.step(["a", "b"])
    result = env.step([f"sentence {i}." for i in range(6)])
    assert result.done == [True] * 6 and result.observations == [None] * 6
    assert result.info[0] == {"assistant": {"sentences": 1}}


def test_environment_options_are_checked(example) -> None:
    with pytest.raises(
        ConfigError, match=r"^environment\.options: word_usage: vocabulary has 2 distinct words, fewer than num_words=3"
    ):
        load_config(None, ["environment={name: word_usage, options: {num_words: 3, vocabulary: [a, b, a]}}"])


def test_the_example_is_not_loaded_when_filtered_out(in_process, sites) -> None:
    in_process.use(sites["example"], PALESTRA_LOAD_PLUGINS="")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PalestraPluginWarning)
        with pytest.raises(ConfigError, match=r"^reward\.name: no reward named 'keyword_coverage'"):
            build_component("reward", REWARD, path="reward")
