"""Reading a config: a YAML or TOML file over the built-in default, then dotted ``key=value`` overrides, then validation."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from palestra.registry import Registry

from .errors import ConfigError
from .schema import Config
from .validation import _ACTIVE_REGISTRY, _Override, _convert, _join, _kind_of, default_registry, to_plain

# ---- loading -----------------------------------------------------------------------------------------
def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, registry: Registry | None = None
) -> Config:
    """Read a YAML or TOML file (the built-in default when ``path`` is None), apply ``key=value`` overrides, validate."""
    raw = to_plain(Config())
    if path is not None:
        raw.update(read_config_file(path))  # sections the file names replace the defaults wholesale
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(raw, keys, value)
    return validate_config(raw, registry=registry)


def validate_config(raw: Mapping[str, Any], *, registry: Registry | None = None) -> Config:
    """Check plain config data against :class:`Config` and every component's options; return the typed tree."""
    token = _ACTIVE_REGISTRY.set(registry or _ACTIVE_REGISTRY.get() or default_registry())
    try:
        return _convert(raw, Config, "")
    finally:
        _ACTIVE_REGISTRY.reset(token)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's top-level mapping; ``.yaml``/``.yml`` or ``.toml``."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"config file {str(p)!r}: unknown format {suffix or '(no suffix)'!r}; use .yaml, .yml or .toml")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    if suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise ConfigError(f"config file {str(p)!r}: reading TOML needs Python 3.11+ or the tomli package") from None
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections ({', '.join(f.name for f in dataclasses.fields(Config))}), "
            f"got {_kind_of(data)}"
        )
    return dict(data)


# ---- overrides ---------------------------------------------------------------------------------------
_KEY = r"[A-Za-z_][A-Za-z0-9_\-]*"
_OVERRIDE_KEY = re.compile(rf"^{_KEY}(\[\d+\])*(\.{_KEY}(\[\d+\])*)*$")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``"train.lr=3e-4"`` -> (["train", "lr"], value). Values are YAML (scalars, ``[a, b]`` lists, ``{k: v}``)."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value (for example train.lr=3e-4)")
    if not _OVERRIDE_KEY.match(key):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key (for example reward.options.layers[1].weight)")
    keys: list[str | int] = []
    for part in key.split("."):
        name, *indices = re.split(r"\[", part)
        keys.append(name)
        keys.extend(int(i.rstrip("]")) for i in indices)
    try:
        parsed = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot parse the value: {getattr(e, 'problem', None) or e}") from None
    value = parsed if isinstance(parsed, (list, dict)) else _Override(value_text.strip(), parsed)
    return keys, value


def _set_path(raw: dict[str, Any], keys: list[str | int], value: Any) -> None:
    node: Any = raw
    for depth, key in enumerate(keys[:-1]):
        where = _format_path(keys[: depth + 1])
        nxt = keys[depth + 1]
        if isinstance(key, int):
            if not isinstance(node, list):
                raise ConfigError(f"{where}: {_format_path(keys[:depth])} is not a list, so it cannot be indexed")
            if key >= len(node):
                raise ConfigError(f"{where}: index out of range (the list has {len(node)} items)")
            child = node[key]
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {_format_path(keys[:depth])} is not a mapping")
            child = node.get(key)
            if child is None:
                if isinstance(nxt, int):
                    raise ConfigError(f"{_format_path(keys[: depth + 2])}: {where} is not a list in this config")
                child = node[key] = {}
        if isinstance(nxt, int) and not isinstance(child, list):
            raise ConfigError(f"{_format_path(keys[: depth + 2])}: {where} is {_kind_of(child)}, not a list")
        if isinstance(nxt, str) and not isinstance(child, dict):
            raise ConfigError(f"{_format_path(keys[: depth + 2])}: {where} is {_kind_of(child)}, not a mapping")
        node = child
    last = keys[-1]
    if isinstance(last, int):
        if last >= len(node):
            raise ConfigError(f"{_format_path(keys)}: index out of range (the list has {len(node)} items)")
        node[last] = value
    else:
        node[last] = value


def _format_path(keys: Sequence[str | int]) -> str:
    out = ""
    for key in keys:
        out = f"{out}[{key}]" if isinstance(key, int) else _join(out, key)
    return out


