"""Real pip installs of the example plugin and the faulty test plugins, each into its own folder, outside the venv.

Each package is copied first (a setuptools build writes ``build/`` and ``*.egg-info`` next to its sources) and then
installed with ``pip install --no-deps --no-build-isolation --target <folder>``, which leaves the venv alone.
A test puts the folders it wants on ``PYTHONPATH`` (subprocess) or ``sys.path`` (in-process), so every test
chooses exactly which plugins are installed. The installs run in parallel, once per test session.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {
    "example": REPO / "examples" / "palestra-example-plugin",
    "broken": REPO / "tests" / "fixtures" / "broken_plugin",  # import raises
    "raising": REPO / "tests" / "fixtures" / "raising_plugin",  # register_rewards raises
    "misspelt": REPO / "tests" / "fixtures" / "misspelt_plugin",  # implements register_reward
    "duplicate": REPO / "tests" / "fixtures" / "duplicate_plugin",  # registers the example's reward name again
    "fault": REPO / "tests" / "fixtures" / "fault_plugin",  # test-only fault injection through the lifecycle hooks
    "future": REPO / "tests" / "fixtures" / "future_plugin",  # declares plugin API 3.x only
}
# The import names the packages install, so in-process tests can forget them afterwards.
MODULES = (
    "palestra_example",
    "palestra_broken_plugin",
    "palestra_raising_plugin",
    "palestra_misspelt_plugin",
    "palestra_duplicate_plugin",
    "palestra_fault_plugin",
    "palestra_future_plugin",
)
ENV_VARS = ("PALESTRA_LOAD_PLUGINS", "PALESTRA_TRACE_PLUGINS")

_sites: dict[str, Path] | None = None


def install_all(base: Path) -> dict[str, Path]:
    """Install every package (once per session); returns package key -> the folder it is installed in."""
    global _sites
    if _sites is not None:
        return _sites
    procs = {}
    for key, source in PACKAGES.items():
        copy = base / "src" / key
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        cmd = [
            sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
            "--no-cache-dir", "--no-compile", "--disable-pip-version-check", "--quiet",
            "--target", str(base / f"site-{key}"), str(copy),
        ]  # fmt: skip
        procs[key] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=base)
    for key, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"pip install of {PACKAGES[key]} failed ({proc.returncode}):\n{out}")
    _sites = {key: base / f"site-{key}" for key in PACKAGES}
    return _sites


def run_palestra(
    args: list[str], sites: list[Path], cwd: Path, *, timeout: float = 300, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    """``python -m palestra ARGS`` with only ``sites`` added to the path and the plugin variables unset unless given."""
    return run_python(["-m", "palestra", *args], sites, cwd, timeout=timeout, **env_vars)


_all_json: subprocess.CompletedProcess[str] | None = None


def plugins_all_json(sites: dict[str, Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``palestra plugins --all --json`` with only the example plugin installed; run once, shared by both test files."""
    global _all_json
    if _all_json is None:
        _all_json = run_palestra(["plugins", "--all", "--json"], [sites["example"]], cwd)
    return _all_json


def run_python(
    args: list[str], sites: list[Path], cwd: Path, *, timeout: float = 300, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (*ENV_VARS, "PYTHONPATH", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join(str(s) for s in sites)
    env.update(env_vars)
    # cwd is a scratch folder: `python -m` puts the cwd on sys.path, and the repo root holds a palestra.egg-info.
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


class InProcess:
    """Makes chosen install folders importable in this process and rebuilds the plugin manager over them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        for var in ENV_VARS:
            monkeypatch.delenv(var, raising=False)

    def use(self, *sites: Path, **env_vars: str) -> None:
        from palestra import plugin_manager

        for site in sites:
            self.monkeypatch.syspath_prepend(str(site))
        for var, value in env_vars.items():
            self.monkeypatch.setenv(var, value)
        importlib.invalidate_caches()
        plugin_manager.reset()


def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcess]:
    """Body of the ``in_process`` fixture: the plugin caches and imported plugin modules are dropped afterwards."""
    from palestra import plugin_manager

    plugin_manager.reset()
    yield InProcess(monkeypatch)
    plugin_manager.reset()
    for name in [m for m in sys.modules if m.split(".")[0] in MODULES]:
        del sys.modules[name]
