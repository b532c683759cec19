"""One error for an optional package a component needs and does not find: ``palestra.MissingDependency``, one line
naming what needs it, the package and the pip extra. The loggers, textarena and reasoning_gym have their own tests
(test_loggers.py, test_textarena.py, test_reasoning_gym.py); here are the class itself, the dataset environment's
file formats and the hf policy's packages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import palestra
from palestra.config import ConfigError, build_component
from palestra.registry import MissingDependency, Requirement


def hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """None in sys.modules is how Python marks a module as unimportable: the import statement and find_spec fail."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_the_message_says_whether_the_package_is_missing_or_fails_to_import() -> None:
    assert palestra.MissingDependency is MissingDependency and issubclass(MissingDependency, ImportError)
    assert MissingDependency.palestra_user_error  # the CLI prints the line, not a traceback
    missing = MissingDependency(
        "the x environment",
        "xpkg",
        'pip install "palestra[x]"',
        cause=ModuleNotFoundError("No module named 'xpkg'", name="xpkg"),
    )
    assert str(missing) == (
        "the x environment needs the Python package 'xpkg', which is not installed; install it with: pip install "
        '"palestra[x]"'
    )
    assert missing.name == "xpkg" and missing.install == 'pip install "palestra[x]"'
    assert str(Requirement("xpkg", 'pip install "palestra[x]"').missing("the x environment")) == str(missing)
    broken = MissingDependency(
        "the x environment",
        "xpkg",
        "pip install x",
        cause=ModuleNotFoundError("No module named 'nltk'\n(needed by xpkg)", name="nltk"),
    )
    assert str(broken) == (
        "the x environment needs the Python package 'xpkg', which fails to import (No module named "
        "'nltk' (needed by xpkg)); install it with: pip install x"
    )


@pytest.mark.parametrize(
    ("fmt", "hidden", "package", "what"),
    [
        ("parquet", ("pyarrow", "pyarrow.parquet"), "pyarrow", "reading Parquet"),
        ("disk", ("datasets",), "datasets", "reading a saved dataset folder"),
    ],
)
def test_the_dataset_formats_that_need_a_package_name_the_key_and_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fmt: str, hidden: tuple[str, ...], package: str, what: str
) -> None:
    data = tmp_path / ("d.parquet" if fmt == "parquet" else "saved")
    if fmt == "parquet":
        data.write_bytes(b"PAR1")  # never read: the package is missing
    else:
        data.mkdir()
    hide(monkeypatch, *hidden)
    with pytest.raises(ConfigError) as info:
        build_component(
            "environment", {"name": "dataset", "options": {"path": str(data), "format": fmt}}, path="environment"
        )
    cause = info.value.__cause__
    assert isinstance(cause, MissingDependency) and cause.name == package
    assert str(cause).startswith(
        f"environment.options.path: {what} needs the Python package {package!r}, which is not installed"
    )
    assert str(info.value).endswith('install it with: pip install "palestra[datasets]"') and "\n" not in str(info.value)


def test_the_hf_policy_needs_transformers_and_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "transformers")
    with pytest.raises(ConfigError) as info:
        build_component("policy", {"name": "hf", "options": {"path": "/nowhere"}}, path="policy")
    assert str(info.value) == (
        "policy.name: policy 'hf' needs the Python package 'transformers', which is not installed; "
        'install it with: pip install "palestra[hf]"'
    )


@pytest.mark.parametrize(
    ("options", "package", "extra"),
    [({"lora": {"r": 4}}, "peft", "lora"), ({"gguf_file": "model.gguf"}, "gguf", "gguf")],
)
def test_an_hf_option_that_needs_a_package_names_the_option_and_the_extra(
    monkeypatch: pytest.MonkeyPatch, options: dict, package: str, extra: str
) -> None:
    pytest.importorskip("transformers")
    hide(monkeypatch, package)
    with pytest.raises(ConfigError) as info:  # before any folder is looked at
        build_component("policy", {"name": "hf", "options": {"path": "/nowhere", **options}}, path="policy")
    key = next(iter(options))
    assert isinstance(info.value.__cause__, MissingDependency)
    assert str(info.value.__cause__) == (
        f"policy.options.{key} needs the Python package {package!r}, which is not "
        f'installed; install it with: pip install "palestra[{extra}]"'
    )
