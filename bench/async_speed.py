"""Steps per hour of a run with ``train.async`` against the same run synchronous, on the same cores, in turn.

Each side is a real ``palestra train`` of ``--config`` for ``--steps`` steps (a fresh run folder each), alternately
``--reps`` times. The synchronous side takes ``--threads`` CPU threads; the asynchronous side splits them, ``--threads``
minus ``--worker-threads`` for the learner and ``--worker-threads`` for the rollout worker. The figure is the median
step time over steps 2..N (step 1 of an asynchronous run waits for its first batch), turned into steps per hour,
and their ratio; the whole command's wall time and the per-part breakdown are kept too.

    python bench/async_speed.py --config examples/smollm2_calculator.yaml --steps 4 \\
        --out bench/results/async_speed_smollm2_calculator.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from busy_machine import cpu_kind, user_env  # bench/: the CPU model (AMX or not); an environment without OMP_*

PARTS = ("perf/generate_s", "perf/score_s", "perf/update_s", "perf/learner_wait_s", "perf/worker_generate_s")


def one_run(config: Path, steps: int, threads: int, worker_threads: int | None, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        args = [
            f"train.steps={steps}",
            f"train.threads={threads if worker_threads is None else threads - worker_threads}",
            f"run.output_dir={folder}",
            "run.name=r",
            "train.save_every=0",
            "loggers=[{name: jsonl, options: {filename: log.jsonl}}]",
            *extra,
        ]
        if worker_threads is not None:
            args.append(f"train.async={{lag: 1, threads: {worker_threads}}}")
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "palestra", "train", "--config", str(config), *args],
            env=user_env(None),
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - started
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        lines = [json.loads(x) for x in (Path(folder) / "r" / "log.jsonl").read_text().splitlines()]
    steps_logged = [m for m in lines if "perf/step_s" in m]
    steady = [m["perf/step_s"] for m in steps_logged[1:]]
    return {
        "wall_s": wall,
        "step_s": [m["perf/step_s"] for m in steps_logged],
        "median_step_s": statistics.median(steady),
        "parts_median": {
            k: statistics.median(m[k] for m in steps_logged[1:]) for k in PARTS if all(k in m for m in steps_logged)
        },
        "policy_lag": [m.get("rollout/policy_lag") for m in steps_logged],
        "tokens_per_s_steps": [m["perf/tokens_per_s"] for m in steps_logged],
        "gen_tokens_per_s_steps": [m["perf/gen_tokens_per_s"] for m in steps_logged],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="more key=value overrides for both sides")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for _ in range(args.reps):
        runs["sync"].append(one_run(args.config, args.steps, args.threads, None, args.set))
        runs["async"].append(one_run(args.config, args.steps, args.threads, args.worker_threads, args.set))
    median = {k: statistics.median(r["median_step_s"] for r in v) for k, v in runs.items()}
    result = {
        "cpu": cpu_kind(),
        "config": str(args.config),
        "steps": args.steps,
        "threads": args.threads,
        "worker_threads": args.worker_threads,
        "overrides": args.set,
        "median_step_s": median,
        "steps_per_hour": {k: 3600 / v for k, v in median.items()},
        "async_speedup": median["sync"] / median["async"],
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
