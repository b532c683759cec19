"""What plugins registered: components by kind and name, each with the plugin that registered it."""

from __future__ import annotations

import difflib
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
}


class RegistryError(LookupError):
    """A component is missing or registered twice. The message is one line naming the culprit."""

    palestra_user_error = True

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    factory: Callable[..., Any]
    options: type | None  # a dataclass type declaring the component's options, or None
    description: str
    plugin: str  # the plugin's name in the plugin manager
    distribution: str | None  # the installed distribution that provides the plugin ("palestra" for built-ins)


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
        reg = self._items.get((kind, name))
        if reg is not None:
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
