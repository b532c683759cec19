"""Draw a run's metrics (``RUN_DIR/metrics.jsonl``, written by the jsonl logger) as a PNG dashboard.

Writes ``RUN_DIR/dashboard.png`` (or ``--out FILE``) and prints the path of the image.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory holding metrics.jsonl (or the .jsonl file itself)"
    )
    parser.add_argument(
        "--out", metavar="FILE", default=None, help="where to write the PNG (default: RUN_DIR/dashboard.png)"
    )


def run(args: argparse.Namespace) -> int:
    from palestra.cli.dashboard import plot_dashboard  # matplotlib loads only when drawing

    print(plot_dashboard(args.run_dir, args.out))
    return 0
