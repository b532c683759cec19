"""The versioned plugin API: palestra.PLUGIN_API, a plugin's declared range (PALESTRA_PLUGIN_API), one warning and a
disabled plugin when they do not meet, the range shown by `palestra plugins`, and renamed hooks answering to their old
names for one API version."""

from __future__ import annotations

import json
import warnings

import pytest

import palestra
import plugin_installs
from palestra import cli, hookspecs
from palestra.plugin_manager import PalestraPluginWarning, get_plugin_manager, get_registry, plugin_infos
from palestra.registry import RegistryError

pytestmark = pytest.mark.pip_install


def test_the_plugin_api_is_a_version() -> None:
    from packaging.version import Version

    assert palestra.PLUGIN_API == hookspecs.PLUGIN_API and Version(palestra.PLUGIN_API).major >= 1


def test_a_plugin_built_for_another_api_is_disabled_with_one_warning(in_process, sites) -> None:
    in_process.use(sites["example"], sites["future"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = plugin_infos()
    lines = [str(w.message) for w in caught if issubclass(w.category, PalestraPluginWarning)]
    assert lines == ["plugin distribution 'palestra-future-plugin' failed and is disabled: plugin 'future' supports plugin "
                     "API >=2.0,<3, but this palestra provides plugin API 1.0; install a version of the plugin built for 1.0"]
    future = next(i for i in infos if i.name == "future")
    assert future.error is not None and future.api == ">=2.0,<3"
    assert "keyword_coverage" in get_registry().names("reward")  # everything else keeps working
    with pytest.raises(RegistryError, match="from_the_future"):
        get_registry().get("reward", "from_the_future")


def test_palestra_plugins_shows_the_api_and_each_declared_range(sites, tmp_path) -> None:
    out = plugin_installs.run_palestra(["plugins"], [sites["example"], sites["future"]], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "palestra 0.1.0, plugin API 1.0"
    assert "0.1.0 (API >=1.0,<2)" in out.stdout and "2.0.0 (API >=2.0,<3)" in out.stdout
    assert out.stderr.count("palestra: warning:") == 1 and "plugin API 1.0" in out.stderr
    rows = json.loads(plugin_installs.run_palestra(["plugins", "--json"], [sites["example"]], tmp_path).stdout)
    assert [(r["name"], r["api"], r["plugin_api"]) for r in rows] == [("example", ">=1.0,<2", "1.0")]


def test_an_unreadable_range_disables_the_plugin_in_one_line(in_process, sites, monkeypatch) -> None:
    in_process.use(sites["renamed"])
    import palestra_renamed_plugin

    monkeypatch.setattr(palestra_renamed_plugin, "PALESTRA_PLUGIN_API", "version one")
    monkeypatch.setattr(hookspecs, "RENAMED_HOOKS", {"on_rollout_done": "on_rollout_end"})
    with pytest.warns(PalestraPluginWarning, match=r"declares PALESTRA_PLUGIN_API = 'version one', which is not a version specifier"):
        infos = plugin_infos()
    assert next(i for i in infos if i.name == "renamed").error


def test_a_renamed_hook_keeps_its_old_name_for_one_api_version(in_process, sites, monkeypatch) -> None:
    in_process.use(sites["renamed"])
    monkeypatch.setattr(hookspecs, "RENAMED_HOOKS", {"on_rollout_done": "on_rollout_end"})
    with pytest.warns(DeprecationWarning, match=r"plugin 'renamed' implements 'on_rollout_done', now called 'on_rollout_end'"):
        pm = get_plugin_manager()
    info = next(i for i in plugin_infos() if i.name == "renamed")
    assert info.error is None and info.hooks == ("on_rollout_end",)
    import palestra_renamed_plugin

    pm.hook.on_rollout_end(run=None, batch="batch 7")
    assert palestra_renamed_plugin.CALLS == ["batch 7"]


def test_without_the_rename_an_old_hook_name_is_the_unknown_hook_error(in_process, sites) -> None:
    in_process.use(sites["renamed"])
    assert cli.main(["plugins"]) == 2  # 'on_rollout_done' is no hook of this API: the misspelt-hook error
