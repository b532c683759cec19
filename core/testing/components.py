"""What a check is given: a registered name or a factory, turned into fresh instances on demand.

Several rules need more than one instance (determinism: two fresh ones must agree; ``state_dict``: a second
one must continue from the first's state), so a check holds a way to *make* the component, not the component.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Subject", "subject"]


@dataclass(frozen=True)
class Subject:
    """One component under test: its kind, the label failures name it by, and a maker of fresh instances."""

    kind: str
    label: str
    make: Callable[[], Any]


def subject(
    kind: str, component: str | Callable[..., Any], options: Mapping[str, Any] | None = None, *, name: str | None = None
) -> Subject:
    """A :class:`Subject` for a registered ``component`` name (built through the registry, options validated as a
    config would be) or for a factory called with ``options`` as keyword arguments.

    Rewards are checked as the plugin wrote them: the :class:`~palestra.checked_reward.CheckedReward` the
    registry wraps them in is taken off, since it would hide the very mistakes the kit looks for (it converts a
    list to a tensor, for one).
    """
    opts = dict(options or {})
    if isinstance(component, str):
        from palestra.config import build_component

        spec = {"name": component, "options": opts}

        def make() -> Any:
            built = build_component(kind, spec, path=kind)
            return _unwrapped(built)

        return Subject(kind, name or component, make)
    if callable(component):
        label = name or getattr(component, "__name__", None) or type(component).__name__
        return Subject(kind, label, lambda: component(**opts))
    raise TypeError(f"palestra.testing: expected a registered {kind} name or a factory, got {type(component).__name__}")


def _unwrapped(component: Any) -> Any:
    from palestra.checked_reward import CheckedReward

    return component.reward if isinstance(component, CheckedReward) else component
