"""Checking plain data against the config dataclasses and the options every component registered, with
one-line errors naming the key by its full path; :func:`to_plain` goes back to plain data."""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import numbers
import reprlib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union

from palestra.errors import ConfigError, OptionError
from palestra.registry import Registration, Registry, RegistryError

from .schema import ComponentSpec

# ---- the registry used for validation and building ---------------------------------------------------
_ACTIVE_REGISTRY: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("palestra_registry", default=None)


def default_registry() -> Registry:
    """The registry of the installed plugins (built by the plugin manager, cached there)."""
    from palestra.plugin_manager import get_registry

    return get_registry()


def _registry() -> Registry:
    return _ACTIVE_REGISTRY.get() or default_registry()


@dataclass(frozen=True)
class _Override:
    """An override's value: parsed as a YAML scalar, but the literal text is kept for fields typed ``str``."""

    text: str
    parsed: Any


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---- validation --------------------------------------------------------------------------------------
def check_options(cls: type, values: Mapping[str, Any], *, where: str) -> Any:
    """Validate ``values`` against the dataclass ``cls`` the way configs are (used when building in Python)."""
    return _convert(dict(values), cls, where)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the type ``tp`` and return it converted (dataclasses built); ConfigError otherwise."""
    if isinstance(value, _Override):
        value = value.text if _wants_text(tp) else value.parsed
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _convert_union(value, tp, path)
    if origin is Literal:
        return _convert_literal(value, typing.get_args(tp), path)
    if origin in (list, tuple, Sequence):
        return _convert_list(value, tp, path)
    if origin in (dict, Mapping) or tp is dict:
        return _convert_dict(value, tp, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected a boolean (true or false), got {_show(value)}")
    if tp is int:
        number = _number(value)
        if number is None or (isinstance(number, float) and not number.is_integer()):
            raise ConfigError(f"{path}: expected an integer, got {_show(value)}")
        return int(number)
    if tp is float:
        number = _number(value)
        if number is None:
            raise ConfigError(f"{path}: expected a float, got {_show(value)}")
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite float, got {_show(value)}")
        return float(number)
    if tp is str:
        if isinstance(value, str):
            return value
        hint = " (quote it)" if isinstance(value, (int, float)) else ""
        raise ConfigError(f"{path}: expected a string, got {_show(value)}{hint}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{path}: expected {tp.__name__}, got {_show(value)}")
    raise ConfigError(
        f"{path}: cannot check values of type {tp!r} (an options dataclass uses an unsupported annotation)"
    )


def _wants_text(tp: Any) -> bool:
    """Should an override's literal text be used (rather than its YAML reading) for a field typed ``tp``?"""
    if tp is str:
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return len(args) == 1 and _wants_text(args[0])
    return False


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value.strip()) if value.strip() else None
        except ValueError:
            return None
    return None


