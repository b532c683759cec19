"""Every tiny example config x seeds on the built-in task: final held-out reward and correctness, fraction of max, time.

    python bench/robustness.py                                   # the ten tiny examples + the default, seeds 0 1 2
    python bench/robustness.py --configs grpo ppo --seeds 0 1 --set train.steps=300
    python bench/robustness.py --out bench/results/robustness.json

Each run is one process-local :class:`~palestra.engine.trainer.Trainer` on one thread, runs one after another
(the CI machine has two shared cores). ``default`` is what ``palestra train`` runs with no ``--config``.
The held-out evaluation is the trainer's own (greedy, ``train.eval_size`` tasks, every reward layer counted).

Other bench scripts (collapse_study.py, replay_study.py) reuse :func:`run_one`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("grpo", "ppo", "reinforce", "rloo", "reinforce_pp", "dr_grpo", "dapo", "gspo", "cispo", "hundred_facts")
CONFIGS = (*EXAMPLES, "default")

# The built-in sums with the answer as the first and only completion token, scored by exact correctness (no tag,
# no format layer): the control of docs/learning.md's hypothesis (g), and the CI learning test's task.
BARE_ANSWER = ["reward.name=correctness", "reward.options.tag=null", "train.max_new_tokens=1"]


def config_path(name: str) -> Path | None:
    """The example file for ``name``; None for ``default`` (the built-in config ``palestra train`` uses)."""
    return None if name == "default" else ROOT / "examples" / f"{name}.yaml"


def run_one(
    name: str,
    seed: int,
    overrides: list[str] = (),  # type: ignore[assignment]
    *,
    eval_every: int = 0,
    trainer_hook: Any = None,
) -> dict[str, Any]:
    """Train config ``name`` with ``run.seed=seed`` and ``overrides``; return the held-out results and the history.

    ``trainer_hook(trainer)`` runs once the trainer is built (a study script instruments the run there). The
    run writes into a temporary directory that is deleted afterwards; loggers are off (the history is returned).
    """
    import torch

    from palestra.config import load_config
    from palestra.engine.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            config_path(name),
            [f"run.seed={seed}", f"run.output_dir={tmp}", "loggers=[]", f"train.eval_every={eval_every}", *overrides],
        )
        trainer = Trainer(config, run_dir=Path(tmp) / "run")
        if trainer_hook is not None:
            trainer_hook(trainer)
        started = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - started
    after = result.after
    max_score = after.max_score
    # a layered or weighted reward reports correctness as a component (inside a weighted sum under its component's
    # label, e.g. dapo.yaml's "task/correctness"); a bare `correctness` reward is the total
    key = (
        "reward"
        if config.reward.name == "correctness"
        else next((k for k in after.components if k == "correctness" or k.endswith("/correctness")), "correctness")
    )
    history = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in result.history]
    curve = [
        {"step": i + 1, "reward": m["eval/reward"], "correctness": m.get(f"eval/{key}")}
        for i, m in enumerate(result.history)
        if "eval/reward" in m
    ]
    return {
        "config": name,
        "seed": seed,
        "overrides": list(overrides),
        "steps": config.train.steps,
        "reward": after.reward,
        "correctness": after.reward if key == "reward" else after.components.get(key),
        "max_score": max_score,
        "fraction_of_max": after.reward / max_score if max_score else None,
        "seconds": seconds,
        "curve": curve,
        "history": history,
    }


def summary_line(r: dict[str, Any]) -> str:
    c = r["correctness"]
    return (
        f"{r['config']:<13} seed {r['seed']}  reward {r['reward']:.3f}/{r['max_score']:g}  "
        f"correctness {'-' if c is None else f'{c:.3f}'}  frac {r['fraction_of_max']:.2f}  {r['seconds']:.0f} s"
    )


def table(results: list[dict[str, Any]], seeds: list[int]) -> str:
    """Markdown: one row per config, held-out reward / correctness per seed, median correctness, min fraction of max."""
    lines = [
        "| config | "
        + " | ".join(f"seed {s}: reward / correctness" for s in seeds)
        + " | median correctness | min fraction of max | mean time |",
        "| --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- |",
    ]
    by_config: dict[str, dict[int, dict[str, Any]]] = {}
    for r in results:
        by_config.setdefault(r["config"], {})[r["seed"]] = r
    for name, runs in by_config.items():
        cells = []
        for s in seeds:
            r = runs.get(s)
            cells.append("-" if r is None else f"{r['reward']:.3f} / {r['correctness']:.3f}")
        done = list(runs.values())
        med = statistics.median(r["correctness"] for r in done)
        low = min(r["fraction_of_max"] for r in done)
        secs = statistics.mean(r["seconds"] for r in done)
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {med:.3f} | {low:.2f} | {secs:.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: end only)")
    parser.add_argument("--out", type=Path, default=None, help="write every run's results (JSON)")
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw held-out correctness against steps (PNG; needs --eval-every)"
    )
    args = parser.parse_args(argv)

    results = []
    for name in args.configs:
        for seed in args.seeds:
            r = run_one(name, seed, list(args.set), eval_every=args.eval_every)
            print(summary_line(r), flush=True)
            results.append(r)
            if args.out is not None:  # written after every run: nothing is lost if a long sweep is stopped
                args.out.parent.mkdir(parents=True, exist_ok=True)
                slim = [
                    {
                        **{k: v for k, v in r.items() if k != "history"},
                        "train_reward": [m.get("reward/mean") for m in r["history"]],
                    }
                    for r in results
                ]  # the full per-step metrics would be megabytes
                args.out.write_text(json.dumps({"overrides": args.set, "runs": slim}, indent=1))
    print(table(results, args.seeds))
    if args.plot is not None:
        plot(results, args.plot, " ".join(args.set))
    return 0


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Held-out correctness against steps, one line per run (the points ``--eval-every`` recorded, then the end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        points = [(p["step"], p["correctness"]) for p in r["curve"] if p["correctness"] is not None]
        points.append((r["steps"], r["correctness"]))
        ax.plot(*zip(*points), marker=".", label=f"{r['config']} seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out correctness (greedy)")
    ax.set_ylim(0, 1)
    ax.set_title(textwrap.fill(title, 90), fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
