"""``palestra new plugin NAME``: the package it writes installs, passes its own contract tests and trains; a NAME that
cannot be used is one line.

The full round trip runs real subprocesses: the command, ``pip install --target`` into a temporary folder (as
``plugin_installs`` does for the test plugins), ``python -m pytest`` in the generated package, and
``python -m palestra train`` for 5 steps with every generated component.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import plugin_installs
import pytest

from palestra.cli import main
from palestra.cli.new import SCAFFOLDS, render

ALL_KINDS = ",".join(SCAFFOLDS)


def only_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line ``palestra ARGV`` prints on stderr, having exited 2 and written nothing to stdout."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# ---- the round trip ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.pip_install
def test_a_generated_plugin_installs_passes_its_tests_and_trains(tmp_path: Path) -> None:
    made = plugin_installs.run_palestra(
        ["new", "plugin", "shout", "--kinds", ALL_KINDS, "--dir", str(tmp_path / "src")], [], tmp_path
    )
    assert made.returncode == 0, made.stderr
    package = tmp_path / "src" / "shout"
    assert (package / "pyproject.toml").is_file() and f"wrote {package}/" in made.stdout

    site = tmp_path / "site"
    install = plugin_installs.run_python(
        ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir", "--no-compile",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(package)], [], tmp_path)  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr

    # Its own tests, as its author would run them; the palestra_contract fixture comes from palestra's pytest plugin.
    tested = plugin_installs.run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider"], [site], package, OMP_NUM_THREADS="1", PALESTRA_KERNELS="torch"
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert f"{len(SCAFFOLDS) + 1} passed" in tested.stdout, tested.stdout

    runs = tmp_path / "runs"
    trained = plugin_installs.run_palestra(
        ["train", "environment.name=shout", "reward.name=shout", "optimizer.name=shout", "policy.name=shout",
         "loggers=[{name: shout}, {name: jsonl}]", "train.steps=5", "train.batch_size=2", "train.group_size=2",
         "train.max_new_tokens=4", "train.eval_size=2", "kernels.backend=torch", f"run.output_dir={runs}",
         "run.name=shout"],
        [site], tmp_path, OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert (
        "trained 5 steps" in trained.stdout and "reward: shout" in trained.stdout and "policy: shout" in trained.stdout
    )
    lines = [json.loads(line) for line in (runs / "shout" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "reward/mean" in line] == [1, 2, 3, 4, 5]
    logged = (runs / "shout" / "shout.tsv").read_text().splitlines()  # the generated logger wrote its file too
    assert {line.split("\t")[0] for line in logged} >= {"1", "5"} and any("\treward/mean\t" in line for line in logged)


# ---- what it writes -------------------------------------------------------------------------------------------
def test_the_default_kinds_are_a_reward_and_an_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["new", "plugin", "echo_task", "--dir", str(tmp_path)]) == 0
    package = tmp_path / "echo_task"
    written = sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file())
    assert written == ["README.md", "echo_task/__init__.py", "echo_task/environment.py", "echo_task/reward.py",
                       "pyproject.toml", "tests/test_contract.py"]  # fmt: skip
    module = ast.parse((package / "echo_task" / "__init__.py").read_text())
    hooks = [f.name for f in module.body if isinstance(f, ast.FunctionDef)]
    assert hooks == ["register_environments", "register_rewards"]
    pyproject = (package / "pyproject.toml").read_text()
    assert '[project.entry-points.palestra]\necho_task = "echo_task"' in pyproject and 'name = "echo-task"' in pyproject
    test = (package / "tests" / "test_contract.py").read_text()
    assert 'palestra_contract("reward", "echo_task", environment="echo_task")' in test
    assert 'palestra_contract("environment", "echo_task")' in test
    assert "echo_task/reward.py" in capsys.readouterr().out


@pytest.mark.parametrize("kind", list(SCAFFOLDS))
def test_each_kind_alone_renders_valid_python_with_one_hook(kind: str) -> None:
    files = render("solo", [kind])
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")
    module = ast.parse(files["solo/__init__.py"])
    assert [f.name for f in module.body if isinstance(f, ast.FunctionDef)] == [SCAFFOLDS[kind].hook]
    assert all(f"solo/{m}.py" in files for m, _ in SCAFFOLDS[kind].modules)


def test_loading_the_generated_plugin_and_registering_its_components_does_not_import_torch(tmp_path: Path) -> None:
    for path, text in render("light", list(SCAFFOLDS)).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    hooks = "; ".join(f"light.{s.hook}(lambda *a, **k: None)" for s in SCAFFOLDS.values())
    code = f"import sys, light; {hooks}; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    result = plugin_installs.run_python(["-c", code], [tmp_path], tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# ---- NAME is a distribution name ----------------------------------------------------------------------------
@pytest.mark.pip_install
def test_a_distribution_name_gives_its_module_and_the_package_installs_and_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tomllib

    assert main(["new", "plugin", "palestra-foo", "--kinds", "reward", "--dir", str(tmp_path / "src")]) == 0
    out = capsys.readouterr().out
    assert "distribution 'palestra-foo' (pip's name for it), module 'palestra_foo' (its import name)" in out
    package = tmp_path / "src" / "palestra-foo"
    pyproject = tomllib.loads((package / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["name"] == "palestra-foo"
    assert pyproject["project"]["entry-points"]["palestra"] == {"palestra_foo": "palestra_foo"}
    assert (package / "palestra_foo" / "reward.py").is_file()

    site = tmp_path / "site"
    install = plugin_installs.run_python(
        ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir", "--no-compile",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(package)], [], tmp_path)  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    listed = plugin_installs.run_palestra(["plugins", "--json"], [site], tmp_path)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["name"], row["distribution"], row["module"], row["rewards"], row["error"]) == (
        "palestra_foo",
        "palestra-foo",
        "palestra_foo",
        ["palestra_foo"],
        None,
    )


def test_every_accepted_name_writes_a_pyproject_that_parses(tmp_path: Path) -> None:
    import tomllib

    for name in ("echo_task", "palestra-foo", "Palestra.Bar", "x"):
        assert main(["new", "plugin", name, "--kinds", "logger", "--dir", str(tmp_path)]) == 0
        pyproject = tomllib.loads((tmp_path / name / "pyproject.toml").read_text(encoding="utf-8"))
        module = pyproject["tool"]["setuptools"]["packages"][0]
        assert (tmp_path / name / module / "__init__.py").is_file() and module.isidentifier()
    assert (
        tomllib.loads((tmp_path / "Palestra.Bar" / "pyproject.toml").read_text())["project"]["name"] == "palestra-bar"
    )


# ---- NAME mistakes are one line ----------------------------------------------------------------------------
def test_a_name_that_is_not_a_distribution_name_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert only_error(capsys, "new", "plugin", "ünï", "--dir", str(tmp_path)) == (
        "palestra new: error: NAME 'ünï' is not a distribution name (ASCII letters and digits, with '-', '_' or '.' "
        "between them); try 'uni'"
    )
    assert only_error(capsys, "new", "plugin", "my plugin!", "--dir", str(tmp_path)) == (
        "palestra new: error: NAME 'my plugin!' is not a distribution name (ASCII letters and digits, with '-', "
        "'_' or '.' between them); try 'my-plugin'"
    )
    assert only_error(capsys, "new", "plugin", "class", "--dir", str(tmp_path)) == (
        "palestra new: error: NAME 'class': its module name 'class' is a Python keyword; pick another name"
    )
    assert only_error(capsys, "new", "plugin", "3d-reward", "--dir", str(tmp_path)) == (
        "palestra new: error: NAME '3d-reward': its module name '3d_reward' would start with a digit; pick another name"
    )
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_name_that_exists_already_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").mkdir()
    assert only_error(capsys, "new", "plugin", "taken", "--dir", str(tmp_path)) == (
        f"palestra new: error: NAME 'taken': {tmp_path / 'taken'} already exists; pick another name or --dir"
    )
    error = only_error(capsys, "new", "plugin", "json", "--dir", str(tmp_path))
    assert error.startswith(
        "palestra new: error: NAME 'json': a module of that name already exists ("
    ) and error.endswith("); pick another name")
    assert only_error(capsys, "new", "plugin", "format", "--kinds", "reward", "--dir", str(tmp_path)) == (
        "palestra new: error: NAME 'format': reward 'format' is already registered by plugin 'basic_rewards' "
        "(distribution 'palestra'); pick another name"
    )
    assert (
        main(["new", "plugin", "format", "--kinds", "logger", "--dir", str(tmp_path)]) == 0
    )  # no logger is called that
    assert sorted(p.name for p in tmp_path.iterdir()) == ["format", "taken"]


def test_unknown_kinds_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert only_error(capsys, "new", "plugin", "fresh", "--kinds", "reward,rewards", "--dir", str(tmp_path)) == (
        "palestra new: error: --kinds: unknown kind 'rewards'; did you mean 'reward'?"
    )
    assert only_error(capsys, "new", "plugin", "fresh", "--kinds", ",", "--dir", str(tmp_path)) == (
        f"palestra new: error: --kinds: name at least one kind ({', '.join(SCAFFOLDS)})"
    )
    assert not any(tmp_path.iterdir())


def test_the_command_is_listed_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "new" in capsys.readouterr().out


# ---- a tool plugin --------------------------------------------------------------------------------------------
@pytest.mark.pip_install
def test_a_generated_tool_plugin_installs_is_listed_and_passes_its_own_contract_test(tmp_path: Path) -> None:
    pytest.importorskip("transformers")  # Tool.from_function derives the tool's schema through it
    assert main(["new", "plugin", "letters", "--kinds", "tool", "--dir", str(tmp_path / "src")]) == 0
    package = tmp_path / "src" / "letters"
    assert "'tools.tools=[{name: letters}]'" in (package / "README.md").read_text()
    site = tmp_path / "site"
    install = plugin_installs.run_python(
        ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir", "--no-compile",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(package)], [], tmp_path)  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr

    listed = plugin_installs.run_palestra(["plugins"], [site], tmp_path)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert listed.stdout.splitlines()[-1].split() == ["letters", "letters", "0.1.0", "(API", ">=2.0,<3)",
                                                      "register_tools", "tools:", "letters"]  # fmt: skip
    tested = plugin_installs.run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider"], [site], package,
                                        OMP_NUM_THREADS="1")  # fmt: skip
    assert tested.returncode == 0 and "2 passed" in tested.stdout, tested.stdout + tested.stderr

    # The generated test can fail: a tool that miscounts still runs, but one that raises on the example is caught.
    tool = package / "letters" / "tool.py"  # python -m pytest imports the source copy (its folder is first on the path)
    tool.write_text(tool.read_text().replace("return word.count(letter)", "raise RuntimeError('no dictionary')"))
    broken = plugin_installs.run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider"], [site], package,
                                        OMP_NUM_THREADS="1")  # fmt: skip
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert (
        'tool \'letters\'.fn: rule \'examples run\': tool \'letters\' on {"word": "strawberry", "letter": "r"} '
        "raised RuntimeError: no dictionary" in broken.stdout
    ), broken.stdout
