"""Training on a machine another job keeps busy: the default run's steps, quiet and next to a torch matmul loop.

On a small CPU machine shared with another job, OpenMP threads that spin while they wait made every parallel region
wait for a thread the kernel had descheduled: the quick start ran tens of times slower. Palestra now makes its
OpenMP threads wait passively and takes only the cores it finds idle (``core/scale/cpu_threads.py``). This script
measures what that buys, for a "before" install (an earlier commit, ``--before-site``: a folder holding it, as
``bench/bitwise_before_after.py --keep`` leaves one) and this checkout ("after"):

* ``palestra train`` of the default config for ``--steps`` steps, the environment as a user's (no ``OMP_*``);
* quiet, then next to another process running 2-thread float32 matmuls for the whole run;
* the time is the one ``palestra train`` prints for its training (``trained N steps in X s``), start-up apart.

The runs go one after another, never side by side, before and after alternating. Then it writes each side's busy
time as a multiple of its quiet time (the goal: at most 3x; fair sharing of 2 cores would give 2x)::

    python bench/busy_machine.py --before-site /work/bitwise-before/before/site --out bench/results/busy_machine.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY_LOOP = (
    "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True:\n    a = torch.tanh(a @ a)\n"
)
TRAINED = re.compile(r"trained (\d+) steps in ([0-9.]+) s")


def cpu_kind() -> str:
    from palestra.kernels.build import cpu_bf16_kind, cpu_model

    return f"{cpu_model()}, {'AMX' if cpu_bf16_kind() == 'amx' else 'no AMX'}, {os.cpu_count()} cores"


def user_env(site: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "PALESTRA_", "RANK"))}
    env["PYTHONPATH"] = site or ""
    env["TQDM_DISABLE"] = "1"
    return env


def train_seconds(site: str | None, steps: int, busy: bool) -> tuple[float, str]:
    """Seconds of training ``palestra train`` reports, and its thread line (empty for an install without one)."""
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env=user_env(None)) if busy else None
    try:
        if loop is not None:
            time.sleep(2.0)  # the loop is running before the run starts, as another user's job would be
        with tempfile.TemporaryDirectory() as out:
            args = [sys.executable, "-m", "palestra", "train", f"train.steps={steps}", f"run.output_dir={out}"]
            done = subprocess.run(args, env=user_env(site), capture_output=True, text=True, cwd=out, check=False)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    found = TRAINED.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"palestra train failed ({done.returncode}): {done.stderr[-2000:]}")
    threads = next((line for line in done.stderr.splitlines() if "CPU thread" in line), "")
    return float(found.group(2)), threads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-site", default=None, help="a folder holding an earlier commit's install")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="bench/results/busy_machine.json")
    args = parser.parse_args()
    sides = {"after": None, **({"before": args.before_site} if args.before_site else {})}
    times: dict[str, dict[str, float]] = {side: {} for side in sides}
    lines: dict[str, str] = {}
    for site in sides.values():  # builds each install's native kernels once, outside the timed runs
        train_seconds(site, 2, busy=False)
    for busy in (False, True):
        for side, site in sides.items():
            seconds, threads = train_seconds(site, args.steps, busy)
            times[side]["busy" if busy else "quiet"] = seconds
            if threads:
                lines[f"{side} {'busy' if busy else 'quiet'}"] = threads
            print(f"{side:6} {'busy' if busy else 'quiet':5}: {seconds:.1f} s", file=sys.stderr, flush=True)
    result = {
        "what": f"palestra train, default config, {args.steps} steps: training time quiet, and next to a 2-thread "
        "torch matmul loop",
        "cpu": cpu_kind(),
        "date": time.strftime("%Y-%m-%d"),
        "before_site": args.before_site,
        "seconds": times,
        "busy_over_quiet": {side: round(t["busy"] / t["quiet"], 2) for side, t in times.items()},
        "thread_lines": lines,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result["busy_over_quiet"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
