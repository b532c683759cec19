"""List installed plugins: their distribution and version, the hooks they implement and what they register.

Third-party plugins only by default (``--all`` adds palestra's built-ins); a plugin that failed to load is
listed with its error. The table starts with the plugin API version palestra provides, and each plugin's
declared API range (``PALESTRA_PLUGIN_API``) shows with its version. ``--json`` prints a JSON list, one object per
plugin (with ``api``, its declared range, and ``plugin_api``, palestra's), for scripts.

A component that needs an optional package that is not installed is listed as unavailable, with the command
that installs it (in the table after its name; in JSON under ``unavailable``, one object per component).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from palestra import __version__
from palestra.hookspecs import PLUGIN_API
from palestra.plugin_manager import PluginInfo, get_registry, plugin_infos
from palestra.registry import KINDS, Registry

# kind -> the plural used as a JSON key and a heading ("environment" -> "environments").
PLURALS = {kind: hook.removeprefix("register_") for kind, hook in KINDS.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="include palestra's built-in plugins")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows = [describe(info, registry) for info in plugin_infos() if args.all or not info.builtin]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"palestra {__version__}, plugin API {PLUGIN_API}")
    if rows:
        print(format_table(rows))
    else:
        print("No third-party plugins are installed (palestra plugins --all also lists the built-ins).")
    return 0


def describe(info: PluginInfo, registry: Registry) -> dict[str, Any]:
    """One plugin as a JSON-ready dict: who it is, its hooks, and the names it registered by kind."""
    row: dict[str, Any] = {
        "name": info.name,
        "distribution": info.distribution,
        "version": info.version,
        "module": info.module,
        "builtin": info.builtin,
        "hooks": list(info.hooks),
        "api": info.api,
        "plugin_api": PLUGIN_API,
    }
    mine = registry.by_plugin(info.name) if info.error is None else []
    for kind, plural in PLURALS.items():
        row[plural] = sorted(reg.name for reg in mine if reg.kind == kind)
    row["unavailable"] = [
        {"kind": reg.kind, "name": reg.name, "requires": reg.requires.module, "install": reg.requires.install}
        for reg in sorted(mine, key=lambda r: (r.kind, r.name))
        if reg.requires is not None and not reg.available
    ]
    row["error"] = info.error
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table; a plugin with several hooks or components takes several lines."""
    header = ("PLUGIN", "DISTRIBUTION", "VERSION", "HOOKS", "REGISTERS")
    lines: list[tuple[str, ...]] = []
    for row in rows:
        name = row["name"] + (" (built-in)" if row["builtin"] else "")
        if row["error"] is not None:
            provides = [f"FAILED: {row['error']}"]
        else:
            missing = {(u["kind"], u["name"]): u for u in row["unavailable"]}
            provides = [
                f"{plural}: " + ", ".join(_shown(kind, name, missing) for name in row[plural])
                for kind, plural in PLURALS.items()
                if row[plural]
            ]
        hooks = row["hooks"]
        for i in range(max(len(hooks), len(provides), 1)):
            first = i == 0
            lines.append(
                (
                    name if first else "",
                    (row["distribution"] or "-") if first else "",
                    ((row["version"] or "-") + (f" (API {row['api']})" if row["api"] else "")) if first else "",
                    hooks[i] if i < len(hooks) else ("-" if first else ""),
                    provides[i] if i < len(provides) else ("-" if first else ""),
                )
            )
    # The last column is left ragged: it holds error messages that can be long.
    widths = [max(len(r[c]) for r in [header, *lines]) for c in range(len(header) - 1)]
    return "\n".join(
        ("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in [header, *lines]
    )


def _shown(kind: str, name: str, missing: dict[tuple[str, str], dict[str, str]]) -> str:
    """A component's name, with ``(unavailable: <install command>)`` when its optional package is missing."""
    gap = missing.get((kind, name))
    return name if gap is None else f"{name} (unavailable: {gap['install']})"
