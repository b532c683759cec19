"""Plugins and inputs that used to end a command badly, each now one clear line (issue 23).

Third-party plugins that call ``sys.exit()`` (at import, in a registration hook, in a lifecycle hook), print while
loading, or take seconds to import are real packages, pip-installed into folders of their own (as
``plugin_installs`` does for the fixtures) and run by real ``python -m palestra`` processes. ``palestra new plugin``
writes onto a real file and a real read-only mount; the hf policy reads a real model folder without tokenizer files
and a real GGUF file cut in half.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import plugin_installs
import pytest
import train_processes
import yaml

from palestra.plugin_manager import SLOW_PLUGIN_S

pip_install = pytest.mark.pip_install

# distribution -> (module, its source); each is installed alone, into site-<distribution>
PLUGINS = {
    "palestra-exits": ("exits_plugin", "import sys\n\nsys.exit(3)\n"),
    "palestra-hook-exits": (
        "hook_exits_plugin",
        "import sys\n\nfrom palestra import hookimpl\n\n\n@hookimpl\ndef register_rewards(register):\n"
        "    register('hook_exits_reward', lambda: None)\n    sys.exit(3)\n",
    ),
    "palestra-step-exits": (  # slow to start training, then exits at step 1
        "step_exits_plugin",
        "import sys\nimport time\n\nfrom palestra import hookimpl\n\n\n@hookimpl\ndef on_train_start(run):\n"
        f"    time.sleep({SLOW_PLUGIN_S + 2})\n\n\n@hookimpl\ndef on_step_start(run):\n"
        "    if run.step >= 1:\n        sys.exit(3)\n",
    ),
    "palestra-loud": (
        "loud_plugin",
        "print('loud_plugin: hello at import')\n\nfrom palestra import hookimpl\n\n\n@hookimpl\n"
        "def register_rewards(register):\n    print('loud_plugin: registering')\n"
        "    register('loud_reward', lambda: None)\n",
    ),
    # asleep well past SLOW_PLUGIN_S, so the line is due even on a loaded machine, and not much longer
    "palestra-slow": ("slow_plugin", f"import time\n\ntime.sleep({SLOW_PLUGIN_S + 2})\n"),
}
PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.0.1"

[project.entry-points.palestra]
{module} = "{module}"

[tool.setuptools]
packages = ["{module}"]
"""


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every plugin above pip-installed (in parallel) into its own folder: distribution -> folder."""
    base = tmp_path_factory.mktemp("exit-plugins")
    procs = {}
    for dist, (module, source) in PLUGINS.items():
        package = base / "src" / dist
        (package / module).mkdir(parents=True)
        (package / "pyproject.toml").write_text(PYPROJECT.format(dist=dist, module=module))
        (package / module / "__init__.py").write_text(source)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
               "--no-cache-dir", "--no-compile", "--disable-pip-version-check", "--quiet",
               "--target", str(base / f"site-{dist}"), str(package)]  # fmt: skip
        procs[dist] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=base)
    for dist, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"pip install of {dist} failed:\n{out}"
    return {dist: base / f"site-{dist}" for dist in PLUGINS}


def palestra(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return plugin_installs.run_palestra(args, [site], cwd, timeout=120)


# ---- sys.exit() in a plugin ----------------------------------------------------------------------------------
@pip_install
@pytest.mark.parametrize(
    ("dist", "error"),
    [
        ("palestra-exits", "module exits_plugin called sys.exit(3) (while loading)"),
        ("palestra-hook-exits", "module hook_exits_plugin called sys.exit(3) (in register_rewards)"),
    ],
)
def test_a_plugin_calling_sys_exit_is_disabled_in_one_line_and_commands_still_work(
    sites: dict[str, Path], tmp_path: Path, dist: str, error: str
) -> None:
    listed = palestra(["plugins", "--json"], sites[dist], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr.splitlines() == [
        f"palestra: warning: plugin distribution {dist!r} failed and is disabled: {error}"
    ]
    [row] = json.loads(listed.stdout)
    assert (row["distribution"], row["error"]) == (dist, error)

    shown = palestra(["config", "show"], sites[dist], tmp_path)  # a command that does not need it works
    assert shown.returncode == 0 and yaml.safe_load(shown.stdout)["run"]["name"], shown.stderr
    # asking for what it would have provided names it, as for any broken plugin
    asked = palestra(["config", "show", "reward.name=hook_exits_reward"], sites[dist], tmp_path)
    assert asked.returncode == 2
    assert (
        f"plugin {dist!r} failed to load, so anything it provides is missing: {error}" in asked.stderr.splitlines()[-1]
    )


@pip_install
@pytest.mark.slow
def test_a_lifecycle_hook_slow_is_named_and_calling_sys_exit_stops_the_run_in_one_line(
    sites: dict[str, Path], tmp_path: Path
) -> None:
    config = train_processes.write_config(
        tmp_path,
        {"run": {"name": "exits", "seed": 0, "output_dir": str(tmp_path / "runs")},
         "train": {"steps": 4, "batch_size": 2, "group_size": 2, "eval_size": 2, "max_new_tokens": 6}},
    )  # fmt: skip
    result = train_processes.palestra(["--config", str(config)], tmp_path, site=sites["palestra-step-exits"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    slow = "palestra: still running on_train_start of plugin 'palestra-step-exits' (module step_exits_plugin) after"
    assert lines[0] == f"{slow} {SLOW_PLUGIN_S:g} s"  # the slow hook is named, and waited for
    assert "step 1/4" in result.stderr  # the console's progress lines, then the one error line
    assert result.stderr.strip().splitlines()[-1] == (
        "palestra train: error: plugin 'palestra-step-exits' (module step_exits_plugin) called sys.exit(3) in "
        "on_step_start; the run stops here"
    )


# ---- a plugin that prints while loading ------------------------------------------------------------------------
@pip_install
def test_what_a_plugin_prints_while_loading_goes_to_stderr_and_stdout_stays_the_answer(
    sites: dict[str, Path], tmp_path: Path
) -> None:
    listed = palestra(["plugins", "--json"], sites["palestra-loud"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)  # the whole of stdout is the JSON
    assert (row["name"], row["rewards"], row["error"]) == ("loud_plugin", ["loud_reward"], None)
    assert listed.stderr.splitlines() == ["loud_plugin: hello at import", "loud_plugin: registering"]
    piped = subprocess.run(
        [sys.executable, "-m", "json.tool"], input=listed.stdout, capture_output=True, text=True, check=False
    )
    assert piped.returncode == 0, piped.stderr

    shown = palestra(["config", "show", "train.steps=7"], sites["palestra-loud"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["train"]["steps"] == 7 and "loud_plugin" not in shown.stdout
    assert "loud_plugin: hello at import" in shown.stderr


# ---- a slow plugin -----------------------------------------------------------------------------------------
@pip_install
@pytest.mark.slow
def test_a_plugin_slow_to_import_is_named_on_stderr_and_waited_for(sites: dict[str, Path], tmp_path: Path) -> None:
    listed = palestra(["plugins", "--json"], sites["palestra-slow"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr.splitlines() == [
        f"palestra: still loading plugin 'palestra-slow' (module slow_plugin) after {SLOW_PLUGIN_S:g} s"
    ]
    [row] = json.loads(listed.stdout)  # it was not killed: it loaded, late
    assert (row["distribution"], row["error"]) == ("palestra-slow", None)


# ---- palestra new plugin --dir somewhere it cannot write ---------------------------------------------------------
def run_new(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return plugin_installs.run_palestra(["new", "plugin", *args], [], cwd, timeout=120)


def test_new_plugin_into_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("mine\n")
    for where, answer in [
        ("afile", "--dir 'afile' is not a folder; name the folder to create the package in"),
        ("afile/sub", "--dir 'afile/sub': cannot write the package there (Not a directory)"),
    ]:
        result = run_new(["fresh", "--dir", where], tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert train_processes.error_line(result) == f"palestra new: error: {answer}"
    assert (tmp_path / "afile").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _read_only_mount(folder: Path) -> list[str] | None:
    """The command prefix under which ``folder`` is a real read-only tmpfs: [] when it was mounted here (as root),
    ``unshare -Urm sh -c 'mount ...; exec "$@"' -`` when only a user namespace may mount, None when neither can."""
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(folder)]
    if subprocess.run(mount, capture_output=True, check=False).returncode == 0:
        return []
    prefix = ["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs '{folder}' && exec \"$@\"", "-"]
    if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True, check=False).returncode == 0:
        return prefix
    return None


def test_new_plugin_into_a_read_only_folder_is_one_line(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    prefix = _read_only_mount(ro)
    if prefix is None:
        pytest.skip("cannot mount a read-only tmpfs here: mount needs root, and unshare -Urm is not permitted")
    try:
        for where in ("ro", "ro/deeper"):
            cmd = [*prefix, sys.executable, "-m", "palestra", "new", "plugin", "fresh", "--dir", where]
            env = train_processes.clean_env()
            result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
            assert result.returncode == 2 and result.stdout == "", result.stderr
            assert train_processes.error_line(result) == (
                f"palestra new: error: --dir '{where}': cannot write the package there (Read-only file system)"
            )
        assert not any(ro.iterdir())
    finally:
        if prefix == []:
            subprocess.run(["umount", str(ro)], check=True)


# ---- the hf policy: a model folder without its tokenizer, a truncated GGUF -------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A folder with a model's config and weights but no tokenizer files, and a GGUF file cut in two ways."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import tiny_gguf

    root = tmp_path_factory.mktemp("models")
    gguf_path, hf_dir = tiny_gguf.build_llama_gguf(root)
    bare = root / "no-tokenizer"  # a transformers folder with its config and weights but no tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dir / name, bare / name)
    whole = gguf_path.read_bytes()
    cut = root / "cut"
    cut.mkdir()
    (cut / "half.gguf").write_bytes(whole[: len(whole) // 2])  # the tensors are cut; the header is whole
    (cut / "head.gguf").write_bytes(whole[:1000])  # cut inside the header (its tokenizer keys)
    return {"bare": bare, "cut": cut, "whole_size": len(whole)}


NO_TOKENIZER = (
    "holds no tokenizer files (none of tokenizer.json, tokenizer.model, spiece.model, vocab.json + merges.txt, "
    "vocab.txt); copy them next to the model, or set policy.options.tokenizer_path to a folder holding them"
)


def build_hf(options: dict[str, str]) -> str:
    from palestra.config import ConfigError, build_component

    with pytest.raises(ConfigError) as caught:
        build_component("policy", {"name": "hf", "options": options}, path="policy")
    return str(caught.value)


@pytest.mark.usefixtures("one_thread")
def test_a_model_folder_without_tokenizer_files_names_them(models: dict[str, Any]) -> None:
    bare = str(models["bare"])
    assert build_hf({"path": bare}) == f"policy.options.path: {bare!r} {NO_TOKENIZER}"
    assert build_hf({"path": bare, "tokenizer_path": bare}) == (
        f"policy.options.tokenizer_path: {bare!r} holds no tokenizer files (none of tokenizer.json, tokenizer.model, "
        "spiece.model, vocab.json + merges.txt, vocab.txt); name a folder that holds them"
    )


@pytest.mark.usefixtures("one_thread")
def test_a_truncated_gguf_says_it_is_truncated(models: dict[str, Any]) -> None:
    cut, whole = models["cut"], models["whole_size"]
    half = cut / "half.gguf"
    assert build_hf({"path": str(cut), "gguf_file": "half.gguf"}) == (
        f"policy.options.gguf_file: {str(half)!r} is truncated: it is {whole // 2} bytes, but its header lists "
        f"tensors up to byte {whole}; download or copy it again"
    )
    head = cut / "head.gguf"
    assert build_hf({"path": str(cut), "gguf_file": "head.gguf"}) == (
        f"policy.options.gguf_file: {str(head)!r} is truncated: it is 1000 bytes and ends inside its own header; "
        "download or copy it again"
    )


@pytest.mark.slow
def test_train_with_a_broken_model_is_one_line_exit_2(models: dict[str, Any], tmp_path: Path) -> None:
    half = models["cut"] / "half.gguf"
    for options, answer in [
        ({"path": str(models["bare"])}, f"policy.options.path: {str(models['bare'])!r} {NO_TOKENIZER}"),
        (
            {"path": str(models["cut"]), "gguf_file": "half.gguf"},
            f"policy.options.gguf_file: {str(half)!r} is truncated",
        ),
    ]:
        config = train_processes.write_config(
            tmp_path,
            {"run": {"name": "hf", "seed": 0, "output_dir": str(tmp_path / "runs")},
             "policy": {"name": "hf", "options": options},
             "train": {"steps": 2, "batch_size": 2, "group_size": 2, "eval_size": 2, "max_new_tokens": 4}},
        )  # fmt: skip
        result = train_processes.palestra(["--config", str(config)], tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        assert train_processes.error_line(result).startswith(f"palestra train: error: {answer}")
