"""What REINFORCE's experience replay buys in sample efficiency on the built-in task.

    python bench/replay_study.py                                    # off vs on, seeds 0 1 2, examples/reinforce.yaml
    python bench/replay_study.py --variants off c4r32 c8r64 --seeds 0 1 2 --eval-every 50 \\
        --out bench/results/replay_study.json

Each variant is a set of overrides on ``examples/reinforce.yaml`` (the replay options of ``reinforce``:
``replay_capacity`` batches kept, ``replay_rows`` of their rows added to every update, importance weights
truncated at ``replay_is_clip``). Every run evaluates the held-out set every ``--eval-every`` steps, so the
table has held-out reward against steps and against rows *sampled* from the environment (steps x batch_size x
group_size: replay adds trained rows, not sampled ones), plus the rows *trained* and the wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robustness import run_one

VARIANTS: dict[str, list[str]] = {
    "off": ["optimizer.options.replay_capacity=0", "optimizer.options.replay_rows=0"],
    "c4r32": ["optimizer.options.replay_capacity=4", "optimizer.options.replay_rows=32"],
    "c4r128": ["optimizer.options.replay_capacity=4", "optimizer.options.replay_rows=128"],
    "c8r64": ["optimizer.options.replay_capacity=8", "optimizer.options.replay_rows=64"],
    "c4r128_is2": [
        "optimizer.options.replay_capacity=4",
        "optimizer.options.replay_rows=128",
        "optimizer.options.replay_is_clip=2.0",
    ],
    # the GRPO family: only rows with a non-zero advantage are kept (replay_informative_only)
    "c4r128i": [
        "optimizer.options.replay_capacity=4",
        "optimizer.options.replay_rows=128",
        "optimizer.options.replay_informative_only=true",
    ],
    "c16r128i": [
        "optimizer.options.replay_capacity=16",
        "optimizer.options.replay_rows=128",
        "optimizer.options.replay_informative_only=true",
    ],
    "c16r512": ["optimizer.options.replay_capacity=16", "optimizer.options.replay_rows=512"],
    "c16r512i": [
        "optimizer.options.replay_capacity=16",
        "optimizer.options.replay_rows=512",
        "optimizer.options.replay_informative_only=true",
    ],
}


def first_step_reaching(curve: list[dict[str, Any]], threshold: float) -> int | None:
    return next((p["step"] for p in curve if p["reward"] >= threshold), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="reinforce")
    parser.add_argument("--variants", nargs="+", default=["off", "c4r128"], choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threshold", type=float, default=1.8, help="held-out reward counted as solved (max 2)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    runs: list[dict[str, Any]] = []
    for name in args.variants:
        for seed in args.seeds:
            r = run_one(args.config, seed, [*VARIANTS[name], *args.set], eval_every=args.eval_every)
            replay = next((int(o.split("=")[1]) for o in VARIANTS[name] if "replay_rows=" in o), 0)
            r.pop("history")
            r["variant"] = name
            r["solved_step"] = first_step_reaching(r["curve"], args.threshold)
            runs.append(r)
            print(
                f"{name:<10} seed {seed}: reward {r['reward']:.3f} correctness {r['correctness']:.3f} "
                f"solved at step {r['solved_step']} ({r['seconds']:.0f} s) replayed rows/step {replay}",
                flush=True,
            )
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"threshold": args.threshold, "runs": runs}, indent=1))
    print()
    print(table(runs, args.threshold))
    return 0


def table(runs: list[dict[str, Any]], threshold: float) -> str:
    """Markdown: per variant, the mean held-out reward at each evaluation step and the steps to ``threshold``."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    steps = sorted({p["step"] for r in runs for p in r["curve"]} | {r["steps"] for r in runs})
    head = "| variant | " + " | ".join(f"step {s}" for s in steps) + f" | steps to {threshold:g} (per seed) | time |"
    lines = [head, "| --- " * (len(steps) + 3) + "|"]
    for name, rs in by.items():
        cells = []
        for s in steps:
            vals = [p["reward"] for r in rs for p in r["curve"] if p["step"] == s]
            vals += [r["reward"] for r in rs if r["steps"] == s]
            cells.append(f"{statistics.mean(vals):.2f}" if vals else "-")
        solved = ", ".join(str(r["solved_step"]) if r["solved_step"] else "-" for r in rs)
        secs = statistics.mean(r["seconds"] for r in rs)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {solved} | {secs:.0f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
