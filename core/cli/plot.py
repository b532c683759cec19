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
    from pathlib import Path

    from palestra.cli.dashboard import DASHBOARD_FILE, metrics_path, plot_dashboard  # matplotlib: when drawing
    from palestra.cli.export import UnwritableDestination, check_writable_destination

    source = metrics_path(args.run_dir)  # a missing run is named first
    target = Path(args.out) if args.out is not None else source.parent / DASHBOARD_FILE
    if target.is_dir():
        raise UnwritableDestination(f"--out: {str(target)!r} is a folder; name the .png file to write")
    # before the metrics are read and drawn: a place that cannot take the file is one line, not a traceback after
    if args.out is not None:
        check_writable_destination(target, "--out", what="file")
    else:
        check_writable_destination(target, "RUN_DIR", what="file", remedy="pass --out FILE in a writable folder")
    print(plot_dashboard(args.run_dir, args.out))
    return 0
