"""Write a new plugin package to start from: ``palestra new plugin NAME [--kinds reward,environment] [--dir DIR]``.

The package (folder ``DIR/NAME``) is pip-installable as it stands: a ``pyproject.toml`` declaring the ``palestra``
entry point, a module whose commented hook implementations register one working minimal component per kind asked
for (each registered under the module's name), a test that checks every one of them with the contract kit
(``palestra.testing``), and a README. The files are rendered from ``palestra/cli/plugin_template/``.

NAME is a distribution name as Python packaging spells them (PEP 508: ASCII letters and digits, with ``-``, ``_``
or ``.`` inside), such as ``palestra-foo``; the module is that name with ``_`` for the separators
(``palestra_foo``), and the distribution its normalised form (PEP 503). Both are said in the output.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import keyword
import re
import shutil
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from string import Template

from palestra.cli import UsageError

TEMPLATES = Path(__file__).with_name("plugin_template")


@dataclass(frozen=True)
class Scaffold:
    """What one kind of component adds to the package."""

    hook: str  # the registration hook
    modules: tuple[tuple[str, str], ...]  # (template file without .py.tmpl, what it holds): written into the package
    factory: str  # what the hook registers, and the options dataclass (${cls} is the CamelCase name)
    options: str
    description: str
    table: str  # its README row's last column


SCAFFOLDS: dict[str, Scaffold] = {
    "environment": Scaffold(
        "register_environments",
        (("environment", "the environment"),),
        "${cls}Environment",
        "${cls}EnvironmentOptions",
        "copy a number: one agent, one turn, the answer in metadata['answer']",
        "copy a number (one agent, one turn); the answer goes in `metadata['answer']`",
    ),
    "reward": Scaffold(
        "register_rewards",
        (("reward", "the reward"),),
        "${cls}Reward",
        "${cls}RewardOptions",
        "1 when the completion is metadata['answer'], partial when it contains it",
        "1 when the completion is the expected answer (`metadata['answer']`), `partial` when it contains it",
    ),
    "optimizer": Scaffold(
        "register_optimizers",
        (("optimizer", "the optimiser"),),
        "${cls}Optimizer",
        "${cls}OptimizerOptions",
        "REINFORCE with a group baseline on palestra's learner loop",
        "REINFORCE with a group baseline, on palestra's learner loop (`palestra.Algorithm`)",
    ),
    "policy": Scaffold(
        "register_policies",
        (("policy", "the policy's options and factory"), ("bigram", "the policy's model")),
        "build_policy",
        "${cls}PolicyOptions",
        "a bigram language model over UTF-8 bytes",
        "a bigram language model over UTF-8 bytes (`palestra.CausalLMPolicy`)",
    ),
    "logger": Scaffold(
        "register_loggers",
        (("logger", "the logger"),),
        "${cls}Logger",
        "${cls}LoggerOptions",
        "tab-separated step/key/value lines in <run_dir>/${name}.tsv",
        "tab-separated `step key value` lines in `<run_dir>/${name}.tsv`",
    ),
    "tool": Scaffold(
        "register_tools",
        (("tool", "the tool"),),
        "build_tool",
        "${cls}ToolOptions",
        "count a letter in a word",
        "counts a letter in a word; its JSON Schema comes from the function's type hints and docstring",
    ),
}

HOOK = """

@hookimpl
def ${hook}(register):
    # ${config_key}=${name} in a config; its options are checked against ${options}.
    from .${module} import ${factory}, ${options}

    register("${name}", ${factory}, options=${options}, description="${description}")
"""

TEST = """

def test_the_${kind}_keeps_the_contract(palestra_contract):
    palestra_contract("${kind}", "${name}"${settings})
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["plugin"], help="what to create: a plugin package")
    parser.add_argument(
        "name",
        metavar="NAME",
        help="the plugin's distribution name (e.g. palestra-foo); its module is the name with '_' for '-' and '.' "
        "(palestra_foo), and each component is registered under the module's name",
    )
    parser.add_argument(
        "--kinds",
        default="reward,environment",
        metavar="KIND[,KIND...]",
        help=f"the components to write, one of each (default: reward,environment; kinds: {', '.join(SCAFFOLDS)})",
    )
    parser.add_argument(
        "--dir", default=".", help="the folder to create the package folder NAME in (default: the current directory)"
    )


