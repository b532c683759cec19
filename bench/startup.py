"""Start-up figures: how long the light commands take and what they import, and the default run's time to its
first optimiser step (warm kernel cache).

    python bench/startup.py [--runs 5]

* ``palestra plugins --all`` and ``palestra config show``: wall time of a fresh interpreter (median of ``--runs``),
  the sum of ``python -X importtime`` self times, and which heavy modules got imported (none should);
* ``palestra train`` (the built-in default): seconds from process start to the end of the first optimiser step,
  and the phases before it (plugins loaded, components built, the held-out evaluation before training), read
  through a probe plugin on the lifecycle hooks; the run exits right after that step. Run it once first so the
  kernel cache is warm (the script does a warm-up run).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "transformers", "wandb", "tensorboard", "matplotlib", "numpy", "triton")

PROBE = r"""
import os, sys, time
with open(f"/proc/{os.getpid()}/stat") as f:
    ticks = int(f.read().rsplit(")", 1)[1].split()[19])
with open("/proc/uptime") as f:
    start = time.time() - float(f.read().split()[0]) + ticks / os.sysconf("SC_CLK_TCK")
marks = []
from palestra import hookimpl, plugin_manager

class Probe:
    @hookimpl
    def on_train_start(self, run):
        marks.append(("components built", time.time()))
    @hookimpl
    def on_step_start(self, run):
        marks.append(("held-out evaluation done, step 1 starts", time.time()))
    @hookimpl
    def on_optimizer_step(self, run):
        marks.append(("first optimiser step done", time.time()))
        for name, t in marks:
            print(f"STARTUP {t - start:.3f} {name}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(0)

load = plugin_manager._Loader.load
def probed(self):
    state = load(self)
    state.manager.register(Probe(), name="startup_probe")
    marks.append(("plugins loaded", time.time()))
    return state
plugin_manager._Loader.load = probed
import palestra.cli
sys.exit(palestra.cli.main(["train", f"run.output_dir={sys.argv[1]}"]))
"""


def light(args: list[str], runs: int) -> tuple[float, float, list[str]]:
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "palestra", *args], capture_output=True, check=True)
        walls.append(time.perf_counter() - t)
    out = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            f"import sys, palestra.cli; palestra.cli.main({args!r}); "
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    self_us = sum(int(m.group(1)) for m in re.finditer(r"import time:\s+(\d+) \|", out.stderr))
    heavy = re.search(r"HEAVY (\[.*\])", out.stderr)
    return statistics.median(walls), self_us / 1e6, ast.literal_eval(heavy.group(1)) if heavy else ["?"]


def first_step(runs: int) -> list[list[tuple[float, str]]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text(PROBE)
        for i in range(runs + 1):  # the first run warms the kernel cache and is not counted
            done = subprocess.run(
                [sys.executable, str(probe), str(Path(tmp) / "runs")], capture_output=True, text=True, check=False
            )
            marks = [(float(a), b) for a, b in re.findall(r"STARTUP (\S+) (.*)", done.stderr)]
            if not marks:
                sys.exit(f"startup: the probe run failed:\n{done.stderr[-2000:]}")
            if i:
                out.append(marks)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    runs = ap.parse_args().runs
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for args in (["plugins", "--all"], ["config", "show"]):
        wall, imports, heavy = light(args, runs)
        print(
            f"palestra {' '.join(args):14s} wall {wall:.3f} s (median of {runs}); imports {imports:.3f} s; "
            f"heavy modules imported: {heavy or 'none'}"
        )
    results = first_step(runs)
    for i, name in enumerate(m[1] for m in results[0]):
        values = [r[i][0] for r in results]
        print(
            f"palestra train: {name:42s} {statistics.median(values):.2f} s "
            f"(median of {runs}; {min(values):.2f}-{max(values):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
