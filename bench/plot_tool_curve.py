"""The learning curve of a tool-use run (examples/smollm2_calculator.yaml): what docs/tools.md shows.

    python bench/plot_tool_curve.py RUN_DIR [--baseline RUN_DIR] [--also RUN_DIR ...]
        [--out bench/results/smollm2_calculator.png]

Left: the sampled episodes' correctness and tool_format per step, with the held-out correctness (greedy) as
points (``--also``: the final evaluation of shorter runs of the same config too); with ``--baseline``, the same model
trained without the tool, dashed. Right: the tool use per step: calls per
episode, the share of calls that failed, and the malformed share.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def series(rows: list[dict[str, Any]], *keys: str) -> tuple[list[int], list[float]]:
    """The first of ``keys`` the run logged, per step (a run with one reward logs ``reward/mean`` only)."""
    key = next((k for k in keys if any(k in r for r in rows)), keys[0])
    picked = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in picked], [v for _, v in picked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--baseline", type=Path, default=None, help="the same model trained without the tool")
    parser.add_argument("--also", type=Path, action="append", default=[], help="a shorter run: its final evaluation")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "smollm2_calculator.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = records(args.run_dir)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left.plot(*series(rows, "reward/correctness"), label="correctness, sampled (with the tool)")
    left.plot(*series(rows, "reward/tool_format"), label="tool_format, sampled", alpha=0.7)
    held = series(rows, "eval/correctness")
    for run in args.also:  # shorter runs of the same config: their final evaluations
        steps, values = series(records(run), "eval/correctness")
        held = (held[0] + steps[-1:], held[1] + values[-1:])
    left.plot(*held, "o", markersize=8, label="held-out correctness, greedy (with the tool)")
    if args.baseline is not None:
        base = records(args.baseline)
        left.plot(*series(base, "reward/correctness", "reward/mean"), "--", label="correctness, sampled (no tool)")
        left.plot(*series(base, "eval/correctness", "eval/reward"), "s", label="held-out correctness, greedy (no tool)")
    left.set(xlabel="step", ylabel="share of episodes", ylim=(-0.02, 1.02), title="SmolLM2-135M learns the calculator")
    left.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    right.plot(*series(rows, "tools/calls_per_episode"), label="calls per episode")
    right.plot(*series(rows, "tools/error_rate"), label="calls that failed")
    right.plot(*series(rows, "tools/error_rate/malformed"), label="calls malformed")
    right.set(xlabel="step", title="tool use")
    right.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
