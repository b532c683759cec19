"""Config loading (YAML/TOML), overrides, validation with full dotted paths, component building, and the CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from palestra.checked_reward import CheckedReward
from palestra.config import (
    ComponentBuildError,
    Config,
    ConfigError,
    RewardSpec,
    build_component,
    check_options,
    load_config,
    option,
    parse_override,
    validate_config,
)
from palestra.plugin_manager import get_registry
from palestra.plugins.rewards.combinators import Layer, Layered
from palestra.registry import Registration, Registry

YAML_CONFIG = """
run:
  name: sums
  seed: 7
environment:
  name: arithmetic
  options:
    difficulty: 2
    operations: ["+", "-"]
reward:
  name: weighted_sum
  options:
    components:
      - {name: format, weight: 0.25}
      - {name: correctness, weight: 0.75, options: {tolerance: 0.5}}
train:
  lr: 3e-4          # YAML 1.1 reads this as a string; the float field must still accept it
  batch_size: 4
  max_grad_norm: null
kernels:
  backend: torch
"""

TOML_CONFIG = """
[run]
name = "sums"
seed = 7

[environment]
name = "arithmetic"
options = { difficulty = 2, operations = ["+", "-"] }

[reward]
name = "weighted_sum"

[[reward.options.components]]
name = "format"
weight = 0.25

[[reward.options.components]]
name = "correctness"
weight = 0.75
options = { tolerance = 0.5 }

[train]
lr = 3e-4
batch_size = 4

[kernels]
backend = "torch"
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(*args: object, **kwargs: object) -> str:
    """Load a config that must fail; return its message after checking it is one line."""
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert getattr(info.value, "palestra_user_error", False)
    return msg


# ---- defaults and loading ----------------------------------------------------------------------------
def test_default_config_is_the_builtin_task() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.environment.name == "arithmetic" and cfg.environment.options.difficulty == 1
    assert cfg.reward.name == "layered"
    layers = cfg.reward.options.layers
    assert [type(layer) for layer in layers] == [Layer, Layer]
    assert [layer.name for layer in layers] == ["format", "correctness"]
    assert layers[1].unlock_at == 0.5 and layers[0].options.pattern == "^<answer>-?[0-9]+</answer>$"
    assert layers[1].path == "reward.options.layers[1]"
    assert layers[1].options.tolerance == 0.0  # the component's own default, filled in
    assert cfg.train.lr == 1e-3 and cfg.kernels.backend == "auto"  # the built-in task's own train section
    assert (cfg.policy.name, cfg.optimizer.name, cfg.generator.name) == ("tiny", "grpo", "kv_cache")
    assert [logger.name for logger in cfg.loggers] == ["console", "jsonl"]
    # The plain form validates back to the same tree.
    assert validate_config(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_yaml_and_toml_load_the_same_config(tmp_path: Path) -> None:
    from_yaml = load_config(write(tmp_path, "c.yaml", YAML_CONFIG))
    from_toml = load_config(write(tmp_path, "c.toml", TOML_CONFIG))
    assert from_yaml.train.lr == pytest.approx(3e-4) and isinstance(from_yaml.train.lr, float)
    assert from_yaml.train.max_grad_norm is None
    assert from_toml.train.max_grad_norm == 1.0  # TOML has no null: the default stays
    a, b = from_yaml.to_dict(), from_toml.to_dict()
    a["train"].pop("max_grad_norm"), b["train"].pop("max_grad_norm")
    assert a == b
    assert from_yaml.run.name == "sums" and from_yaml.run.seed == 7
    assert from_yaml.environment.options.operations == ["+", "-"]
    weights = [(c.name, c.weight) for c in from_yaml.reward.options.components]
    assert weights == [("format", 0.25), ("correctness", 0.75)]
    assert from_yaml.reward.options.components[1].options.tolerance == 0.5
    # Sections the file does not name keep the built-in defaults.
    assert from_yaml.train.group_size == 4 and from_yaml.run.output_dir == "runs"


def test_empty_yaml_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "empty.yml", "")).to_dict() == load_config().to_dict()


# ---- overrides ---------------------------------------------------------------------------------------
def test_overrides_set_scalars_lists_and_indexed_nodes(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, "c.yaml", YAML_CONFIG),
        [
            "train.lr=1e-3",
            "train.steps=10",
            "environment.options.operations=[+, '*']",
            "reward.options.components[1].weight=0.5",
            "reward.options.components[0].options.tag=final",
            "kernels.backend=auto",
            "train.max_grad_norm=2",
        ],
    )
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 10 and cfg.train.max_grad_norm == 2.0
    assert cfg.environment.options.operations == ["+", "*"]
    assert cfg.reward.options.components[1].weight == 0.5
    assert cfg.reward.options.components[0].options.tag == "final"
    assert cfg.kernels.backend == "auto"


