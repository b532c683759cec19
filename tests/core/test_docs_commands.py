"""The commands the docs show must work: README.md and docs/*.md are checked against the real CLI.

What is read: fenced ```bash / ```sh / ```shell / ```console blocks (in ``console`` blocks only the ``$ `` lines),
and inline code spans that start with ``palestra ``, ``torchrun `` or ``python -m palestra``. Every simple command
in them (split at ``&&``, ``||``, ``;``, ``|``; ``# comments`` and leading ``VAR=value`` dropped) whose program is
``palestra`` (also as ``python -m palestra`` or ``torchrun ... -m palestra``) is checked:

* the subcommand exists, and every ``--flag`` the doc uses appears in that subcommand's ``--help``;
* a command without placeholders parses with the real argument parser;
* ``palestra config show ...`` without placeholders runs for real (in process) and exits 0, so a config named by
  path (``examples/grpo.yaml``) must exist and every override must be valid;
* the ``key=value`` overrides of ``train`` / ``doctor`` / ``config show`` are validated through
  ``palestra config show`` on the command's config file, or on the built-in default when the file is a
  placeholder (``my.yaml``, ``FILE``).

Placeholders (``RUN_DIR``, ``FILE``, ``N``, ``my.yaml``, ``runs/my-run``, ``<name>``, ``...``, ``[--opt X]`` usage
syntax, ``a|b`` alternatives) make a command a template: only its subcommand, flags and concrete overrides are
checked. A command in a block that first ``pip install``s a local plugin is run for real only when that plugin
is installed. Also checked: ``python -m palestra.<module>`` modules exist, ``yaml`` blocks that look like
configs validate, and relative links (and their ``#anchors``) resolve. Nothing trains: ``train`` and ``doctor``
are only parsed. Each distinct call runs once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL_LANGS = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}
CONFIG_SECTIONS = {
    "run",
    "environment",
    "reward",
    "policy",
    "optimizer",
    "generator",
    "loggers",
    "train",
    "kernels",
    "distributed",
    "agents",
}
# subcommands whose key=value arguments are config overrides
OVERRIDE_COMMANDS = {"train", "doctor", "config"}

_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
_UPPER_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Za-z]+)?$")  # RUN_DIR, FILE, N, FILE.json


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    source: str  # the text as the doc shows it
    args: tuple[str, ...]  # what follows `palestra`
    needs_installed: tuple[str, ...] = ()  # local plugin folders the block pip-installs first


@dataclass(frozen=True)
class DocModule:
    where: str
    module: str


# ---- reading the docs ----------------------------------------------------------------------------------
def shell_lines(text: str) -> list[tuple[int, int, str]]:
    """``(line number, block, text)`` for every logical shell line; ``block`` numbers the fenced block (-1: inline)."""
    out: list[tuple[int, int, str]] = []
    lang: str | None = None
    block = 0
    pending, pending_line = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            if lang is None:
                lang, block = (fence.group(1).lower() or "text"), block + 1
            else:
                lang = None
            continue
        if lang is None:
            for span in _INLINE.findall(line):
                span = span.replace("\\|", "|").strip()  # a pipe escaped inside a table cell
                if re.match(r"^(palestra |torchrun |python3? -m palestra\b)", span):
                    out.append((number, -1, span))
            continue
        if lang not in SHELL_LANGS:
            continue
        if lang == "console":
            if not line.startswith("$ ") and not pending:
                continue
            line = line[2:] if line.startswith("$ ") else line
        if not pending:
            pending_line = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((pending_line, block, (pending + line).strip()))
        pending = ""
    return out


def simple_commands(line: str) -> list[list[str]]:
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for token in tokens:
        if token in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def palestra_args(tokens: list[str]) -> tuple[str, ...] | None:
    """What follows ``palestra`` in one simple command, or None when the command is not palestra's CLI."""
    while tokens and _ENV_ASSIGNMENT.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "palestra":
        return tuple(tokens[1:])
    if tokens[0] in ("python", "python3") and tokens[1:3] == ["-m", "palestra"]:
        return tuple(tokens[3:])
    if tokens[0] == "torchrun":
        for i, token in enumerate(tokens[:-1]):
            if token == "-m" and tokens[i + 1] == "palestra":
                return tuple(tokens[i + 2 :])
    return None


def palestra_module(tokens: list[str]) -> str | None:
    while tokens and _ENV_ASSIGNMENT.match(tokens[0]):
        tokens = tokens[1:]
    if (
        len(tokens) >= 3
        and tokens[0] in ("python", "python3")
        and tokens[1] == "-m"
        and tokens[2].startswith("palestra.")
    ):
        return tokens[2]
    return None


def pip_installed_folders(tokens: list[str]) -> list[str]:
    if tokens[:2] != ["pip", "install"] and tokens[:4] != ["python", "-m", "pip", "install"]:
        return []
    return [t for t in tokens if t.startswith(("./", "../")) and not t.startswith("-")]


