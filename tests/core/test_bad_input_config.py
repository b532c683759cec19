"""Bad input met with one line naming the culprit, never a traceback: config files that are not UTF-8 or repeat a
key, an override without its value, a renamed component's stale options, GRPO with groups of one, a doctor step
that was skipped, and a metrics file with unreadable lines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from palestra import cli
from palestra.config import ConfigError, TrainConfig, load_config, option
from palestra.plugin_manager import get_registry
from palestra.registry import Registration, Registry


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def only_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The command's one stderr line, after checking that it failed with status 2 and printed nothing else."""
    code, out, err = run_cli(capsys, *args)
    assert (code, out) == (2, ""), err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


# ---- 1. a config file that is not UTF-8 ------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_a_latin1_config_file_is_one_line_naming_the_file_line_and_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    path = tmp_path / f"latin1{suffix}"
    text = "run:\n  name: café\n" if suffix == ".yaml" else '[run]\nname = "café"\n'
    path.write_bytes(text.encode("latin-1"))
    offset = text.index("é")
    assert only_error(capsys, "config", "show", str(path)) == (
        f"palestra config: error: {path}:2: not UTF-8 text (byte 0xe9 at offset {offset}); save the file as UTF-8"
    )


# ---- 2. a key given twice --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("train:\n  lr: 1e-3\n  steps: 5\n  lr: 2e-3\n", "4:3: train.lr: duplicate key (first at line 2)"),
        ("train:\n  steps: 5\nrun:\n  seed: 1\ntrain:\n  lr: 2e-3\n", "5:1: train: duplicate key (first at line 1)"),
        (
            "reward:\n  name: weighted_sum\n  options:\n    components:\n      - {name: format, weight: 0.25}\n"
            "      - {name: correctness, weight: 0.75, weight: 1}\n",
            "6:43: reward.options.components[1].weight: duplicate key (first at line 6)",
        ),
    ],
)
def test_a_duplicate_yaml_key_names_the_key_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str
) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    assert only_error(capsys, "config", "show", str(path)) == (
        f"palestra config: error: {path}:{where}; a key may appear once"
    )


def test_yaml_merge_keys_may_still_be_overridden_and_only_plain_data_is_read(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("train:\n  <<: {steps: 5, lr: 1e-3}\n  steps: 6\n")  # an override of a merged key: not a duplicate
    train = load_config(path).train
    assert (train.steps, train.lr) == (6, 1e-3)
    path.write_text("train: !!python/object/apply:os.getcwd []\n")  # still the safe loader: no arbitrary objects
    with pytest.raises(
        ConfigError, match=r"merge\.yaml:1:8: invalid YAML: could not determine a constructor for the tag"
    ):
        load_config(path)


def test_a_duplicate_key_in_an_override_value_names_the_full_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert only_error(capsys, "config", "show", "train={steps: 1, steps: 2}") == (
        "palestra config: error: override 'train={steps: 1, steps: 2}': train.steps: duplicate key"
    )
    assert only_error(capsys, "config", "show", "reward.options.layers=[{name: format, name: length}]") == (
        "palestra config: error: override 'reward.options.layers=[{name: format, name: length}]': "
        "reward.options.layers[0].name: duplicate key"
    )


# ---- 3. an override without its value --------------------------------------------------------------------
def test_config_show_with_a_key_and_no_value_says_overrides_are_key_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert only_error(capsys, "config", "show", "train.steps") == (
        "palestra config: error: 'train.steps' is not a config file (.yaml, .yml, .toml) and not an override: "
        "overrides are key=value, e.g. train.steps=VALUE"
    )
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 5\n")
    assert only_error(capsys, "config", "show", str(path), "train.steps") == (
        "palestra config: error: override 'train.steps': expected key=value (for example train.lr=3e-4)"
    )
    assert only_error(capsys, "config", "show", str(tmp_path / "missing.yaml")) == (  # still read as a file
        f"palestra config: error: config file '{tmp_path / 'missing.yaml'}' does not exist"
    )


# ---- 4. renaming a component resets its options ----------------------------------------------------------
@dataclass
class ProbeOptions:
    size: int = option(3, ge=1)
    scale: float = 1.0


def probe_registry() -> Registry:
    registry = Registry()
    for reg in get_registry():
        registry.add(reg)
    registry.add(
        Registration("environment", "probe", lambda **kw: kw, ProbeOptions, "test probe", "tests", "palestra-tests")
    )
    return registry


def test_renaming_the_reward_starts_from_the_new_rewards_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    # The built-in reward is `layered` with a list of layers, which `format` does not take.
    code, _out, err = run_cli(capsys, "config", "show", "reward.name=format")
    assert code == 0, err
    cfg = load_config(None, ["reward.name=format"])
    assert cfg.reward.name == "format" and cfg.reward.options == type(cfg.reward.options)()
    # Options given by overrides are the user's own, before the rename or after it.
    for overrides in (
        ["reward.options.pattern=x", "reward.name=format"],
        ["reward.name=format", "reward.options.pattern=x"],
    ):
        assert load_config(None, overrides).reward.options.pattern == "x"
    # The same name again is no rename: the options stay.
    assert (
        load_config(None, ["reward.name=layered"]).reward.options.layers[0].options.pattern
        == "^<answer>-?[0-9]+</answer>$"
    )


def test_renaming_any_component_node_resets_its_options(tmp_path: Path) -> None:
    registry = probe_registry()
    cfg = load_config(None, ["environment.name=probe"], registry=registry)  # arithmetic's difficulty etc. dropped
    assert cfg.environment.options == ProbeOptions()
    cfg = load_config(None, ["environment.options={size: 5}", "environment.name=probe"], registry=registry)
    assert cfg.environment.options == ProbeOptions(size=5)
    # The optimiser: the built-in grpo's entropy_coef=0.05 is not carried over to rloo.
    assert load_config(None, ["optimizer.name=rloo"]).optimizer.options.entropy_coef == 0.0
    # A nested node (a layer of the layered reward) and a node from a file.
    cfg = load_config(None, ["reward.options.layers[0].name=length"])
    assert cfg.reward.options.layers[0].name == "length"
    path = tmp_path / "c.yaml"
    path.write_text("environment:\n  name: arithmetic\n  options: {difficulty: 2}\n")
    assert load_config(path, ["environment.name=probe"], registry=registry).environment.options == ProbeOptions()


# ---- 5. GRPO with groups of one --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "scale"), [("grpo", "group"), ("grpo", "none"), ("grpo", "batch"), ("dr_grpo", "none")]
)
def test_grpo_refuses_group_size_one_at_setup(name: str, scale: str) -> None:
    from palestra.context import TrainContext
    from palestra.engine.learner import Learner

    algorithm = get_registry().get("optimizer", name).factory(scale=scale)
    policy = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError) as info:
        Learner(algorithm, policy, TrainContext.local(TrainConfig(group_size=1, batch_size=2)))
    assert str(info.value) == (
        f"train.group_size: {name}'s group-relative advantages need at least 2 completions per prompt, "
        "got 1 (every advantage would be 0)"
    )
    algorithm = get_registry().get("optimizer", name).factory(scale=scale)
    Learner(
        algorithm, policy, TrainContext.local(TrainConfig(group_size=2, batch_size=2))
    )  # two completions per prompt are enough