def test_overrides_reach_into_the_default_config() -> None:
    cfg = load_config(None, ["reward.options.layers[1].unlock_at=0.6", "reward.options.ema_decay=0.5"])
    assert cfg.reward.options.layers[1].unlock_at == 0.6 and cfg.reward.options.ema_decay == 0.5


def test_string_fields_keep_the_override_text() -> None:
    # YAML would read these as an int, a float and a boolean; a str field gets the text as typed.
    assert load_config(None, ["run.name=2024"]).run.name == "2024"
    assert load_config(None, ["run.name=1.10"]).run.name == "1.10"
    assert load_config(None, ["run.name=yes"]).run.name == "yes"
    assert load_config(None, ["reward.options.layers[1].options.tag=null"]).reward.options.layers[1].options.tag is None


def test_later_overrides_win() -> None:
    assert load_config(None, ["train.steps=3", "train.steps=5"]).train.steps == 5


def test_parse_override_splits_keys_and_indices() -> None:
    keys, value = parse_override("reward.options.layers[1].unlock_at=0.25")
    assert keys == ["reward", "options", "layers", 1, "unlock_at"]
    assert value.parsed == 0.25 and value.text == "0.25"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr", "override 'train.lr': expected key=value"),
        ("=3", "override '=3': expected key=value"),
        ("train..lr=3", "is not a dotted key"),
        ("train.lr=[1, 2", "override 'train.lr=[1, 2': cannot parse the value"),
        ("reward.options.layers[5].weight=1", "reward.options.layers[5]: index out of range (the list has 2 items)"),
        ("train.lr.x=1", "train.lr.x: train.lr is 0.001, not a mapping"),
        ("train[0]=1", "train[0]: train is a mapping, not a list"),
    ],
)
def test_bad_overrides_are_one_line_errors(override: str, expected: str) -> None:
    assert expected in config_error(None, [override])


# ---- unknown keys ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trian.lr=1", "trian: unknown key; did you mean 'train'?"),
        ("train.lrr=1", "train.lrr: unknown key; did you mean 'lr'?"),
        ("run.sed=1", "run.sed: unknown key; did you mean 'seed'?"),
        ("environment.options.dificulty=2", "environment.options.dificulty: unknown key; did you mean 'difficulty'?"),
        (
            "reward.options.layers[1].options.tolerence=1",
            "reward.options.layers[1].options.tolerence: unknown key; did you mean 'tolerance'?",
        ),
        (
            "reward.options.layers[0].unlock=1",
            "reward.options.layers[0].unlock: unknown key; did you mean 'unlock_at'?",
        ),
        ("environment.options.zzz=1", "environment.options.zzz: unknown key (known keys: difficulty, terms,"),
    ],
)
def test_unknown_keys_suggest_the_closest(override: str, expected: str) -> None:
    assert expected in config_error(None, [override])


def test_unknown_component_name_suggests_the_closest() -> None:
    assert config_error(None, ["reward.options.layers[1].name=corectness"]) == (
        "reward.options.layers[1].name: no reward named 'corectness'; did you mean 'correctness'?"
    )
    assert config_error(None, ["policy.name=tinny"]) == "policy.name: no policy named 'tinny'; did you mean 'tiny'?"