def extract(path: Path, text: str | None = None) -> tuple[list[DocCommand], list[DocModule]]:
    text = path.read_text(encoding="utf-8") if text is None else text
    name = path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path
    commands: list[DocCommand] = []
    modules: list[DocModule] = []
    installed: dict[int, list[str]] = {}  # block -> the local folders it pip-installed so far
    for number, block, line in shell_lines(text):
        installed_in_block = installed.setdefault(block, []) if block >= 0 else []
        for tokens in simple_commands(line):
            where = f"{name}:{number}"
            installed_in_block += pip_installed_folders(tokens)
            module = palestra_module(tokens)
            if module:
                modules.append(DocModule(where, module))
            args = palestra_args(tokens)
            if args is None or (args and args[0].endswith(":")):  # `palestra train: error: ...` is output
                continue
            commands.append(DocCommand(where, " ".join(tokens), args, tuple(installed_in_block)))
    return commands, modules


# ---- the CLI, in process -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


@cache
def call(args: tuple[str, ...]) -> Outcome:
    """``palestra *args`` in process, from the repository root, with its exit status and output."""
    from palestra.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception as e:  # noqa: BLE001 - reported as a failed command
                err.write(f"{type(e).__name__}: {e}")
                code = 1
    finally:
        os.chdir(cwd)
    return Outcome(int(code or 0), out.getvalue(), err.getvalue())


@cache
def parses(args: tuple[str, ...]) -> str | None:
    """None when the real parser accepts ``args``; else its error."""
    from palestra.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(list(args))
        except SystemExit as e:
            if e.code:
                return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def subcommands() -> set[str]:
    from palestra.cli import COMMANDS

    return set(COMMANDS)


# ---- checking one command ------------------------------------------------------------------------------
def is_placeholder(token: str) -> bool:
    bare = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
    return (
        "<" in bare
        or ">" in bare
        or "..." in bare
        or "…" in bare
        or bare.startswith("[")
        or (bare.endswith("]") and "=" not in bare)
        or ("|" in bare and "=" not in bare)
        or bare in ("key=value",)
        or bool(_UPPER_PLACEHOLDER.match(bare))
        or bool(re.search(r"(^|/)my[-_.]", bare))
    )


def is_override(token: str) -> bool:
    return "=" in token and not token.startswith("-") and not is_placeholder(token)


def plugin_installed(folder: str) -> bool:
    pyproject = ROOT / folder / "pyproject.toml"
    if not pyproject.is_file():
        return False
    match = re.search(r'^name\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M)
    if not match:
        return False
    try:
        metadata.distribution(match.group(1))
    except metadata.PackageNotFoundError:
        return False
    return True


def check_command(cmd: DocCommand) -> list[str]:
    """Everything wrong with one documented command (empty when it is fine)."""
    args = cmd.args
    problems: list[str] = []
    positional = [a for a in args if not a.startswith("-")]
    sub = positional[0] if positional and args and not args[0].startswith("-") else None
    if sub is not None and is_placeholder(sub):  # `palestra ...`, `palestra <command>`: the top-level help
        sub = None
    if sub is not None and sub not in subcommands():
        return [f"unknown subcommand {sub!r} (the subcommands are {', '.join(sorted(subcommands()))})"]
    help_path: tuple[str, ...] = ()
    if sub is not None:
        help_path = (sub,)
        if sub == "config":
            action = args[1] if len(args) > 1 else None
            if action is None or action.startswith("-"):
                return ["`palestra config` needs an action (`palestra config show ...`)"]
            if action != "show":
                return [f"unknown `palestra config` action {action!r}"]
            help_path = ("config", "show")

    helped = call((*help_path, "--help"))
    if helped.code != 0:
        return [f"`palestra {' '.join(help_path)} --help` exited {helped.code}: {helped.err.strip()[-300:]}"]
    for flag in dict.fromkeys(_FLAG.findall(" ".join(args))):
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helped.out):
            problems.append(f"{flag} is not an option of `palestra {' '.join(help_path)}` (see its --help)")

    template = any(is_placeholder(a) for a in args)
    concrete_ok = not template and not (cmd.needs_installed and not all(map(plugin_installed, cmd.needs_installed)))
    if concrete_ok:
        error = parses(args)
        if error:
            problems.append(f"does not parse: {error}")
            return problems

    if sub not in OVERRIDE_COMMANDS:
        return problems
    if not concrete_ok and cmd.needs_installed:
        return problems  # its components come from a plugin that is not installed here
    if sub == "config" and concrete_ok:
        shown = call(args)  # the documented command itself
        if shown.code != 0:
            problems.append(f"exited {shown.code}: {shown.err.strip()[-400:]}")
        return problems
    # a template, or train/doctor: its overrides on its config file when that is concrete, else on the default
    rest = list(args[len(help_path) :])
    config_file = None
    if sub == "config":
        config_file = rest[0] if rest and "=" not in rest[0] else None
    else:
        for i, token in enumerate(rest):
            if token == "--config" and i + 1 < len(rest):
                config_file = rest[i + 1]
            elif token.startswith("--config="):
                config_file = token.split("=", 1)[1]
    if config_file is not None and is_placeholder(config_file):
        config_file = None
    overrides = [t for t in rest if is_override(t) and t != f"--config={config_file}"]
    if config_file is not None and not (ROOT / config_file).is_file():
        problems.append(f"config file {config_file} does not exist (paths are relative to the repository root)")
        return problems
    shown = call(("config", "show", *([config_file] if config_file else []), *overrides))
    if shown.code != 0:
        what = " ".join(["palestra config show", *([config_file] if config_file else []), *overrides])
        problems.append(f"`{what}` exited {shown.code}: {shown.err.strip()[-400:]}")
    return problems


