"""Fast start: listing plugins and resolving a config import nothing heavy, and loading plugins builds nothing.

``palestra plugins`` and ``palestra config show`` import every plugin module (their ``register_*`` hooks run and
their options dataclasses are registered) but must not import torch, transformers, wandb, tensorboard,
matplotlib or numpy: those belong inside the factories and methods that need them. The import checks run in
fresh interpreters, since this test process has long imported torch (tests/conftest.py does).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import plugin_installs
import pytest

from palestra import cli, plugin_manager
from palestra.config import ComponentBuildError, build_component, load_config

# What a light command must not import. torch drags in numpy; matplotlib is for `palestra plot` and the end of `train`.
HEAVY = ("torch", "transformers", "wandb", "tensorboard", "matplotlib", "numpy", "triton")

# Runs palestra.cli.main(ARGS) and prints, as the last stdout line, the heavy modules it imported. Anything the
# interpreter had already imported before palestra (a sitecustomize, a .pth file) is left out of the count.
_PROBE = textwrap.dedent(
    """
    import json, sys
    heavy = {heavy!r}
    before = {{m for m in heavy if m in sys.modules}}
    import palestra.cli
    rc = palestra.cli.main({args!r})
    print(json.dumps({{"rc": rc, "imported": sorted(m for m in heavy if m in sys.modules and m not in before)}}))
    """
)


def _imported_by(args: list[str], cwd: Path) -> list[str]:
    # No third-party plugins (PALESTRA_LOAD_PLUGINS=""): this is about palestra's own modules.
    result = plugin_installs.run_python(
        ["-c", _PROBE.format(heavy=HEAVY, args=args)], [], cwd, timeout=120, PALESTRA_LOAD_PLUGINS=""
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, result.stderr
    return report["imported"]


@pytest.mark.parametrize(
    "args",
    [["plugins", "--all"], ["plugins", "--all", "--json"], ["config", "show"]],
    ids=["plugins", "plugins-json", "config-show"],
)
def test_light_commands_import_nothing_heavy(args: list[str], tmp_path: Path) -> None:
    imported = _imported_by(args, tmp_path)
    assert imported == [], (
        f"`palestra {' '.join(args)}` imported {imported}; move those imports from the module top level of the "
        "plugin (or palestra module) that pulls them in into the factory or method that needs them "
        "(python -X importtime -m palestra " + " ".join(args) + " shows which)"
    )


# ---- loading plugins calls no factory ----------------------------------------------------------------------
PLUGIN_MODULE = "palestra_lazy_probe_plugin"

_PLUGIN_SOURCE = textwrap.dedent(
    '''
    """A plugin whose factories refuse to run: loading it, listing it and resolving its options must not call them."""
    from dataclasses import dataclass

    from palestra import hookimpl

    HOOK_CALLS = []
    FACTORY_CALLS = []


    class FactoryCalled(RuntimeError):
        pass


    @dataclass
    class ProbeOptions:
        width: int = 3


    def build_probe(**options):
        FACTORY_CALLS.append(options)
        raise FactoryCalled(f"the factory ran with {options}")


    @hookimpl
    def register_policies(register):
        HOOK_CALLS.append("register_policies")
        register("lazy_probe", build_probe, options=ProbeOptions, description="a factory that must not run early")


    @hookimpl
    def register_rewards(register):
        HOOK_CALLS.append("register_rewards")
        register("lazy_probe_reward", build_probe, description="a factory that must not run early")
    '''
)


@pytest.fixture
def probe_site(tmp_path: Path) -> Iterator[Path]:
    """An installed distribution, written by hand (a dist-info folder is all importlib.metadata needs)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{PLUGIN_MODULE}.py").write_text(_PLUGIN_SOURCE)
    info = site / "palestra_lazy_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: palestra-lazy-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[palestra]\nlazy_probe = {PLUGIN_MODULE}\n")
    yield site
    sys.modules.pop(PLUGIN_MODULE, None)


def test_loading_plugins_and_listing_them_calls_no_factory(in_process, probe_site: Path, capsys) -> None:
    in_process.use(probe_site, PALESTRA_LOAD_PLUGINS="palestra-lazy-probe")
    registry = plugin_manager.get_registry()
    probe = sys.modules[PLUGIN_MODULE]  # imported by the plugin manager ...
    assert sorted(probe.HOOK_CALLS) == ["register_policies", "register_rewards"]  # ... its hooks ran ...
    reg = registry.get("policy", "lazy_probe")
    assert reg.options is probe.ProbeOptions and reg.distribution == "palestra-lazy-probe"  # ... options registered ...
    assert probe.FACTORY_CALLS == []  # ... and nothing was built

    assert cli.main(["plugins", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["distribution"] == "palestra-lazy-probe" and row["version"] == "0.1" and row["error"] is None
    assert row["policies"] == ["lazy_probe"] and row["rewards"] == ["lazy_probe_reward"]

    # Resolving a config fills the options in from the dataclass, without building the component.
    config = load_config(None, ["policy.name=lazy_probe", "policy.options.width=5"])
    assert config.policy.name == "lazy_probe" and config.policy.options == probe.ProbeOptions(width=5)
    assert cli.main(["config", "show", "policy.name=lazy_probe"]) == 0
    assert "name: lazy_probe" in capsys.readouterr().out
    assert probe.FACTORY_CALLS == []

    # The factory runs when, and only when, the component is built.
    with pytest.raises(ComponentBuildError, match=re.escape("the factory ran with {'width': 5}")):
        build_component("policy", config.policy, path="policy", registry=registry)
    assert probe.FACTORY_CALLS == [{"width": 5}]


def test_the_builtin_registry_is_built_without_building_components(tmp_path: Path) -> None:
    """Every built-in factory is wrapped to record calls before any plugin registers; building the registry,
    listing it and resolving the default config must record none."""
    source = textwrap.dedent(
        """
        import json, palestra.plugin_manager as pm, palestra.registry as reg_mod
        from palestra.config import load_config
        calls = []
        original_add = reg_mod.Registry.add

        def add(self, reg):
            factory = reg.factory
            def recording(*a, **k):
                calls.append(f"{reg.kind} {reg.name}")
                return factory(*a, **k)
            object.__setattr__(reg, "factory", recording)
            original_add(self, reg)

        reg_mod.Registry.add = add
        registry = pm.get_registry()
        pm.plugin_infos()
        load_config(None, [])
        print(json.dumps({"registered": len(list(registry)), "calls": calls}))
        """
    )
    result = plugin_installs.run_python(["-c", source], [], tmp_path, timeout=120, PALESTRA_LOAD_PLUGINS="")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["registered"] > 10
    assert report["calls"] == []
