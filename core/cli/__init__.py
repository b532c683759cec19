"""The ``palestra`` command: train | export | plugins | config | bench | plot | doctor | new.

Each subcommand lives in ``palestra.cli.<name>`` and is imported only when used, so
``palestra --help`` stays fast. A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from palestra import __version__

# name -> one-line help; the module palestra.cli.<name> does the work.
COMMANDS = {
    "train": "train a policy (default: the built-in task)",
    "export": "write a run's trained policy as a transformers folder",
    "plugins": "list installed plugins and what they register",
    "config": "show the resolved configuration",
    "bench": "benchmark the kernels against baselines",
    "plot": "draw a run's metrics as a PNG dashboard",
    "doctor": "check the toolchain, kernels, data pipeline and one training step",
    "new": "write a new plugin package to start from (palestra new plugin NAME)",
}


class UsageError(Exception):
    """A problem with what the user asked for; printed as one line, exit status 2."""


_default_formatwarning = warnings.formatwarning


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Palestra's own warnings (a disabled plugin) read as one line on the command line, without a source excerpt."""
    if category.__module__.startswith("palestra."):
        return f"palestra: warning: {message}\n"
    return _default_formatwarning(message, category, filename, lineno, line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="palestra", description="Palestra: an RL gym for language models.")
    parser.add_argument("--version", action="version", version=f"palestra {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"palestra.cli.{name}")
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    previous_formatwarning, warnings.formatwarning = warnings.formatwarning, _format_warning
    try:
        return int(args._module.run(args) or 0)
    except Exception as e:
        # Config and plugin errors are written to be read as one line: show just that line. Exceptions
        # flag it with palestra_user_error (RegistryError is a LookupError, PluginError a RuntimeError).
        flagged = getattr(e, "palestra_user_error", None)
        if not (flagged or (flagged is None and isinstance(e, (UsageError, ValueError, FileNotFoundError)))):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"palestra {args.command}: error: {msg}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = previous_formatwarning


if __name__ == "__main__":
    sys.exit(main())
