"""The versioned plugin API: palestra.PLUGIN_API, a plugin's declared range (PALESTRA_PLUGIN_API), one warning and a
disabled plugin when they do not meet, the range shown by `palestra plugins`, and what `palestra` exports."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import plugin_installs
import pytest

import palestra
from palestra import hookspecs
from palestra.plugin_manager import PalestraPluginWarning, get_registry, plugin_infos
from palestra.registry import RegistryError

pip_install = pytest.mark.pip_install


def test_the_plugin_api_is_a_version() -> None:
    from packaging.version import Version

    assert palestra.PLUGIN_API == hookspecs.PLUGIN_API and Version(palestra.PLUGIN_API) == Version("2.2")


@pip_install
@pytest.mark.parametrize(
    "declared", [">=3.0,<4", ">=1.0,<2"]
)  # the fixture's own, and one written for API 1 (before 2.0)
def test_a_plugin_built_for_another_api_is_disabled_with_one_warning(in_process, sites, monkeypatch, declared) -> None:
    in_process.use(sites["example"], sites["future"])
    import palestra_future_plugin

    monkeypatch.setattr(palestra_future_plugin, "PALESTRA_PLUGIN_API", declared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = plugin_infos()
    lines = [str(w.message) for w in caught if issubclass(w.category, PalestraPluginWarning)]
    assert lines == [
        f"plugin distribution 'palestra-future-plugin' failed and is disabled: plugin 'future' supports plugin "
        f"API {declared}, but this palestra provides plugin API 2.2; install a version of the plugin built for 2.2"
    ]
    future = next(i for i in infos if i.name == "future")
    assert future.error is not None and future.api == declared
    assert "keyword_coverage" in get_registry().names("reward")  # everything else keeps working
    with pytest.raises(RegistryError, match="from_the_future"):
        get_registry().get("reward", "from_the_future")


@pip_install
def test_palestra_plugins_shows_the_api_and_each_declared_range(sites, tmp_path) -> None:
    out = plugin_installs.run_palestra(["plugins"], [sites["example"], sites["future"]], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "palestra 0.1.0, plugin API 2.2"
    assert "0.1.0 (API >=2.0,<3)" in out.stdout and "3.0.0 (API >=3.0,<4)" in out.stdout
    assert out.stderr.count("palestra: warning:") == 1 and "plugin API 2.2" in out.stderr
    rows = json.loads(plugin_installs.run_palestra(["plugins", "--json"], [sites["example"]], tmp_path).stdout)
    assert [(r["name"], r["api"], r["plugin_api"]) for r in rows] == [("example", ">=2.0,<3", "2.2")]


@pip_install
def test_an_unreadable_range_disables_the_plugin_in_one_line(in_process, sites, monkeypatch) -> None:
    in_process.use(sites["future"])
    import palestra_future_plugin

    monkeypatch.setattr(palestra_future_plugin, "PALESTRA_PLUGIN_API", "version one")
    with pytest.warns(
        PalestraPluginWarning,
        match=r"declares PALESTRA_PLUGIN_API = 'version one', which is not a version "
        r"specifier \(write e\.g\. '>=2\.0,<3'\)$",
    ):
        infos = plugin_infos()
    assert next(i for i in infos if i.name == "future").error


def test_palestra_exports_the_plugin_api_without_importing_torch() -> None:
    code = (
        "import sys, palestra; names = [n for n in palestra.__all__ if n not in ('Algorithm', 'AlgorithmOptions', "
        "'ParamGroup', 'CausalLMPolicy', 'TokenScores', 'TrainContext')]; [getattr(palestra, n) for n in names]; "
        "print('torch' in sys.modules, palestra.PLUGIN_API)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", palestra.PLUGIN_API]
    for name in palestra.__all__:
        assert getattr(palestra, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'Algorithmm'"):
        palestra.Algorithmm  # noqa: B018


def test_the_removed_shims_are_gone() -> None:
    # Plugin API 2.0 dropped the old flat module paths and the renamed-hook adapter (docs/plugins.md).
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("palestra.algorithm")
    assert not hasattr(hookspecs, "RENAMED_HOOKS")
