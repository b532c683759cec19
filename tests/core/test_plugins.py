"""The plugin manager and ``palestra plugins``, against really installed plugin packages.

The packages (the example plugin and the faulty ones under tests/fixtures/) are pip-installed once per session
into folders outside the venv (see plugin_installs.py). CLI behaviour is checked in subprocesses; library
behaviour in-process, where it is much cheaper (no new interpreter importing torch).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
import json
import subprocess
import sys
import warnings

import plugin_installs
import pytest
import tomllib

from palestra import cli, plugin_manager
from palestra.cli.plugins import PLURALS
from palestra.plugin_manager import BuiltinPluginError, PalestraPluginWarning, PluginError, PluginInfo
from palestra.registry import RegistryError

pip_install = pytest.mark.pip_install


def plugin_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, PalestraPluginWarning)]


def load_recording_warnings() -> tuple[list[PluginInfo], list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        infos = plugin_manager.plugin_infos()
    return infos, plugin_warnings(record)


# ---- built-ins -----------------------------------------------------------------------------------------
def declared_builtins() -> dict[str, str]:
    """pyproject.toml's [project.entry-points.palestra]: entry-point name -> module."""
    return tomllib.loads((plugin_installs.REPO / "pyproject.toml").read_text())["project"]["entry-points"]["palestra"]


# The built-ins load in module order: grouped by kind (the folder), then by name.
BUILTIN_MODULES = sorted(declared_builtins().values())


def test_every_plugin_module_is_an_entry_point_and_the_install_is_current() -> None:
    # A module under plugins/ that implements hooks but is not an entry point would never be loaded.
    plugins = plugin_installs.REPO / "plugins"
    hooked = sorted(
        ".".join(("palestra", *f.relative_to(plugins.parent).with_suffix("").parts)).removesuffix(".__init__")
        for f in plugins.rglob("*.py")
        if "@hookimpl" in f.read_text()
    )
    assert hooked == BUILTIN_MODULES
    installed = metadata.distribution("palestra").entry_points.select(group="palestra")
    assert {ep.name: ep.value for ep in installed} == declared_builtins(), (
        "stale install: run pip install -e . --no-deps"
    )


def test_builtins_load_first_in_module_order_and_are_attributed_to_palestra(in_process) -> None:
    in_process.use()
    infos, warned = load_recording_warnings()
    builtins = [i for i in infos if i.builtin]
    assert [i.module for i in builtins] == BUILTIN_MODULES
    assert [i.name for i in builtins][:3] == ["agents", "arithmetic", "customer_service"]
    assert infos[: len(builtins)] == builtins
    assert {(i.distribution, i.version, i.error) for i in builtins} == {
        ("palestra", metadata.version("palestra"), None)
    }
    for reg in plugin_manager.get_registry():
        if reg.plugin in {i.name for i in builtins}:
            assert reg.distribution == "palestra"
    assert warned == []


def fake_palestra_metadata(tmp_path, entry_points: str) -> metadata.Distribution:
    """An installed palestra's metadata folder (as pip writes it) declaring ``entry_points``."""
    info = tmp_path / "palestra-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: palestra\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return metadata.PathDistribution(info)


@pytest.mark.parametrize(
    ("entry_points", "error"),
    [
        (
            "[palestra]\narithmetic = palestra.plugins.envs.arithmetic\nodd = palestra.cli.plugins\n",
            r"declares entry points outside palestra\.plugins: odd = palestra\.cli\.plugins in the 'palestra' group",
        ),
        ("[console_scripts]\npalestra = palestra.cli:main\n", r"declares no entry points in the 'palestra' group"),
    ],
)
def test_palestra_metadata_without_its_builtins_is_a_hard_error(
    in_process, monkeypatch, tmp_path, entry_points, error
) -> None:
    in_process.use()
    dist = fake_palestra_metadata(tmp_path, entry_points)
    monkeypatch.setattr(plugin_manager.metadata, "distribution", lambda name: dist)
    with pytest.raises(BuiltinPluginError, match=error + r"; reinstall palestra \(pip install -e \.\)$"):
        plugin_manager.get_plugin_manager()


