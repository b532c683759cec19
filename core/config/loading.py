"""Reading a config: a YAML or TOML file over the built-in default, then dotted ``key=value`` overrides, then
validation."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from palestra.errors import ConfigError
from palestra.registry import Registry

from .schema import Config
from .validation import _ACTIVE_REGISTRY, _convert, _join, _kind_of, _Override, default_registry, to_plain

# ---- loading -----------------------------------------------------------------------------------------
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, registry: Registry | None = None
) -> Config:
    """Read a YAML or TOML file (the built-in default when ``path`` is None), apply ``key=value`` overrides, validate.

    An override that names another component for a node (``reward.name=format``) also resets that node's
    options to the new component's defaults; ``<node>.options...`` overrides still apply, in any order.
    """
    raw = to_plain(Config())
    if path is not None:
        raw.update(read_config_file(path))  # sections the file names replace the defaults wholesale
    applied: list[tuple[list[str | int], Any]] = []
    for text in overrides:
        keys, value = parse_override(text)
        renamed = _renames_component(raw, keys, value)
        _set_path(raw, keys, value)
        if renamed:
            _reset_options(raw, keys[:-1], applied)
        applied.append((keys, value))
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
    if suffix not in CONFIG_SUFFIXES:
        raise ConfigError(
            f"config file {str(p)!r}: unknown format {suffix or '(no suffix)'!r}; use .yaml, .yml or .toml"
        )
    try:
        data_bytes = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    try:
        text = data_bytes.decode("utf-8")
    except UnicodeDecodeError as e:  # a Latin-1 or UTF-16 file: say where, not a traceback
        line = data_bytes.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{p}:{line}: not UTF-8 text (byte 0x{data_bytes[e.start]:02x} at offset {e.start}); save the file as UTF-8"
        ) from None
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            try:
                import tomli as tomllib
            except ModuleNotFoundError:
                raise ConfigError(
                    f"config file {str(p)!r}: reading TOML needs Python 3.11+ or the tomli package"
                ) from None
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    else:
        try:
            data = load_yaml(text)
        except DuplicateKeyError as e:
            raise ConfigError(
                f"{p}:{e.line}:{e.column}: {e.key}: duplicate key (first at line {e.first_line}); a key may appear once"
            ) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections "
            f"({', '.join(f.name for f in dataclasses.fields(Config))}), got {_kind_of(data)}"
        )
    return dict(data)


# ---- YAML without silent duplicates ------------------------------------------------------------------
class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice; PyYAML would silently keep the last one."""

    def __init__(self, keys: list[str | int], line: int, column: int, first_line: int) -> None:
        self.keys, self.line, self.column, self.first_line = keys, line, column, first_line
        super().__init__(f"{self.key}: duplicate key at line {line} (first at line {first_line})")

    @property
    def key(self) -> str:
        return _format_path(self.keys)


# No config nests anywhere near this deep; PyYAML composes and constructs recursively, so a file of 20,000 nested
# `[` would otherwise end in a RecursionError thousands of lines long.
MAX_YAML_DEPTH = 100
# What aliases may add to a document, in values: a few `&a [*b, *b, ...]` levels (an "alias bomb") expand
# to billions of values, which take minutes and gigabytes to copy, validate or print.
MAX_ALIAS_EXPANSION = 100_000


