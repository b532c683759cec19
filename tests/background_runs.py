"""Training runs of minutes that the suite starts in the background, one after another, as soon as it has collected.

The learning tests each wait minutes for one single-threaded training run. On a two-core machine the rest of the suite
uses about one core, so the runs are started when collection ends, in their own processes, on the other core, one at a
time in the order their tests were collected. A test then only waits for what is left of its run. Nothing starts
for a test that was not selected, and a run still going when the session ends is killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


@dataclass
class BackgroundRun:
    """One run: ``argv`` in ``cwd`` with ``env``; ``result()`` waits for it and returns the finished process."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]
    timeout: float
    done: threading.Event = field(default_factory=threading.Event)
    completed: subprocess.CompletedProcess[str] | None = None
    process: subprocess.Popen[str] | None = None

    def run(self) -> None:
        try:
            self.process = subprocess.Popen(
                self.argv, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            try:
                out, err = self.process.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, err = self.process.communicate()
                err += f"\nbackground run killed after {self.timeout:.0f} s"
            self.completed = subprocess.CompletedProcess(self.argv, self.process.returncode, out, err)
        finally:
            self.done.set()

    def result(self) -> subprocess.CompletedProcess[str]:
        if not self.done.wait(timeout=self.timeout * 4):  # the runs queued before it count too
            pytest.fail(f"background run {self.argv} did not finish")
        assert self.completed is not None
        return self.completed


def _env(**extra: str) -> dict[str, str]:
    # One thread: the run shares the machine with the suite. The plugin variables never reach it.
    plugin_vars = ("PALESTRA_LOAD_PLUGINS", "PALESTRA_TRACE_PLUGINS", "PYTHONWARNINGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALESTRA_TEST") and k not in plugin_vars}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _robustness(code: str, scratch: Path) -> BackgroundRun:
    """``bench/robustness.py`` code run in a process of its own (run_one pins torch to one thread)."""
    script = f"import json; from robustness import run_one, BARE_ANSWER; print(json.dumps({code}))"
    return BackgroundRun([sys.executable, "-c", script], scratch, _env(PYTHONPATH=str(BENCH)), timeout=900)


def _builtin_run(scratch: Path) -> BackgroundRun:
    """The README's quick start, `palestra train` with no config, writing into ``scratch/runs``."""
    argv = [sys.executable, "-m", "palestra", "train", f"run.output_dir={scratch / 'runs'}", "loggers=[{name: jsonl}]"]
    return BackgroundRun(argv, scratch, _env(), timeout=900)


# test name -> how to make its run in a scratch folder of its own
RUNS = {
    "test_the_answer_alone_is_learnt_on_the_median_seed": lambda scratch: _robustness(
        "[run_one('grpo', s, [*BARE_ANSWER, 'train.steps=300'])['correctness'] for s in (0, 1, 2)]", scratch
    ),
    "test_all_100_facts_are_learnt_on_the_tagged_task": lambda scratch: _robustness(
        "run_one('hundred_facts', 0)['correctness']", scratch
    ),
    "test_the_builtin_run_learns_its_curriculum": _builtin_run,
}

_started: dict[str, BackgroundRun] = {}
_scratch: list[Path] = []


def start(items: list[pytest.Item]) -> None:
    """Queue the runs of the selected tests, in collection order, on one background thread."""
    if not any(item.name in RUNS for item in items):
        return
    scratch_root = Path(tempfile.mkdtemp(prefix="palestra-background-"))
    _scratch.append(scratch_root)
    queue = []
    for item in items:
        if item.name in RUNS and item.name not in _started:
            scratch = scratch_root / item.name
            scratch.mkdir(parents=True, exist_ok=True)
            _started[item.name] = RUNS[item.name](scratch)
            queue.append(_started[item.name])
    if queue:
        threading.Thread(target=lambda: [r.run() for r in queue], name="background-runs", daemon=True).start()


def result(name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The finished run of test ``name`` and its scratch folder (started by :func:`start` at collection)."""
    if name not in _started:
        pytest.fail(f"no background run was started for {name}")
    run = _started[name]
    return run.result(), run.cwd


def stop() -> None:
    """Kill what still runs (its test was not reached) and remove the scratch folders."""
    for run in _started.values():
        if run.process is not None and run.process.poll() is None:
            run.process.kill()
    for folder in _scratch:
        shutil.rmtree(folder, ignore_errors=True)