@pip_install
@pytest.mark.slow
def test_builtins_load_from_a_non_editable_install_in_a_folder_of_its_own(tmp_path) -> None:
    # What bench/bitwise_before_after.py does: `pip install --target` (a wheel's metadata, not the editable finder).
    site = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--no-cache-dir",
        "--no-compile",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        str(site),
        str(plugin_installs.REPO),
    ]
    subprocess.run(pip, check=True, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    code = (
        "import json, palestra; from palestra.plugin_manager import plugin_infos; "
        "print(json.dumps([palestra.__file__, [i.module for i in plugin_infos() if i.builtin]]))"
    )
    out = plugin_installs.run_python(["-c", code], [site], tmp_path)
    assert out.returncode == 0, out.stderr
    where, modules = json.loads(out.stdout)
    assert where.startswith(str(site)) and modules == BUILTIN_MODULES


@pip_install
def test_a_builtin_raising_in_a_registration_hook_is_a_hard_error(in_process, sites) -> None:
    # Take the faulty plugin's entry for a built-in's: what differs between the two is only how a failure is treated.
    in_process.use(sites["raising"])
    plugin_manager.get_plugin_manager()
    state = plugin_manager._state
    state.plugins[:] = [dataclasses.replace(i, builtin=True) if i.name == "raising" else i for i in state.plugins]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PalestraPluginWarning)
        with pytest.raises(
            BuiltinPluginError, match="built-in plugin 'raising' failed: RuntimeError: cannot reach the scoring service"
        ):
            plugin_manager.get_registry()
    assert BuiltinPluginError.palestra_user_error is False  # the CLI shows its traceback: palestra itself is broken


# ---- broken third-party plugins ------------------------------------------------------------------------
@pip_install
def test_plugin_that_fails_to_import_is_one_warning_and_the_rest_keeps_working(in_process, sites) -> None:
    in_process.use(sites["example"], sites["broken"])
    infos, warned = load_recording_warnings()
    assert len(warned) == 1, warned
    assert "'palestra-broken-plugin'" in warned[0]
    assert "No module named 'palestra_broken_plugin_missing_dependency'" in warned[0]
    by_name = {i.name: i for i in infos}
    assert by_name["broken"].error is not None and by_name["broken"].distribution == "palestra-broken-plugin"
    assert by_name["example"].error is None
    registry = plugin_manager.get_registry()
    assert registry.get("reward", "keyword_coverage").distribution == "palestra-example-plugin"
    assert [b.distribution for b in registry.broken] == ["palestra-broken-plugin"]


