"""Building a component from its validated config node through the plugin registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from palestra.registry import Registry

from .errors import ComponentBuildError, ConfigError
from .schema import ComponentSpec, SPEC_TYPES
from .validation import _ACTIVE_REGISTRY, _convert, _init_fields, _lookup, default_registry, to_plain


def build_component(kind: str, spec: ComponentSpec | Mapping[str, Any], *, path: str, registry: Registry | None = None) -> Any:
    """Build the registered ``kind`` component that the config node ``spec`` names, with its validated options.

    ``spec`` is a validated :class:`ComponentSpec` (from :func:`load_config`) or plain ``{name, options}``
    data (validated here, errors naming ``path``). Rewards come back wrapped in
    :class:`palestra.engine.checked_reward.CheckedReward`, so every call's output is checked. Components nested in the
    options (a combinator's terms) are built through the same registry.
    """
    if kind not in SPEC_TYPES:
        raise ConfigError(f"{path}: unknown component kind {kind!r}; the kinds are {', '.join(SPEC_TYPES)}")
    registry = registry or _ACTIVE_REGISTRY.get() or default_registry()
    token = _ACTIVE_REGISTRY.set(registry)
    try:
        if not (isinstance(spec, ComponentSpec) and spec.path and spec.KIND == kind):
            spec = _convert(to_plain(spec), SPEC_TYPES[kind], path)
        assert isinstance(spec, ComponentSpec)
        reg = _lookup(registry, kind, spec.name, path)
        opts = spec.options
        kwargs = {f.name: getattr(opts, f.name) for f in _init_fields(type(opts))} if opts is not None else {}
        try:
            component = reg.factory(**kwargs)
        except ConfigError:
            raise
        except Exception as e:
            who = f"plugin {reg.plugin!r}" + (f", distribution {reg.distribution!r}" if reg.distribution else "")
            raise ComponentBuildError(f"{path}: building {kind} {spec.name!r} ({who}) failed: {type(e).__name__}: {e}") from e
    finally:
        _ACTIVE_REGISTRY.reset(token)
    if kind == "reward":
        from palestra.engine.checked_reward import CheckedReward

        if not isinstance(component, CheckedReward):
            component = CheckedReward(component, name=spec.name, path=path)
    return component