class YAMLTooBig(yaml.MarkedYAMLError):
    """A document nested deeper than :data:`MAX_YAML_DEPTH` or expanding past :data:`MAX_ALIAS_EXPANSION`."""


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing a document nested deeper than :data:`MAX_YAML_DEPTH` while it is composed."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YAMLTooBig(
                    problem=f"nested deeper than {MAX_YAML_DEPTH} levels", problem_mark=self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` (plain data only, no arbitrary objects) that raises :class:`DuplicateKeyError`, and
    :class:`YAMLTooBig` for a document nested too deep or whose aliases expand too far."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()  # composed, not yet constructed: keys still have their lines
        if node is None:
            return None
        _check_unique_keys(node, [], set())
        _check_alias_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_alias_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases add more than :data:`MAX_ALIAS_EXPANSION` values, or nest it deeper than
    :data:`MAX_YAML_DEPTH` (an alias inside an alias inside ...), both counted without expanding anything: each
    node's expanded size and depth once, without recursion (a recursive alias counts as one value)."""
    stats: dict[int, tuple[int, int]] = {}  # id(node) -> (values, levels) once expanded
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            stats[id(node)] = (
                1 + sum(stats[id(c)][0] for c in children),
                1 + max((stats[id(c)][1] for c in children), default=0),
            )
        elif id(node) not in stats:
            stats[id(node)] = (1, 1)  # while its children are counted
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in stats)
    values, levels = stats[id(root)]
    if levels > MAX_YAML_DEPTH:
        problem = f"its aliases nest it deeper than {MAX_YAML_DEPTH} levels"
    elif values - len(stats) > MAX_ALIAS_EXPANSION:
        problem = (
            f"its aliases expand it to {values:,} values (at most {MAX_ALIAS_EXPANSION:,} more than the text "
            "writes out are allowed)"
        )
    else:
        return
    raise YAMLTooBig(problem=problem, problem_mark=root.start_mark)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_unique_keys(node: yaml.Node, path: list[str | int], seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node already checked (and no endless walk through recursive aliases)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                # `<<: *base` merges keys that this mapping may override on purpose: not duplicates
                _check_unique_keys(value_node, path, seen)
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKeyError([*path, key], line, key_node.start_mark.column + 1, first[key])
            first[key] = line
            _check_unique_keys(value_node, [*path, key], seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, [*path, index], seen)


# ---- overrides ---------------------------------------------------------------------------------------
_KEY = r"[A-Za-z_][A-Za-z0-9_\-]*"
_OVERRIDE_KEY = re.compile(rf"^{_KEY}(\[\d+\])*(\.{_KEY}(\[\d+\])*)*$")


def is_override_key(text: str) -> bool:
    """Is ``text`` a dotted key as overrides name them (``train.lr``, ``reward.options.layers[1].weight``)?"""
    return _OVERRIDE_KEY.match(text) is not None


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``"train.lr=3e-4"`` -> (["train", "lr"], value). Values are YAML (scalars, ``[a, b]`` lists, ``{k: v}``)."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value (for example train.lr=3e-4)")
    if not _OVERRIDE_KEY.match(key):
        raise ConfigError(
            f"override {text!r}: {key!r} is not a dotted key (for example reward.options.layers[1].weight)"
        )
    keys: list[str | int] = []
    for part in key.split("."):
        name, *indices = re.split(r"\[", part)
        keys.append(name)
        keys.extend(int(i.rstrip("]")) for i in indices)
    try:
        parsed = load_yaml(value_text) if value_text.strip() else None
    except DuplicateKeyError as e:
        raise ConfigError(f"override {text!r}: {_format_path([*keys, *e.keys])}: duplicate key") from None
    except yaml.YAMLError as e:
        shown = text if len(text) <= 120 else f"{text[:100]}... ({len(text):,} characters)"
        raise ConfigError(f"override {shown!r}: cannot parse the value: {getattr(e, 'problem', None) or e}") from None
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


def _get_path(raw: Any, keys: Sequence[str | int]) -> Any:
    """The node at ``keys``, or None where the path does not exist (yet)."""
    node = raw
    for key in keys:
        if isinstance(key, int) and isinstance(node, list) and key < len(node):
            node = node[key]
        elif isinstance(key, str) and isinstance(node, dict):
            node = node.get(key)
        else:
            return None
    return node


def _renames_component(raw: dict[str, Any], keys: list[str | int], value: Any) -> bool:
    """Does this override name another component for a component node (``{name, options}``) that has options?"""
    if len(keys) < 2 or keys[-1] != "name" or not isinstance(value, _Override):
        return False
    node = _get_path(raw, keys[:-1])
    if not isinstance(node, dict) or not node.get("options"):
        return False
    old = node.get("name")
    old = old.text if isinstance(old, _Override) else old
    return isinstance(old, str) and old != value.text


def _reset_options(
    raw: dict[str, Any], node_keys: list[str | int], applied: Sequence[tuple[list[str | int], Any]]
) -> None:
    """Start a renamed component's options from the new component's defaults.

    The options the file or the built-in default gave were written for the component named before (the
    layered reward's ``layers`` mean nothing to ``format``), so keeping them would fail validation or, worse,
    quietly configure the new component. Options set by earlier overrides are the user's own: applied again.
    """
    _get_path(raw, node_keys)["options"] = {}
    prefix = [*node_keys, "options"]
    for keys, value in applied:
        if keys[: len(prefix)] == prefix:
            _set_path(raw, keys, value)


def _format_path(keys: Sequence[str | int]) -> str:
    out = ""
    for key in keys:
        out = f"{out}[{key}]" if isinstance(key, int) else _join(out, key)
    return out
