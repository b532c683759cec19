"""What plugins registered: components by kind and name, each with the plugin that registered it.

A component that needs an optional package registers its factory wrapped in :class:`Requires`; it is listed
(``palestra plugins --all`` shows it as unavailable, with the install command) whether the package is there or
not, and asking the registry for it while the package is missing is one line naming the package and the command.
A component that imports an optional package itself raises :class:`MissingDependency` (``palestra.MissingDependency``)
when it is missing: the one error for it, built-in or not.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Kinds of component, keyed by the registration hook that provides them.
KINDS: dict[str, str] = {
    "environment": "register_environments",
    "reward": "register_rewards",
    "optimizer": "register_optimizers",
    "policy": "register_policies",
    "logger": "register_loggers",
    "generator": "register_generators",
    "tool": "register_tools",
    "tool_parser": "register_tool_parsers",
    "agent": "register_agents",
}


class RegistryError(LookupError):
    """A component is missing or registered twice. The message is one line naming the culprit."""

    palestra_user_error = True

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class MissingDependency(ImportError):
    """An optional Python package a component needs is missing: the one error every component raises for it.

    One line naming what needs the package, the package, and the command that installs it (for palestra's own
    components ``pip install "palestra[<extra>]"``)::

        try:
            import textarena
        except ImportError as e:
            raise MissingDependency("the textarena environment", "textarena", 'pip install "palestra[textarena]"',
            cause=e) from None

    ``cause``, the ImportError met, tells a package that is not installed from one that fails to import (one of its
    own imports missing, or too old a version), and the message says which. ``name`` is the package, as on
    :class:`ModuleNotFoundError`.
    """

    palestra_user_error = True

    def __init__(self, what: str, package: str, install: str, *, cause: ImportError | None = None) -> None:
        self.what, self.install = what, install
        super().__init__(
            f"{what} needs the Python package {package!r}, {_why_missing(package, cause)}; install it with: {install}",
            name=package,
        )


def _why_missing(package: str, cause: ImportError | None) -> str:
    if cause is None or (isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] == package):
        return "which is not installed"
    text = " ".join(str(cause).split()) or type(cause).__name__
    return f"which fails to import ({text})"


@dataclass(frozen=True)
class Requirement:
    """An optional Python package a component needs: its import name and the command that installs it."""

    module: str  # the top-level import name, checked with importlib.util.find_spec (nothing is imported)
    install: str  # e.g. 'pip install "palestra[reasoning-gym]"'

    def installed(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # a broken or blocked package is as good as a missing one
            return False

    def missing(self, what: str) -> MissingDependency:
        """The error for ``what`` needing this package while it is not installed."""
        return MissingDependency(what, self.module, self.install)


class Requires:
    """A factory that needs an optional package: ``register("x", Requires(XEnv, module="x", install="pip install x"))``.

    Calling it without the package raises :class:`MissingDependency` (one line) before the factory runs, so the
    factory may import the package freely; :attr:`Registration.requires` reads the requirement for listings.
    """

    def __init__(self, factory: Callable[..., Any], *, module: str, install: str) -> None:
        if not callable(factory):
            raise TypeError(f"Requires: factory must be callable, got {type(factory).__name__}")
        self.factory = factory
        self.requirement = Requirement(module, install)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.requirement.installed():
            raise self.requirement.missing(_qualname(self.factory))
        return self.factory(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Requires({_qualname(self.factory)}, module={self.requirement.module!r})"


def _qualname(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__name__


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    factory: Callable[..., Any]
    options: type | None  # a dataclass type declaring the component's options, or None
    description: str
    plugin: str  # the plugin's name in the plugin manager
    distribution: str | None  # the installed distribution that provides the plugin ("palestra" for built-ins)

    @property
    def requires(self) -> Requirement | None:
        """The optional package the component needs (its factory is a :class:`Requires`), or None."""
        return self.factory.requirement if isinstance(self.factory, Requires) else None

    @property
    def available(self) -> bool:
        """False when the component needs a package that is not installed."""
        return self.requires is None or self.requires.installed()

    def check_available(self) -> None:
        """Raise :class:`RegistryError` (one line, with the install command) when :attr:`available` is False."""
        if self.requires is not None and not self.requires.installed():
            # a lookup that fails (so a config names the culprit key), worded as the component's MissingDependency
            raise RegistryError(str(self.requires.missing(f"{self.kind} {self.name!r}")))


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that failed to import or raised in a registration hook."""

    plugin: str
    distribution: str | None
    error: str


@dataclass
class Registry:
    _items: dict[tuple[str, str], Registration] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)

    def add(self, reg: Registration) -> None:
        if reg.kind not in KINDS:
            raise RegistryError(f"unknown component kind {reg.kind!r}")
        key = (reg.kind, reg.name)
        prior = self._items.get(key)
        if prior is not None:
            raise RegistryError(
                f"{reg.kind} {reg.name!r} is registered twice: by plugin {_who(prior)} and by plugin {_who(reg)}"
            )
        self._items[key] = reg

    def get(self, kind: str, name: str) -> Registration:
        """The registration of ``kind`` ``name``; a one-line :class:`RegistryError` when there is none, or when it
        needs an optional package that is not installed (naming the package and its install command)."""
        reg = self._items.get((kind, name))
        if reg is not None:
            reg.check_available()
            return reg
        known = self.names(kind)
        msg = f"no {kind} named {name!r}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        elif known:
            msg += f" (known: {', '.join(known)})"
        if self.broken:
            msg += "; " + "; ".join(
                f"plugin {b.distribution or b.plugin!r} failed to load, so anything it provides is missing: {b.error}"
                for b in self.broken
            )
        raise RegistryError(msg)

    def names(self, kind: str) -> list[str]:
        return sorted(n for (k, n) in self._items if k == kind)

    def by_plugin(self, plugin: str) -> list[Registration]:
        return [r for r in self._items.values() if r.plugin == plugin]

    def __iter__(self) -> Iterator[Registration]:
        return iter(self._items.values())

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._items


def _who(reg: Registration) -> str:
    return f"{reg.plugin!r}" + (f" (distribution {reg.distribution!r})" if reg.distribution else "")