@dataclass(frozen=True)
class Names:
    """What NAME becomes: the distribution (pip's name for it) and the module (the import name, the entry point's
    name and every component's registered name)."""

    dist: str
    module: str


def run(args: argparse.Namespace) -> int:
    kinds = parse_kinds(args.kinds)
    names = parse_name(args.name)
    check_dir(args.dir)
    target = Path(args.dir) / args.name
    check_name(names.module, target, kinds)
    files = render(names.module, kinds, dist=names.dist)
    write_package(target, files, args.dir)
    print(f"wrote {target}/: a palestra plugin with {', '.join(f'{k} {names.module!r}' for k in kinds)}")
    print(f"  distribution {names.dist!r} (pip's name for it), module {names.module!r} (its import name)")
    for relative in files:
        print(f"  {target / relative}")
    print(f"next: pip install -e {target} && (cd {target} && python -m pytest)")
    return 0


def write_package(target: Path, files: dict[str, str], where: str) -> None:
    """Write every file, or none: a package half written is removed (``target`` did not exist before)."""
    try:
        for relative, text in files.items():
            path = target / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as e:
        shutil.rmtree(target, ignore_errors=True)
        raise UsageError(f"--dir {where!r}: cannot write the package there ({e.strerror or e})") from None


# ---- checking what was asked for ------------------------------------------------------------------------
def parse_kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds:
        raise UsageError(f"--kinds: name at least one kind ({', '.join(SCAFFOLDS)})")
    for kind in kinds:
        if kind not in SCAFFOLDS:
            close = difflib.get_close_matches(kind, list(SCAFFOLDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (kinds: {', '.join(SCAFFOLDS)})"
            raise UsageError(f"--kinds: unknown kind {kind!r}{hint}")
    return list(dict.fromkeys(k for k in SCAFFOLDS if k in kinds))  # one of each, in a fixed order


# PEP 508's distribution name; re.ASCII: \w and friends are not used, but be explicit that only ASCII passes
DIST_NAME = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$", re.ASCII)


def parse_name(name: str) -> Names:
    """NAME as a distribution name, and the module derived from it; a name packaging refuses is one line."""
    if not DIST_NAME.match(name):
        suggestion = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
        suggestion = re.sub(r"[^A-Za-z0-9._-]+", "-", suggestion).strip("-_.")
        hint = f"; try {suggestion!r}" if suggestion and DIST_NAME.match(suggestion) else ""
        raise UsageError(
            f"NAME {name!r} is not a distribution name (ASCII letters and digits, with '-', '_' or '.' between "
            f"them){hint}"
        )
    module = name if name.isidentifier() else re.sub(r"[-_.]+", "_", name)
    if not module.isidentifier():  # it starts with a digit
        raise UsageError(f"NAME {name!r}: its module name {module!r} would start with a digit; pick another name")
    if keyword.iskeyword(module):
        raise UsageError(f"NAME {name!r}: its module name {module!r} is a Python keyword; pick another name")
    return Names(dist=re.sub(r"[-_.]+", "-", name).lower(), module=module)


def check_dir(folder: str) -> None:
    """--dir is a folder (made when missing); a file there is one line before anything is written."""
    p = Path(folder)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--dir {folder!r} is not a folder; name the folder to create the package in")


def check_name(name: str, target: Path, kinds: list[str]) -> None:
    """The module name (and the folder, and every component's registered name) must be free."""
    if target.exists():
        raise UsageError(f"NAME {name!r}: {target} already exists; pick another name or --dir")
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is not None:
        where = found.origin or (list(found.submodule_search_locations or []) or ["?"])[0]
        raise UsageError(f"NAME {name!r}: a module of that name already exists ({where}); pick another name")
    from palestra.plugin_manager import get_registry

    registry = get_registry()
    for kind in kinds:
        if (kind, name) in registry:
            reg = registry.get(kind, name)
            raise UsageError(
                f"NAME {name!r}: {kind} {name!r} is already registered by plugin {reg.plugin!r} "
                f"(distribution {reg.distribution!r}); pick another name"
            )


# ---- writing the package ---------------------------------------------------------------------------------
def render(name: str, kinds: list[str], *, dist: str | None = None) -> dict[str, str]:
    """Relative path -> text of every file of the package: module ``name``, distribution ``dist`` (by default the
    module's name with ``-`` for ``_``)."""
    from palestra import __version__
    from palestra.hookspecs import PLUGIN_API

    major = int(PLUGIN_API.split(".")[0])
    values = {
        "name": name,
        "dist": dist or name.replace("_", "-"),
        "cls": "".join(part.capitalize() for part in name.split("_")) or name,
        "summary": ", ".join(f"{kind} {name!r}" for kind in kinds),
        "palestra_version": __version__,
        "plugin_api": f">={major}.0,<{major + 1}",
        "kinds": json.dumps(kinds),
    }
    values["hooks"] = "".join(_fill(HOOK, values, kind) for kind in kinds)
    values["tests"] = "".join(_fill(TEST, values, kind, settings=_test_settings(kind, name, kinds)) for kind in kinds)
    values["table"] = "\n".join(
        f"| {kind} | `{name}` | {_fill(SCAFFOLDS[kind].table, values, kind)} |" for kind in kinds
    )
    values["files"] = "".join(
        f"| `{name}/{m}.py` | {what} |\n" for kind in kinds for m, what in SCAFFOLDS[kind].modules
    )
    values["train"] = " ".join(
        ["palestra train train.steps=100"]
        + [f"{_config_key(kind)}.name={name}" for kind in kinds if kind not in ("logger", "tool")]
        + ([f"'loggers=[{{name: {name}}}]'"] if "logger" in kinds else [])
        + ([f"'tools.tools=[{{name: {name}}}]'"] if "tool" in kinds else [])  # a list of tools, around the environment
    )
    files = {
        "pyproject.toml": _template("pyproject.toml", values),
        "README.md": _template("README.md", values),
        f"{name}/__init__.py": _template("__init__.py", values),
        "tests/test_contract.py": _template("test_contract.py", values),
    }
    for kind in kinds:
        for module, _ in SCAFFOLDS[kind].modules:
            files[f"{name}/{module}.py"] = _template(f"{module}.py", values)
    return files


def _template(filename: str, values: dict[str, str]) -> str:
    return Template((TEMPLATES / f"{filename}.tmpl").read_text(encoding="utf-8")).substitute(values)


def _fill(text: str, values: dict[str, str], kind: str, **extra: str) -> str:
    scaffold = SCAFFOLDS[kind]
    fields = {**values, "kind": kind, "hook": scaffold.hook, "module": scaffold.modules[0][0], **extra}
    fields["config_key"] = {"logger": "loggers[i].name", "tool": "tools.tools[i].name"}.get(kind, f"{kind}.name")
    for key in ("factory", "options", "description"):  # these hold ${cls} / ${name} themselves
        fields[key] = Template(getattr(scaffold, key)).substitute(values)
    return Template(text).substitute(fields)


def _test_settings(kind: str, name: str, kinds: list[str]) -> str:
    """Extra arguments of a kind's contract test: the plugin's own environment and policy where it has them."""
    if kind == "reward" and "environment" in kinds:
        return f', environment="{name}"'  # the reward reads the metadata this environment writes
    if kind == "optimizer" and "policy" in kinds:
        return f', policy="{name}"'
    if kind == "tool":  # arguments the tool must accept and answer (the kit calls it with them)
        return ', examples=[{"word": "strawberry", "letter": "r"}]'
    return ""


def _config_key(kind: str) -> str:
    return kind  # environment / reward / optimizer / policy: the config section names the component