@pip_install
def test_asking_for_what_a_broken_plugin_would_provide_names_the_broken_distribution(in_process, sites) -> None:
    in_process.use(sites["example"], sites["broken"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PalestraPluginWarning)
        registry = plugin_manager.get_registry()
    with pytest.raises(RegistryError) as excinfo:
        registry.get("reward", "broken_reward")
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert "no reward named 'broken_reward'" in msg
    assert "'palestra-broken-plugin' failed to load" in msg and "palestra_broken_plugin_missing_dependency" in msg


@pip_install
def test_plugin_raising_in_a_registration_hook_is_disabled_whole_with_one_warning(in_process, sites) -> None:
    in_process.use(sites["example"], sites["raising"])
    infos, warned = load_recording_warnings()
    assert len(warned) == 1, warned
    assert "'palestra-raising-plugin'" in warned[0] and "cannot reach the scoring service" in warned[0]
    assert "register_rewards" in warned[0]
    registry = plugin_manager.get_registry()
    # It registered an environment and a reward before raising: neither survives.
    assert ("environment", "raising_env") not in registry and ("reward", "raising_reward") not in registry
    assert registry.by_plugin("raising") == []
    assert plugin_manager.get_plugin_manager().get_plugin("raising") is None  # its lifecycle hooks must not run
    assert {i.name: i.error is None for i in infos if not i.builtin} == {"example": True, "raising": False}
    assert next(i for i in infos if i.name == "raising").error.startswith(
        "RuntimeError: cannot reach the scoring service"
    )
    assert registry.get("environment", "word_usage").plugin == "example"
    with pytest.raises(RegistryError, match="palestra-raising-plugin"):
        registry.get("reward", "raising_reward")


@pip_install
def test_misspelt_hook_fails_loudly_naming_plugin_distribution_and_hook(in_process, sites) -> None:
    in_process.use(sites["example"], sites["misspelt"])
    with pytest.raises(PluginError) as excinfo:
        plugin_manager.get_plugin_manager()
    msg = str(excinfo.value)
    assert "plugin 'misspelt' (distribution 'palestra-misspelt-plugin')" in msg
    assert "unknown hook 'register_reward'" in msg and "did you mean 'register_rewards'?" in msg
    assert "\n" not in msg


@pip_install
def test_same_name_registered_twice_fails_naming_both_plugins_and_distributions(in_process, sites) -> None:
    in_process.use(sites["example"], sites["duplicate"])
    with pytest.raises(RegistryError) as excinfo:
        plugin_manager.get_registry()
    msg = str(excinfo.value)
    assert "reward 'keyword_coverage' is registered twice" in msg
    assert "'duplicate' (distribution 'palestra-duplicate-plugin')" in msg
    assert "'example' (distribution 'palestra-example-plugin')" in msg


# ---- PALESTRA_LOAD_PLUGINS / PALESTRA_TRACE_PLUGINS -------------------------------------------------------
@pip_install
def test_load_plugins_empty_loads_no_third_party_plugin_but_every_builtin(in_process, sites) -> None:
    in_process.use(sites["example"], sites["broken"], sites["raising"], PALESTRA_LOAD_PLUGINS="")
    infos, warned = load_recording_warnings()
    assert warned == []
    assert all(i.builtin for i in infos)
    assert [i.module for i in infos] == BUILTIN_MODULES
    assert ("reward", "keyword_coverage") not in plugin_manager.get_registry()


@pip_install
def test_load_plugins_named_loads_only_that_distribution(in_process, sites) -> None:
    # The name is matched after PEP 503 normalisation; the broken ones are installed but not loaded, so no warning.
    in_process.use(
        sites["example"], sites["broken"], sites["raising"], PALESTRA_LOAD_PLUGINS=" Palestra_Example.Plugin "
    )
    infos, warned = load_recording_warnings()
    assert warned == []
    assert [i.distribution for i in infos if not i.builtin] == ["palestra-example-plugin"]
    assert [i.module for i in infos if i.builtin] == BUILTIN_MODULES


@pip_install
def test_load_plugins_naming_an_unknown_distribution_warns(in_process, sites) -> None:
    in_process.use(sites["example"], PALESTRA_LOAD_PLUGINS="palestra-example-plugin,palestra-no-such-plugin")
    infos, warned = load_recording_warnings()
    assert len(warned) == 1 and "'palestra-no-such-plugin'" in warned[0]
    assert [i.name for i in infos if not i.builtin] == ["example"]


@pip_install
def test_trace_plugins_writes_loads_and_hook_calls_to_stderr(in_process, sites, capsys) -> None:
    in_process.use(sites["example"], PALESTRA_TRACE_PLUGINS="1")
    plugin_manager.get_registry()
    pm = plugin_manager.get_plugin_manager()
    pm.hook.on_train_end(run=None)
    out, err = capsys.readouterr()
    assert out == ""
    assert "loaded third-party plugin 'example' from palestra-example-plugin 0.1.0" in err
    assert "call register_rewards -> ['example']" in err
    assert "<register reward for plugin 'example'>" in err
    assert "call on_train_end -> []" in err  # every hook call is traced, not only registration


def test_tracing_is_off_by_default(in_process, capsys) -> None:
    in_process.use()
    plugin_manager.get_registry()
    plugin_manager.get_plugin_manager().hook.on_train_end(run=None)
    assert capsys.readouterr().err == ""


# ---- what register() accepts -------------------------------------------------------------------------------
def test_register_rejects_bad_arguments_naming_the_plugin() -> None:
    info = PluginInfo(name="p", module="m", distribution="d", version="1", builtin=False, hooks=())
    staged: list = []
    register = plugin_manager._Register("reward", info, staged)

    @dataclasses.dataclass
    class Options:
        k: int = 1

    with pytest.raises(ValueError, match="plugin 'p' registering reward 'has space'"):
        register("has space", lambda: None)
    with pytest.raises(TypeError, match="factory must be callable"):
        register("ok", 3)
    with pytest.raises(TypeError, match="options must be a dataclass type"):
        register("ok", lambda: None, options=Options())  # an instance, not the type
    register("ok", lambda k: k, options=Options, description="fine")
    assert [(r.kind, r.name, r.options, r.plugin, r.distribution) for r in staged] == [
        ("reward", "ok", Options, "p", "d")
    ]
    register.closed = True
    with pytest.raises(RuntimeError, match="after register_rewards returned"):
        register("late", lambda: None)


# ---- palestra plugins -----------------------------------------------------------------------------------
@pip_install
def test_cli_plugins_all_json_lists_builtins_and_the_example(in_process, sites, tmp_path) -> None:
    result = plugin_installs.plugins_all_json(sites, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    rows = json.loads(result.stdout)
    builtins = [r for r in rows if r["builtin"]]
    assert [r["module"] for r in builtins] == BUILTIN_MODULES
    assert all(r["distribution"] == "palestra" and r["error"] is None for r in builtins)
    # What each built-in registered, as this process's registry has it.
    in_process.use(PALESTRA_LOAD_PLUGINS="")
    registry = plugin_manager.get_registry()
    expected = {(reg.plugin, PLURALS[reg.kind], reg.name) for reg in registry}
    listed = {(r["name"], plural, name) for r in builtins for plural in PLURALS.values() for name in r[plural]}
    assert listed == expected and listed
    (example,) = [r for r in rows if not r["builtin"]]
    assert example["name"] == "example" and example["version"] == "0.1.0"
    assert example["rewards"] == ["keyword_coverage"] and example["environments"] == ["word_usage"]


@pip_install
@pytest.mark.slow
def test_cli_plugins_with_broken_plugins_still_works_and_warns_once_each(sites, tmp_path) -> None:
    result = plugin_installs.run_palestra(
        ["plugins", "--json"], [sites["example"], sites["broken"], sites["raising"]], tmp_path
    )
    assert result.returncode == 0, result.stderr
    warning_lines = [line for line in result.stderr.splitlines() if line]
    assert len(warning_lines) == 2, result.stderr
    assert sum("'palestra-broken-plugin'" in line for line in warning_lines) == 1
    assert sum("'palestra-raising-plugin'" in line for line in warning_lines) == 1
    assert all(line.startswith("palestra: warning: plugin distribution") for line in warning_lines)
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {"broken", "example", "raising"}  # no built-ins without --all
    assert "palestra_broken_plugin_missing_dependency" in rows["broken"]["error"]
    assert rows["example"]["error"] is None and rows["example"]["rewards"] == ["keyword_coverage"]
    assert rows["raising"]["rewards"] == [] and "cannot reach the scoring service" in rows["raising"]["error"]


@pip_install
@pytest.mark.slow
def test_cli_plugins_with_a_misspelt_hook_exits_2_with_one_line(sites, tmp_path) -> None:
    result = plugin_installs.run_palestra(["plugins"], [sites["example"], sites["misspelt"]], tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        "palestra plugins: error: plugin 'misspelt' (distribution 'palestra-misspelt-plugin')"
    )
    assert "'register_reward'" in result.stderr


@pip_install
def test_cli_plugins_table(in_process, sites, capsys) -> None:
    in_process.use(sites["example"], sites["broken"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PalestraPluginWarning)
        assert cli.main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines.pop(0) == "palestra 0.1.0, plugin API 2.2"
    assert lines[0].split() == ["PLUGIN", "DISTRIBUTION", "VERSION", "HOOKS", "REGISTERS"]
    assert lines[1].split()[:4] == ["broken", "palestra-broken-plugin", "0.0.1", "-"]
    assert "FAILED: ModuleNotFoundError" in lines[1]
    assert lines[2].split() == [
        "example",
        "palestra-example-plugin",
        "0.1.0",
        "(API",
        ">=2.0,<3)",
        "register_environments",
        "environments:",
        "word_usage",
    ]
    assert lines[3].split() == ["register_rewards", "rewards:", "keyword_coverage"]
    assert len(lines) == 4  # built-ins only with --all


@pip_install
def test_cli_plugins_duplicate_exits_2_naming_both(in_process, sites, capsys) -> None:
    in_process.use(sites["example"], sites["duplicate"])
    assert cli.main(["plugins", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("palestra plugins: error: reward 'keyword_coverage' is registered twice")
    assert "palestra-duplicate-plugin" in err and "palestra-example-plugin" in err


def test_cli_plugins_without_third_party_plugins(in_process, capsys) -> None:
    in_process.use(PALESTRA_LOAD_PLUGINS="")
    assert cli.main(["plugins"]) == 0
    assert "No third-party plugins" in capsys.readouterr().out
    assert cli.main(["plugins", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
