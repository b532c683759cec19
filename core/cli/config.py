"""Show the resolved configuration: the file (or the built-in default), overrides applied, every default filled in."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from palestra.config import ConfigError, load_config
from palestra.config.loading import CONFIG_SUFFIXES, is_override_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the resolved config as YAML",
        description="Print the resolved config as YAML: FILE (.yaml/.yml/.toml; the built-in task when omitted) "
        "with key=value overrides applied and every component's options filled in with their defaults.",
    )
    show.add_argument(
        "items",
        nargs="*",
        metavar="[FILE] [key=value ...]",
        help="a config file, then dotted overrides such as train.lr=3e-4",
    )


def split_file_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """``[FILE] [key=value ...]``: the first item is the file when it is not an override."""
    if items and "=" not in items[0]:
        first = items[0]
        # `train.steps` (a key without its value) would otherwise be read as a file with the suffix ".steps"
        if is_override_key(first) and Path(first).suffix.lower() not in CONFIG_SUFFIXES and not Path(first).exists():
            raise ConfigError(
                f"{first!r} is not a config file ({', '.join(CONFIG_SUFFIXES)}) and not an override: "
                f"overrides are key=value, e.g. {first}=VALUE"
            )
        return first, items[1:]
    return None, items


def run(args: argparse.Namespace) -> int:
    path, overrides = split_file_and_overrides(args.items)
    config = load_config(path, overrides)
    print(yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False), end="")
    return 0