def _convert_union(value: Any, tp: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if (value is None or (isinstance(value, str) and value in ("null", "~", "None"))) and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:
        return _convert(value, members[0], path)
    for member in members:
        try:
            return _convert(value, member, path)
        except ConfigError:
            continue
    raise ConfigError(f"{path}: expected {' or '.join(_describe(m) for m in args)}, got {_show(value)}")


def _convert_literal(value: Any, choices: tuple[Any, ...], path: str) -> Any:
    for choice in choices:
        if value == choice and type(value) is type(choice):
            return choice
    msg = f"{path}: expected one of {', '.join(repr(c) for c in choices)}, got {_show(value)}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
    raise ConfigError(msg)


def _convert_list(value: Any, tp: Any, path: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {_show(value)}")
    args = typing.get_args(tp)
    item_tp = args[0] if args else Any
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item_tp = args[0]
    return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]


def _convert_dict(value: Any, tp: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
    args = typing.get_args(tp)
    value_tp = args[1] if len(args) == 2 else Any
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise ConfigError(f"{path}: keys must be strings, got {_show(k)}")
        out[k] = _convert(v, value_tp, _join(path, k))
    return out


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def config_key(f: dataclasses.Field[Any]) -> str:
    """The name field ``f`` has in a config: its declared ``key`` (``train.async``), else the field's name."""
    key = f.metadata.get("key") if f.metadata else None
    return key if isinstance(key, str) else f.name


def _convert_dataclass(value: Any, cls: type, path: str) -> Any:
    if isinstance(value, cls):  # already checked (built in Python, or by an outer validation)
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_show(value)}")
    flds = _init_fields(cls)
    names = [config_key(f) for f in flds]
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'config'}: keys must be strings, got {_show(key)}")
        if key not in names:
            raise ConfigError(f"{_join(path, key)}: unknown key{_suggest(key, names)}")
    hints = _hints(cls)
    is_spec = issubclass(cls, ComponentSpec)
    kwargs: dict[str, Any] = {}
    for f in flds:
        fpath = _join(path, config_key(f))
        if is_spec and f.name == "options":
            continue  # checked below, against the options the named component registered
        if config_key(f) in value:
            v = value[config_key(f)]
        elif f.default is not MISSING:
            v = to_plain(f.default)
        elif f.default_factory is not MISSING:
            v = to_plain(f.default_factory())
        else:
            raise ConfigError(f"{fpath}: missing required key")
        kwargs[f.name] = _check_bounds(_convert(v, hints[f.name], fpath), f, fpath)
    if is_spec:
        kwargs["options"] = _convert_component_options(cls, kwargs["name"], value.get("options"), path)
    try:
        obj = cls(**kwargs)
    except OptionError as e:
        raise ConfigError(f"{_join(path, e.key) if not e.key.startswith('[') else path + e.key}: {e.message}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None
    if is_spec:
        obj.path = path
    return obj


def _convert_component_options(cls: type[ComponentSpec], name: str, options: Any, path: str) -> Any:
    kind = cls.KIND
    reg = _lookup(_registry(), kind, name, path)
    opath = _join(path, "options")
    if reg.options is None:
        if options and not (dataclasses.is_dataclass(options)):
            keys = list(options) if isinstance(options, Mapping) else options
            raise ConfigError(f"{opath}: {kind} {name!r} takes no options, got {_show(keys)}")
        return None
    if isinstance(options, reg.options):
        return options
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{opath}: expected a mapping of options for {kind} {name!r}, got {_show(options)}")
    return _convert(options, reg.options, opath)


def _lookup(registry: Registry, kind: str, name: str, path: str) -> Registration:
    if not name:
        known = ", ".join(registry.names(kind)) or "none are installed"
        raise ConfigError(f"{_join(path, 'name')}: is empty; name a registered {kind} ({known})")
    try:
        return registry.get(kind, name)
    except RegistryError as e:
        extra = "" if registry.names(kind) else f"; the installed plugins register no {kind}"
        raise ConfigError(f"{_join(path, 'name')}: {e}{extra}") from None


def _check_bounds(value: Any, f: dataclasses.Field[Any], path: str) -> Any:
    bounds = f.metadata.get("bounds") if f.metadata else None
    if not bounds or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    checks = {
        "ge": (lambda a, b: a >= b, ">="),
        "gt": (lambda a, b: a > b, ">"),
        "le": (lambda a, b: a <= b, "<="),
        "lt": (lambda a, b: a < b, "<"),
    }
    for key, bound in bounds.items():
        ok, sign = checks[key]
        if not ok(value, bound):
            raise ConfigError(f"{path}: must be {sign} {bound}, got {value!r}")
    return value


def _suggest(key: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (known keys: {', '.join(names)})" if names else " (no keys are allowed here)"


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a float", str: "a string", bool: "a boolean", type(None): "null"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return "a list"
    if origin in (dict, Mapping) or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", repr(tp))


def _kind_of(value: Any) -> str:
    if isinstance(value, _Override):
        value = value.parsed
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"{value!r}"


def _show(value: Any) -> str:
    """``value`` in at most 80 characters; bounded while it is written, not after (a huge value never becomes text)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 4, 100, 100, 100
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 12


# ---- plain data --------------------------------------------------------------------------------------
def to_plain(obj: Any) -> Any:
    """Dataclasses (config sections, specs, options) -> dicts; lists/tuples -> lists; scalars unchanged."""
    if isinstance(obj, _Override):
        return obj.parsed
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {config_key(f): to_plain(getattr(obj, f.name)) for f in _init_fields(type(obj))}
        if isinstance(obj, ComponentSpec) and out.get("options") is None:
            out["options"] = {}
        return out
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def format_fields(key: str, template: str) -> list[str]:
    """The ``{field}`` names of a ``str.format`` template option; a one-line :class:`OptionError` naming ``key`` when
    it is not a format string (an unmatched brace, say). Callers check the names against what they provide."""
    import string

    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise OptionError(key, f"is not a format string: {e}") from None
