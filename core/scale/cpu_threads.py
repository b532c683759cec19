"""How many CPU threads a run's torch uses, chosen from the cores that are actually free.

On a machine that another job keeps busy, torch's default (one thread per physical core) makes every parallel
region wait for a thread the kernel has descheduled: a tiny model's many small operations then run tens of times
slower. So, unless the user said (``train.threads``, or ``OMP_NUM_THREADS``), a run takes only the cores that were
idle over a short look at the machine, and says so once. The OpenMP wait policy is the other half of the cure, and
is set in ``palestra/__init__.py``, before torch loads its OpenMP runtime.

Thread counts change the order of floating-point reductions: a resumed run is bitwise the uninterrupted one only
with the same count, which the checkpoint records (``threads``) and a resume takes again.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ThreadChoice", "apply_threads", "choose_threads", "idle_cores", "leave_cores_to_the_worker"]


@dataclass(frozen=True)
class ThreadChoice:
    """``threads`` torch threads, and why (``source``: ``train.threads``, ``OMP_NUM_THREADS``, ``checkpoint`` or
    ``free cores``); ``line`` is what the run prints about it (empty when the user chose)."""

    threads: int
    source: str
    line: str = ""


def _cpu_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _idle_ticks(cpus: list[int]) -> tuple[int, int] | None:
    """(idle, total) jiffies summed over ``cpus``, from /proc/stat; None where there is no /proc/stat."""
    wanted = {f"cpu{i}" for i in cpus}
    idle = total = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *fields = line.split()
                if name in wanted:
                    ticks = [int(x) for x in fields[:8]]
                    idle += ticks[3] + ticks[4]  # idle + iowait
                    total += sum(ticks)
    except (OSError, ValueError, IndexError):
        return None
    return (idle, total) if total else None


def idle_cores(cpus: list[int], window_s: float = 0.25) -> float:
    """How many of ``cpus`` were idle over the next ``window_s`` seconds (a fraction: 1.4 is one core and a half).

    /proc/stat counts per CPU, so the look covers only the cores this process may run on, also in a container
    whose load average is the host's. Without /proc/stat, the load average stands in."""
    before = _idle_ticks(cpus)
    if before is not None:
        time.sleep(window_s)
        after = _idle_ticks(cpus)
        if after is not None and after[1] > before[1]:
            return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])
    try:
        return max(0.0, len(cpus) - os.getloadavg()[0])
    except OSError:
        return float(len(cpus))


def choose_threads(
    configured: int | None, default: int, *, saved: Any = None, environ: dict[str, str] | None = None
) -> ThreadChoice:
    """The thread count for a run: ``configured`` (``train.threads``) when set, torch's own choice when
    ``OMP_NUM_THREADS`` is set, a resumed run's ``saved`` count (its checkpoint's), else as many as the cores found
    idle (at least 1, at most ``default``, torch's one-per-physical-core)."""
    environ = dict(os.environ) if environ is None else environ
    if configured is not None:
        return ThreadChoice(configured, "train.threads")
    if environ.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(default, "OMP_NUM_THREADS")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1:
        plural = "s" if saved > 1 else ""
        line = (
            f"palestra: {saved} CPU thread{plural}, as the run was started with (its checkpoint says so; the same "
            "count keeps a resume bitwise); set train.threads or OMP_NUM_THREADS to choose"
        )
        return ThreadChoice(saved, "checkpoint", line)
    cpus = _cpu_ids()
    idle = idle_cores(cpus)
    threads = max(1, min(default, math.floor(idle + 0.25)))  # a core 75 % idle counts as free
    busy = len(cpus) - idle
    line = (
        f"palestra: {threads} CPU thread{'s' if threads > 1 else ''} ({len(cpus)} cores, "
        f"{max(0.0, busy):.1f} busy with other work); set train.threads or OMP_NUM_THREADS to choose"
    )
    return ThreadChoice(threads, "free cores", line)


def leave_cores_to_the_worker(choice: ThreadChoice, worker_threads: int) -> ThreadChoice:
    """An asynchronous run's learner: the free cores ``choice`` found, less the rollout worker's threads (at least
    one left), so the two processes do not fight over the same cores."""
    threads = max(1, choice.threads - worker_threads)
    line = (
        f"{choice.line.split(';')[0]}: {threads} for the learner, {worker_threads} for the rollout worker "
        "(train.async.threads); set train.threads or OMP_NUM_THREADS to choose"
    )
    return ThreadChoice(threads, choice.source, line)


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op thread count to ``choice.threads`` (a no-op when it already is)."""
    import torch

    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