def test_train_with_grpo_and_group_size_one_stops_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    assert only_error(capsys, "train", "train.group_size=1", "train.steps=1", f"run.output_dir={runs}") == (
        "palestra train: error: train.group_size: grpo's group-relative advantages need at least 2 completions "
        "per prompt, got 1 (every advantage would be 0)"
    )
    assert not runs.exists()


# ---- 6. doctor on a skipped step -------------------------------------------------------------------------
def doctor_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> tuple[int, dict]:
    code, out, _err = run_cli(
        capsys, "doctor", "--json", "--skip", "versions,kernels,utilisation,data", "train.batch_size=2",
        "train.group_size=2", "train.max_new_tokens=4", "kernels.backend=torch", "loggers=[]",
        f"run.output_dir={tmp_path}",
    )  # fmt: skip
    return code, json.loads(out)


@pytest.mark.usefixtures("one_thread")
def test_doctor_reports_a_step_skipped_for_a_nan_reward_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from palestra.plugins.rewards.basic import FormatReward

    monkeypatch.setattr(
        FormatReward, "__call__", lambda self, prompts, completions, metadata: torch.full((len(completions),), math.nan)
    )
    code, report = doctor_json(capsys, tmp_path)
    assert code == 1 and report["failed"] == ["training/step"]  # one failure, not one per layer
    step, flow = (next(c for c in report["checks"] if c["name"] == name) for name in ("step", "gradient flow"))
    assert step["status"] == "failed"
    assert (
        "; the step was SKIPPED (no update): the reward is not finite (reward 'format' (reward.options.layers[0]): "
        "output row 0 is nan" in step["detail"]
    )
    assert (flow["status"], flow["detail"]) == ("skipped", "not checked: the step was skipped (see training/step)")
    assert not [c for c in report["checks"] if c["name"].startswith("grads/")]


@pytest.mark.usefixtures("one_thread")
def test_doctor_reports_a_step_skipped_for_a_nan_loss_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from palestra.plugins.optimizers.grpo import GRPO

    loss = GRPO.loss
    monkeypatch.setattr(
        GRPO, "loss", lambda self, policy, batch: (lambda out: (out[0] * math.nan, out[1]))(loss(self, policy, batch))
    )
    code, report = doctor_json(capsys, tmp_path)
    assert code == 1 and report["failed"] == ["training/step"]
    step, flow = (next(c for c in report["checks"] if c["name"] == name) for name in ("step", "gradient flow"))
    assert step["detail"].endswith(
        "; the step was SKIPPED (no update): non-finite loss (nan) in pass 0, micro-batch 0 (4 rows)"
    )
    assert step["data"]["skipped_because"] == "non-finite loss (nan) in pass 0, micro-batch 0 (4 rows)"
    assert flow["status"] == "skipped" and flow["detail"].startswith(
        "not checked: the step was skipped (see training/step); NaN/inf gradients in "
    )


# ---- 7. plot on a metrics file with unreadable lines -----------------------------------------------------
@pytest.mark.parametrize(
    ("tail", "why"),
    [
        ('{"step": 3, "x": 3}\n', "skipped 3 unreadable line(s) (first at line 2): 2 not JSON, 1 not a JSON object"),
        (
            '{"step": 3, "x',
            "skipped 4 unreadable line(s) (first at line 2): 2 not JSON, 1 not a JSON object, "
            "the last line is cut short (the run stopped mid-write)",
        ),
        ('{"step": 3, "x\n', "skipped 4 unreadable line(s) (first at line 2): 3 not JSON, 1 not a JSON object"),
    ],
    ids=["complete-last-line", "cut-short-last-line", "broken-last-line-with-newline"],
)
def test_plot_says_how_many_records_it_left_out_and_why(tmp_path: Path, tail: str, why: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "x": 1}\nnot json\n[1, 2]\n\n{"step": 2, "x": 2}\n{"step": 2.5, "x"\n' + tail
    )
    done = subprocess.run(
        [sys.executable, "-m", "palestra", "plot", str(run)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{run / 'dashboard.png'}\n"
    assert done.stderr == f"palestra: warning: {run / 'metrics.jsonl'}: {why}; their records are left out\n"
