"""Compare two run folders of the same config bitwise: what ``bench/bitwise_before_after.py`` calls "identical".

* ``metrics.jsonl``: every line and every key, except the wall-clock ones (``time``, ``perf/*``);
* every checkpoint (``checkpoint.pt`` and each ``checkpoints/step-*.pt``; both folders must hold the same set):
  every tensor bitwise (the same dtype, shape and bytes) and every other value equal, key path by key
  path, except what differs between any two runs of one commit: the file's header (``run_id``, a fresh id per
  run; ``saved_at``, the wall clock; ``integrity``, the digest over both), the wall-clock ``logs`` sizes (which
  follow the metrics' text) and numpy's global RNG state (never seeded or drawn from by a run).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLOCK_KEYS = ("time",)
CLOCK_PREFIXES = ("perf/",)
METRICS = "metrics.jsonl"
# A checkpoint's header (core/engine/checkpoint.py): who wrote it and when, and a digest that covers both. Every
# value the digest covers besides these is compared on its own.
HEADER_KEYS = ("run_id", "saved_at", "integrity.sha256")


@dataclass
class Comparison:
    problem: str | None  # the first difference found, None when the runs are identical
    metric_lines: int
    checkpoints: int


def checkpoint_files(run_dir: Path) -> list[str]:
    """The run's checkpoints, relative to its folder: the final one and every step file kept."""
    names = ["checkpoint.pt"] if (run_dir / "checkpoint.pt").exists() else []
    names += sorted(f"checkpoints/{p.name}" for p in (run_dir / "checkpoints").glob("step-*.pt"))
    return names


def compare_runs(before: Path, after: Path) -> Comparison:
    metrics = after / METRICS
    lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    names_before, names_after = checkpoint_files(before), checkpoint_files(after)
    if names_before != names_after:
        return Comparison(f"checkpoint files differ: {names_before} before, {names_after} after", lines, 0)
    if not names_before:
        return Comparison("no checkpoint was written", lines, 0)
    problem = compare_metrics(before / METRICS, metrics)
    for name in names_before:
        if problem:
            break
        found = compare_checkpoints(before / name, after / name)
        problem = f"{name}: {found}" if found else None
    return Comparison(problem, lines, len(names_before))


def compare_metrics(a: Path, b: Path) -> str | None:
    if not a.exists() or not b.exists():
        return f"{METRICS} missing {'before' if not a.exists() else 'after'}"
    la = a.read_text().splitlines()
    lb = b.read_text().splitlines()
    if len(la) != len(lb):
        return f"{METRICS} has {len(la)} lines before, {len(lb)} after"
    for i, (x, y) in enumerate(zip(la, lb), 1):
        ra, rb = without_clock(json.loads(x)), without_clock(json.loads(y))
        if canonical(ra) != canonical(rb):  # as text: a NaN equals a NaN, and 0.0 differs from -0.0
            keys = sorted(set(ra) | set(rb))
            diff = [k for k in keys if canonical(ra.get(k, "<missing>")) != canonical(rb.get(k, "<missing>"))]
            return (
                f"{METRICS} line {i} differs at {', '.join(diff[:4])}: {[ra.get(k) for k in diff[:2]]} vs "
                f"{[rb.get(k) for k in diff[:2]]}"
            )
    return None


def without_clock(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in CLOCK_KEYS and not k.startswith(CLOCK_PREFIXES)}


def canonical(value: Any) -> str:
    """A JSON value as text: Python writes floats exactly (shortest round-trip), so equal text is equal bits."""
    return json.dumps(value, sort_keys=True)


def same_bits(x: Any, y: Any) -> bool:
    """Two tensors hold the same dtype, shape and bytes (``torch.equal`` calls NaN unequal, -0.0 equal to 0.0)."""
    import torch

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    bytes_x, bytes_y = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (x, y))
    return torch.equal(bytes_x, bytes_y)


