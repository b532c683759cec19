"""The same task trained two ways, in one plot: the built-in tool loop (examples/smollm2_calculator.yaml) and agent
code on the rollout endpoint (examples/agent_calculator.yaml). What docs/environments.md shows.

    python bench/plot_agent_vs_builtin.py BUILTIN_METRICS AGENT_METRICS [--out bench/results/agent_vs_builtin.png]

Each argument is a run's ``metrics.jsonl`` (or its run folder). Left: sampled correctness per step and the held-out
correctness (greedy) of both. Right: model turns per episode (the built-in loop's calls + 1; the agent's requests).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def records(path: Path) -> list[dict[str, Any]]:
    file = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def series(rows: list[dict[str, Any]], key: str, shift: float = 0.0) -> tuple[list[int], list[float]]:
    picked = [(r["step"], r[key] + shift) for r in rows if key in r]
    return [s for s, _ in picked], [v for _, v in picked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builtin", type=Path)
    parser.add_argument("agent", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_vs_builtin.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builtin, agent = records(args.builtin), records(args.agent)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left.plot(*series(builtin, "reward/correctness"), label="sampled, built-in tool loop")
    left.plot(*series(agent, "reward/correctness"), "--", label="sampled, agent on the endpoint")
    left.plot(*series(builtin, "eval/correctness"), "o", markersize=9, label="held-out, built-in (greedy)")
    left.plot(*series(agent, "eval/correctness"), "x", markersize=9, mew=2, label="held-out, agent (greedy)")
    left.set(xlabel="step", ylabel="correctness", ylim=(-0.02, 1.02), title="SmolLM2-135M, calculator: two ways")
    left.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    right.plot(*series(builtin, "tools/calls_per_episode", shift=1.0), label="built-in: calls + 1")
    right.plot(*series(agent, "agents/requests_per_episode"), "--", label="agent: requests")
    right.set(xlabel="step", ylabel="model turns per episode", title="turns")
    right.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