def check_module(mod: DocModule) -> list[str]:
    try:
        found = importlib.util.find_spec(mod.module) is not None
    except ImportError as e:
        return [f"python -m {mod.module}: {e}"]
    return [] if found else [f"python -m {mod.module}: no such module"]


# ---- yaml blocks and links -----------------------------------------------------------------------------
def yaml_blocks(text: str) -> list[tuple[int, str]]:
    blocks, lang, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence and lang is None:
            lang, start, lines = (fence.group(1).lower() or "text"), number, []
        elif fence:
            if lang in ("yaml", "yml"):
                blocks.append((start, "\n".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def github_anchor(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    found, seen, in_fence = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not in_fence:
            slug = github_anchor(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z][\w+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


# ---- the tests -----------------------------------------------------------------------------------------
COMMANDS: list[DocCommand] = []
MODULES: list[DocModule] = []
for _doc in DOC_FILES:
    _commands, _modules = extract(_doc)
    COMMANDS += _commands
    MODULES += _modules


def test_the_docs_show_commands() -> None:
    assert (ROOT / "README.md").is_file() and len(DOC_FILES) > 1, "README.md and docs/*.md are expected"
    assert len(COMMANDS) >= 10, f"only {len(COMMANDS)} palestra commands found: the extraction is broken"
    shown = {c.args[0] for c in COMMANDS if c.args}
    assert {"train", "config"} <= shown, f"the docs show these subcommands only: {sorted(shown)}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where} {' '.join(c.args)}"[:90] for c in COMMANDS])
def test_documented_command(cmd: DocCommand) -> None:
    problems = check_command(cmd)
    assert not problems, f"{cmd.where}: `{cmd.source}`:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("mod", MODULES, ids=[f"{m.where} {m.module}" for m in MODULES])
def test_documented_module(mod: DocModule) -> None:
    problems = check_module(mod)
    assert not problems, f"{mod.where}: " + "; ".join(problems)


@pytest.mark.parametrize("doc", DOC_FILES, ids=[str(d.relative_to(ROOT)) for d in DOC_FILES])
def test_yaml_config_blocks_validate(doc: Path, tmp_path: Path) -> None:
    problems = []
    for number, block in yaml_blocks(doc.read_text(encoding="utf-8")):
        data = yaml.safe_load(block)
        if not isinstance(data, dict) or not data or not set(data) <= CONFIG_SECTIONS:
            continue  # not a Palestra config (a pyproject excerpt, another tool's file)
        path = tmp_path / f"line{number}.yaml"
        path.write_text(block, encoding="utf-8")
        shown = call(("config", "show", str(path)))
        if shown.code != 0:
            problems.append(f"{doc.relative_to(ROOT)}:{number}: {shown.err.strip()}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOC_FILES, ids=[str(d.relative_to(ROOT)) for d in DOC_FILES])
def test_relative_links_resolve(doc: Path) -> None:
    problems = broken_links(doc)
    assert not problems, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_the_test_command_block_is_where_ci_reads_it() -> None:
    """.ci/run takes the fenced block right after `<!-- test-command -->` in README.md."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1] == "```bash"
    assert lines[marker + 2].endswith("&& pytest -q") and lines[marker + 3] == "```"


def test_the_checker_catches_mistakes() -> None:
    """A misspelt flag, an unknown subcommand, a bad override, a missing config, a missing module all fail."""
    doc = """
```bash
palestra train --confg examples/grpo.yaml
palestra trian
palestra config show train.lrr=3e-4
palestra config show examples/no-such-file.yaml
palestra doctor --config examples/grpo.yaml train.batch_size=zero
torchrun --nproc_per_node=2 -m palestra train --config my.yaml --resum RUN_DIR
python -m palestra.no_such_module
```

and inline: `palestra plot RUN_DIR --output FILE`; fine: `palestra config show examples/grpo.yaml train.lr=3e-4`.
"""
    with tempfile.TemporaryDirectory() as folder:
        commands, modules = extract(Path(folder) / "synthetic.md", doc)
    results = {" ".join(c.args): check_command(c) for c in commands}
    assert len(results) == 8, results
    for args, problems in results.items():
        if args == "config show examples/grpo.yaml train.lr=3e-4":
            assert problems == [], problems
        else:
            assert problems, f"`palestra {args}` should have been caught"
    assert any("--confg" in p for p in results["train --confg examples/grpo.yaml"])
    assert any("--resum" in p for p in results["train --config my.yaml --resum RUN_DIR"])
    assert [check_module(m) for m in modules] and all(check_module(m) for m in modules)
