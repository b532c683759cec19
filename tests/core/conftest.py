from pathlib import Path

import plugin_installs
import pytest


@pytest.fixture(scope="session")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example and faulty plugin packages, each pip-installed once per session into its own folder."""
    return plugin_installs.install_all(tmp_path_factory.mktemp("plugin-installs"))


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch):
    yield from plugin_installs.in_process(monkeypatch)
