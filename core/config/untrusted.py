"""Nothing trusted from inside a run folder: a config read back from a checkpoint is data the folder holds, not the
user's word.

A checkpoint's sha256 is a digest, not a signature: whoever can write a run folder can forge the config inside it.
``palestra train --resume`` and ``palestra export`` rebuild a run from that config, so three kinds of value in it
would let a forged file act outside its folder. Each is used only when the user passes it again on the command line
(an override for ``--resume``, ``--set`` for ``export``):

* an option that runs code shipped with its data: one declared ``option(runs_code=True)`` (the ``hf`` policy's
  ``trust_remote_code``), or any option named ``trust_remote_code`` (a third-party plugin's), when it is set;
* a path option (declared ``option(path=...)``) that names anything outside the run folder once resolved (links
  followed), including ``package:NAME`` (an installed package's folder);
* a component whose plugin is not one of palestra's own (the ``palestra`` distribution's built-ins): naming it
  imports and runs that plugin's code.

Values inside the run folder, built-in components and options that run nothing are the run's own, and a normal
resume needs nothing extra. :func:`refuse_untrusted` answers everything else in one line naming the checkpoint,
each key and value, and the command that accepts them.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from palestra.errors import ConfigError

from .schema import ComponentSpec, Config
from .validation import config_key

PACKAGE_PREFIX = "package:"  # a path option naming an installed package's folder (the hf policy's path)
BUILTIN_DISTRIBUTION = "palestra"  # the distribution whose plugins are palestra's own (plugin_manager.DISTRIBUTION)
CODE_OPTION = "trust_remote_code"  # by this name, a third-party plugin's option is taken to run code too


@dataclass(frozen=True)
class Claim:
    """A value a checkpoint cannot vouch for by itself: ``key`` (dotted, as an override names it), its ``value``, and
    ``problem`` (why it would reach outside the run folder; None when it stays inside)."""

    key: str
    value: Any
    kind: str  # "name" (a component), "path" or "code"
    problem: str | None


def claims(config: Config, run_dir: Path) -> list[Claim]:
    """Every component name, path option and code option of ``config``, judged against ``run_dir``."""
    return list(_walk(config, "", run_dir.resolve()))


def untrusted(config: Config, run_dir: Path, given: Iterable[str] = ()) -> list[Claim]:
    """The values of ``config`` that reach outside ``run_dir`` and that the user did not pass (``given``: the dotted
    keys of the command line's overrides)."""
    passed = set(given)
    return [v for v in claims(config, run_dir) if v.problem is not None and v.key not in passed]


def refuse_untrusted(
    config: Config, run_dir: Path, given: Iterable[str], *, source: Path, command: list[str], flag: str | None = None
) -> None:
    """One :class:`ConfigError` line when ``config`` (read from checkpoint ``source``) holds values that reach outside
    ``run_dir`` and were not passed again; ``command`` is the command line that repeats them, less the values, which
    it takes as arguments (each after ``flag`` when given)."""
    found = untrusted(config, run_dir, given)
    if not found:
        return
    named = "; ".join(f"{v.key}={_show(v.value)} ({v.problem})" for v in found)
    repeat = [part for v in found for part in ([flag] if flag else []) + [f"{v.key}={_text(v.value)}"]]
    again = " ".join(shlex.quote(part) for part in [*command, *repeat])
    raise ConfigError(
        f"checkpoint {source}: its config sets {named}; a config read from a run folder is not trusted to run code "
        f"or reach outside the folder, so these are used only when you pass them again: {again}"
    )


def check_given(saved: Config, run_dir: Path, given: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """The first key of ``given`` (dotted key -> the value passed) that a command rebuilding the saved run may not
    take, or None. Only component names, path options and code options may be passed: ``(key, None)`` for any other
    key (the caller says what else it takes); ``(key, why)`` for a component name other than the saved one (passing
    it vouches for that plugin; another component would make another run)."""
    saved_claims = {c.key: c for c in claims(saved, run_dir)}
    for key, value in given.items():
        claim = saved_claims.get(key)
        if claim is None:
            return key, None
        text = getattr(value, "text", value)  # an override's literal text (palestra.config's _Override)
        if claim.kind == "name" and text != claim.value:
            return key, (
                f"the saved run uses {claim.value!r}; pass {key}={claim.value} to vouch for that plugin "
                "(another component would make another run)"
            )
    return None


def follow_folder(raw: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The saved config ``raw`` with ``run.name`` and ``run.output_dir`` naming ``run_dir``, the folder the user
    named, when they name another (a run copied or moved: the copy is written, so every line must name it); unchanged
    when they already name it, so a resumed run saves the config an uninterrupted one does."""
    run = raw.get("run")
    if not isinstance(run, dict):
        return raw  # validation answers a config without a run section
    name, output_dir = run.get("name"), run.get("output_dir", "runs")
    if (
        isinstance(name, str)
        and isinstance(output_dir, str)
        and (Path(output_dir) / name).resolve() == run_dir.resolve()
    ):
        return raw
    folder = run_dir if run_dir.name not in ("", ".", "..") else run_dir.resolve()
    run["name"], run["output_dir"] = folder.name, str(folder.parent)
    return raw


# ---- the walk ------------------------------------------------------------------------------------------------------
def _walk(obj: Any, path: str, root: Path) -> Iterator[Claim]:
    if _is_instance(obj):  # the config, its sections, component nodes, options
        yield from _walk_fields(obj, path, root)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{path}[{i}]", root)
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            if isinstance(key, str):
                yield from _walk(item, _join(path, key), root)


def _walk_fields(obj: Any, path: str, root: Path) -> Iterator[Claim]:
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        key, value = _join(path, config_key(f)), getattr(obj, f.name)
        meta: Mapping[str, Any] = f.metadata or {}
        if isinstance(obj, ComponentSpec) and f.name == "name":
            yield Claim(key, value, "name", _plugin_problem(obj))
        elif meta.get("runs_code") or f.name == CODE_OPTION:
            yield Claim(key, value, "code", "runs code shipped with the model or data" if value else None)
        elif meta.get("path"):
            yield Claim(key, value, "path", _path_problem(obj, meta["path"], value, root))
        else:
            yield from _walk(value, key, root)


def _is_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _plugin_problem(spec: ComponentSpec) -> str | None:
    """Why naming ``spec``'s component runs code that is not palestra's own (None for a built-in)."""
    from .validation import _registry

    distribution = _registry().get(spec.KIND, spec.name).distribution
    if distribution == BUILTIN_DISTRIBUTION:
        return None
    return f"from the plugin distribution {distribution!r}, not built into palestra: naming it runs that plugin's code"


def _path_problem(owner: Any, base: str, value: Any, root: Path) -> str | None:
    """Why the path option ``value`` (relative to ``base``: cwd, run, or a sibling path option of ``owner``) reaches
    outside the run folder ``root``; None when it stays inside."""
    if not isinstance(value, str) or not value.strip():
        return None
    if value.startswith(PACKAGE_PREFIX):
        return "an installed package's folder, outside the run folder"
    given = Path(value).expanduser()
    if base in ("cwd", "run"):
        target = ((root if base == "run" else Path.cwd()) / given).resolve()
        return None if _inside(target, root) else _outside(value, target)
    folder = getattr(owner, base, None)  # a file in the folder another option names: checked with that option
    if not isinstance(folder, str) or folder.startswith(PACKAGE_PREFIX):
        if given.is_absolute() or ".." in given.parts:
            return _outside(value, given)
        return None
    start = Path(folder).expanduser().resolve()
    target = (start / given).resolve()
    return None if _inside(target, start) or _inside(target, root) else _outside(value, target)


def _inside(target: Path, folder: Path) -> bool:
    return target == folder or folder in target.parents


def _outside(value: str, target: Path) -> str:
    return "outside the run folder" if Path(value) == target else f"{target}, outside the run folder"


def _show(value: Any) -> str:
    return _text(value) if isinstance(value, bool) else repr(value)


def _text(value: Any) -> str:
    """``value`` as an override's text: strings as they are (a string option takes the text literally)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