# ---- bad types and values: full dotted paths, one line each -----------------------------------------
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=fast", "train.lr: expected a float, got 'fast'"),
        ("train.lr=.inf", "train.lr: expected a finite float"),
        ("train.steps=2.5", "train.steps: expected an integer, got 2.5"),
        ("train.steps=0", "train.steps: must be >= 1, got 0"),
        ("train.top_p=1.5", "train.top_p: must be <= 1, got 1.5"),
        ("train.lr=-1", "train.lr: must be > 0"),
        ("train.grad_accum=3", "train.grad_accum: must divide batch_size * group_size = 128"),
        ("train.dtype=fp8", "train.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'fp8'"),
        (
            "kernels.backend=cdua",
            "kernels.backend: expected one of 'auto', 'torch', "
            "'cpp', 'cuda', 'triton', got 'cdua'; did you mean 'cuda'?",
        ),
        ("run.seed=[1]", "run.seed: expected an integer, got [1]"),
        ("train=3", "train: expected a mapping, got 3"),
        ("loggers={name: x}", "loggers: expected a list"),
        ("environment.options.difficulty=9", "environment.options.difficulty: must be <= 6, got 9"),
        (
            "environment.options.operations=[+, /]",
            "environment.options.operations[1]: expected one of '+', '-', '*', got '/'",
        ),
        ("environment.options.prompt=no question", "environment.options.prompt: must contain {question}"),
        ("reward.options.ema_decay=1", "reward.options.ema_decay: must be < 1, got 1.0"),
        ("reward.options.watch=last", "reward.options.watch: expected one of 'previous', 'first', got 'last'"),
        ("reward.options.layers=[]", "reward.options.layers: needs at least one reward"),
        ("reward.options.layers[1].unlock_at=high", "reward.options.layers[1].unlock_at: expected a float, got 'high'"),
        (
            "reward.options.layers[0].unlock_at=0.5",
            "reward.options.layers[0].unlock_at: the first layer is always active",
        ),
        (
            "reward.options.layers[1].unlock_at=null",
            "reward.options.layers[1].unlock_at: required for every layer after the first",
        ),
        ("reward.options.layers[1].weight=heavy", "reward.options.layers[1].weight: expected a float, got 'heavy'"),
        (
            "reward.options.layers[0].label=correctness",
            "reward.options.layers[1].label: layers[0] is also called 'correctness'",
        ),
        (
            "reward.options.layers[0].options.pattern=(",
            "reward.options.layers[0].options.pattern: invalid regular expression",
        ),
        (
            "reward.options.layers[1].options.tolerance=-1",
            "reward.options.layers[1].options.tolerance: must be >= 0, got -1.0",
        ),
        (
            "reward.options.layers[1].options.mode=fuzzy",
            "reward.options.layers[1].options.mode: expected one of 'auto', 'numeric', 'text'",
        ),
        (
            "reward.options.layers[1].options=[1]",
            "reward.options.layers[1].options: expected a mapping of options for reward 'correctness'",
        ),
        (
            "reward.options.layers[1].name=",
            "reward.options.layers[1].name: is empty; name a registered reward (agent_reward, correctness, env_reward, "
            "factual,",
        ),
        ("reward.options.layers[1].name=[x]", "reward.options.layers[1].name: expected a string, got ['x']"),
    ],
)
def test_bad_values_name_their_full_path(override: str, expected: str) -> None:
    msg = config_error(None, [override])
    assert expected in msg
    assert msg.startswith(expected.split(":")[0] + ":")


def test_bad_values_in_a_weighted_sum_file_name_the_term(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", YAML_CONFIG.replace("weight: 0.75", "weight: lots"))
    assert config_error(path).startswith("reward.options.components[1].weight: expected a float, got 'lots'")


def test_missing_required_keys_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "reward:\n  options: {}\n")
    assert config_error(path) == "reward.name: missing required key"
    path = write(tmp_path, "d.yaml", "reward:\n  name: weighted_sum\n")
    assert config_error(path).startswith("reward.options.components: needs at least one reward")


# ---- files -------------------------------------------------------------------------------------------
def test_file_problems_are_one_line_errors(tmp_path: Path) -> None:
    assert "does not exist" in config_error(tmp_path / "missing.yaml")
    assert "unknown format '.json'" in config_error(write(tmp_path, "c.json", "{}"))
    msg = config_error(write(tmp_path, "bad.yaml", "train:\n  lr: [1, 2\n  steps: 3\n"))
    assert msg.startswith(f"{tmp_path / 'bad.yaml'}:") and "invalid YAML" in msg
    assert "invalid TOML" in config_error(write(tmp_path, "bad.toml", "[train\nlr = 1\n"))
    assert "the top level must be a mapping" in config_error(write(tmp_path, "list.yaml", "- 1\n- 2\n"))


# ---- component options and building ------------------------------------------------------------------
@dataclass
class ProbeOptions:
    size: int = option(3, ge=1)
    scale: float = 1.0


class Probe:
    """A component that records what it was built with; fails when asked to."""

    def __init__(self, size: int, scale: float) -> None:
        if scale == 13.0:
            raise RuntimeError("unlucky scale")
        self.size, self.scale = size, scale


def probe_registry() -> Registry:
    registry = Registry()
    for reg in get_registry():
        registry.add(reg)
    registry.add(Registration("environment", "probe", Probe, ProbeOptions, "test probe", "tests", "palestra-tests"))
    registry.add(Registration("logger", "bare", lambda: "bare logger", None, "takes no options", "tests", None))
    return registry