def short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) or _is_tensor(v) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{path}[{i}]"))
        return out
    return {path: value}


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def same_value(x: Any, y: Any) -> bool:
    """Equality that also walks tuples holding numpy arrays (numpy's and Python's RNG states)."""
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same_value(a, b) for a, b in zip(x, y))
    if type(x).__module__ == "numpy" or type(y).__module__ == "numpy":
        import numpy as np

        return bool(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=np.asarray(x).dtype.kind == "f"))
    if isinstance(x, float) and isinstance(y, float):
        return canonical(x) == canonical(y)
    return bool(x == y)


# Checkpoint layout changes of the architecture redesign (issue 12), all in MAPPO's optimiser state, which moved
# onto the shared learner loop: its own state went under "extra", the LR schedules are LambdaLR's (one per
# optimiser, recording "initial_lr" in each param group) instead of a step counter. Every value is still compared:
# the moved keys under their new names, the old step counter against each schedule's last_epoch.
MOVED_UNDER_EXTRA = ("critic", "agents", "reward_moments", "value_normalizer", "shared_accum", "counters")


def renamed(key: str) -> str:
    """An after-commit checkpoint key as the before-commit layout names it."""
    for name in MOVED_UNDER_EXTRA:
        if key.startswith(f"optimizer.extra.{name}"):
            return "optimizer." + key[len("optimizer.extra.") :]
    return key


def old_mappo_layout(flat: dict[str, Any]) -> bool:
    """MAPPO's own optimiser state at the top of ``optimizer`` (before issue 12), not under ``optimizer.extra``."""
    return any(key.startswith("optimizer.critic.") for key in flat)


# Keys later commits added, each with a value that does not change training: a LoRA base's fingerprint (issue 23),
# the torch thread count and its config key (issue 27), the tools section and the trajectory layout (issue 24), the
# agent section (issue 25). Dropped from the after side when the before side lacks them.
ADDED_KEYS = (
    "base_fingerprint",
    "threads",
    "config.train.threads",
    "config.tools",
    "config.train.trajectory",
    "config.agent",
)


def compare_checkpoints(a: Path, b: Path) -> str | None:
    import torch

    fa = flatten(torch.load(a, map_location="cpu", weights_only=False))
    fb = flatten(torch.load(b, map_location="cpu", weights_only=False))
    if old_mappo_layout(fa) and not old_mappo_layout(fb):  # MAPPO before issue 12 against MAPPO after it
        fb = {renamed(k): v for k, v in fb.items()}
        steps = fa.pop("optimizer.counters.steps", None)
        epochs = {k: fb.pop(k) for k in [k for k in fb if re.fullmatch(r"optimizer\.schedulers\..*\.last_epoch", k)]}
        if steps is None or any(v != steps for v in epochs.values()):
            return f"MAPPO's LR clock differs: counters.steps {steps} before, schedules' last_epoch {epochs} after"
        for k in [k for k in fb if k.startswith("optimizer.schedulers.") or k.endswith(".initial_lr")]:
            del fb[k]  # LambdaLR's own bookkeeping (base rates, the factor's last values), new with the schedules
    for flat in (fa, fb):
        for key in [k for k in flat if k in HEADER_KEYS or k.startswith("logs.") or re.search(r"\.numpy(\[|$)", k)]:
            # logged file sizes follow the metrics' wall-clock text; numpy's global RNG is never seeded or used by
            # a run (it is saved so that a plugin that uses it resumes exactly), so it differs between any two runs
            del flat[key]
    for key in ADDED_KEYS:
        if key in fb and key not in fa:
            del fb[key]
    if set(fa) != set(fb):
        only_before, only_after = sorted(set(fa) - set(fb))[:3], sorted(set(fb) - set(fa))[:3]
        return f"checkpoint keys differ: only before {only_before}, only after {only_after}"
    for key in fa:
        x, y = fa[key], fb[key]
        if _is_tensor(x) or _is_tensor(y):
            if not (_is_tensor(x) and _is_tensor(y)) or not same_bits(x, y):
                return f"tensor {key} differs"
        elif not same_value(x, y):
            return f"value {key} differs: {short(x)} vs {short(y)}"
    return None