def test_component_options_are_validated_and_passed_as_keywords() -> None:
    registry = probe_registry()
    cfg = load_config(None, ["environment.name=probe", "environment.options={size: 5}"], registry=registry)
    assert cfg.environment.options == ProbeOptions(size=5, scale=1.0)
    probe = build_component("environment", cfg.environment, path="environment", registry=registry)
    assert isinstance(probe, Probe) and (probe.size, probe.scale) == (5, 1.0)
    with pytest.raises(ConfigError, match=r"^environment.options.size: must be >= 1, got 0$"):
        load_config(None, ["environment.name=probe", "environment.options={size: 0}"], registry=registry)
    # A component without options rejects any.
    with pytest.raises(ConfigError, match=r"^loggers\[0\].options: logger 'bare' takes no options, got \['level'\]$"):
        load_config(None, ["loggers=[{name: bare, options: {level: 1}}]"], registry=registry)
    cfg = load_config(None, ["loggers=[{name: bare}]"], registry=registry)
    assert build_component("logger", cfg.loggers[0], path="loggers[0]", registry=registry) == "bare logger"


def test_build_component_from_plain_data_validates_with_the_given_path() -> None:
    registry = probe_registry()
    with pytest.raises(ConfigError) as info:
        build_component("environment", {"name": "probe", "options": {"size": "big"}}, path="envs[2]", registry=registry)
    assert str(info.value) == "envs[2].options.size: expected an integer, got 'big'"
    with pytest.raises(ConfigError, match=r"^x: unknown component kind 'widget'"):
        build_component("widget", {"name": "probe"}, path="x", registry=registry)


def test_a_failing_factory_names_the_path_and_the_plugin() -> None:
    registry = probe_registry()
    with pytest.raises(ComponentBuildError) as info:
        build_component(
            "environment", {"name": "probe", "options": {"scale": 13}}, path="environment", registry=registry
        )
    msg = str(info.value)
    assert msg == (
        "environment: building environment 'probe' (plugin 'tests', distribution 'palestra-tests') failed: "
        "RuntimeError: unlucky scale"
    )


def test_rewards_are_built_checked_and_nested_through_the_registry() -> None:
    cfg = load_config()
    reward = build_component("reward", cfg.reward, path="reward")
    assert isinstance(reward, CheckedReward) and isinstance(reward.reward, Layered)
    inner = reward.reward.rewards
    assert [r.path for r in inner] == ["reward.options.layers[0]", "reward.options.layers[1]"]
    assert all(isinstance(r, CheckedReward) for r in inner)
    # A spec node can build itself.
    spec = RewardSpec("format", {"tag": "final"})
    built = build_component("reward", spec, path="extra")
    assert built.reward.options.tag == "final"


def test_check_options_validates_python_construction() -> None:
    assert check_options(ProbeOptions, {"size": 2}, where="Probe") == ProbeOptions(2, 1.0)
    with pytest.raises(ConfigError, match=r"^Probe.sizes: unknown key; did you mean 'size'\?$"):
        check_options(ProbeOptions, {"sizes": 2}, where="Probe")


# ---- the console script ------------------------------------------------------------------------------
def palestra(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "palestra"
    assert exe.exists(), f"the palestra console script is not installed next to {sys.executable}"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)


def test_config_show_prints_the_resolved_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", YAML_CONFIG)
    done = palestra("config", "show", str(path), "train.steps=9", "reward.options.components[0].weight=0.5")
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    expected = load_config(path, ["train.steps=9", "reward.options.components[0].weight=0.5"]).to_dict()
    assert shown == expected
    # Defaults are filled in, down to nested component options.
    assert shown["reward"]["options"]["components"][1]["options"] == {
        "tag": "answer",
        "key": "answer",
        "mode": "auto",
        "tolerance": 0.5,
    }
    assert shown["train"]["steps"] == 9 and shown["train"]["group_size"] == 4


def test_config_show_without_a_file_and_a_bad_override() -> None:
    done = palestra("config", "show", "train.lr=fast")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == "palestra config: error: train.lr: expected a float, got 'fast'\n"
    done = palestra("config", "show")
    assert done.returncode == 0 and yaml.safe_load(done.stdout) == load_config().to_dict()


@pytest.mark.slow
def test_train_rejects_a_misspelt_component_before_building_anything() -> None:
    done = palestra("train", "reward.name=corectness")
    assert done.returncode == 2
    assert (
        done.stderr == "palestra train: error: reward.name: no reward named 'corectness'; did you mean 'correctness'?\n"
    )
