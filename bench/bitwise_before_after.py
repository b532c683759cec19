"""Prove that a refactor changed no behaviour: train the same configs at two commits and compare bitwise.

For each commit the script checks the tree out with ``git worktree`` (a clean copy, whatever the work tree
holds), installs it without dependencies into a folder of its own (``pip install --target``: the installed
package and its entry points, found first through ``PYTHONPATH``), and runs ``python -m palestra train`` on
the default run and on every ``examples/*.yaml`` for ``--steps`` steps, one thread each, into a run folder
per commit. Then it compares, config by config:

* ``metrics.jsonl``: every line and every key, except the wall-clock ones (``time``, ``perf/*``);
* the final checkpoint: every tensor bitwise (``torch.equal`` on the same dtype and shape) and every other
  value equal, key path by key path, except the wall-clock ``logs`` sizes (which follow the metrics' text) and numpy's
  global RNG state (never seeded or drawn from by a run, so it differs between any two processes).

``examples/hf_local.yaml`` needs a model folder: a tiny Llama is built locally (``tests/fixtures/tiny_hf.py``)
and passed as ``policy.options.path`` to both commits. Exit status 0 when every config matches, 1 otherwise;
one line per config either way.

    python bench/bitwise_before_after.py --before 8f75a5c --after HEAD [--steps 50] [--only grpo,default]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLOCK_KEYS = ("time",)
CLOCK_PREFIXES = ("perf/",)


def sh(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, text=True, capture_output=True, check=False)


def install(rev: str, work: Path) -> Path:
    """Check ``rev`` out into ``work/src`` and install it into ``work/site``; returns the site folder."""
    sha = sh("git", "rev-parse", rev, cwd=ROOT).stdout.strip()
    if not sha:
        sys.exit(f"bitwise_before_after: {rev!r} is not a commit of {ROOT}")
    src, site = work / "src", work / "site"
    out = sh("git", "worktree", "add", "--detach", str(src), sha, cwd=ROOT)
    if out.returncode:
        sys.exit(f"bitwise_before_after: git worktree add {sha[:12]} failed: {out.stderr.strip()}")
    out = sh(
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
        str(src),
    )
    if out.returncode:
        sys.exit(f"bitwise_before_after: installing {sha[:12]} failed: {out.stderr.strip().splitlines()[-1]}")
    return site


def configs(only: set[str] | None, before_src: Path, after_src: Path) -> dict[str, list[str]]:
    """name -> the train arguments (the default run has none): the examples both commits have, as the earlier
    commit wrote them (an example added later has nothing to be compared with)."""
    out = {"default": []}
    for path in sorted((before_src / "examples").glob("*.yaml")):
        if (after_src / "examples" / path.name).exists():
            out[path.stem] = ["--config", str(path)]
    return {k: v for k, v in out.items() if only is None or k in only}


def run(site: Path, name: str, args: list[str], steps: int, out_dir: Path, extra: list[str]) -> Path:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PALESTRA_TEST")}
    # One kernel cache per side: the two installs build the same sources at different paths.
    env.update(
        PYTHONPATH=str(site),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        PALESTRA_CACHE_DIR=str(site.parent / "kernel-cache"),
    )
    # A relative output folder, so that the configs saved in both checkpoints are the same text.
    cmd = [
        sys.executable,
        "-m",
        "palestra",
        "train",
        *args,
        f"train.steps={steps}",
        f"run.output_dir={out_dir.name}",
        f"run.name={name}",
        *extra,
    ]
    done = subprocess.run(cmd, cwd=out_dir.parent, env=env, text=True, capture_output=True, check=False)
    if done.returncode:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
        raise RuntimeError(f"{name}: palestra train exited {done.returncode}: {' | '.join(tail)}")
    return out_dir / name


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


def compare_metrics(a: Path, b: Path) -> str | None:
    la = a.read_text().splitlines()
    lb = b.read_text().splitlines()
    if len(la) != len(lb):
        return f"metrics.jsonl has {len(la)} lines before, {len(lb)} after"
    for i, (x, y) in enumerate(zip(la, lb), 1):
        ra, rb = json.loads(x), json.loads(y)
        keep = lambda r: {k: v for k, v in r.items() if k not in CLOCK_KEYS and not k.startswith(CLOCK_PREFIXES)}  # noqa: E731
        ra, rb = keep(ra), keep(rb)
        if ra != rb:
            keys = sorted(set(ra) | set(rb))
            diff = [k for k in keys if ra.get(k, "<missing>") != rb.get(k, "<missing>")]
            before, after = [ra.get(k) for k in diff[:2]], [rb.get(k) for k in diff[:2]]
            return f"metrics.jsonl line {i} differs at {', '.join(diff[:4])}: {before} vs {after}"
    return None


def same_value(x: Any, y: Any) -> bool:
    """Equality that also walks tuples holding numpy arrays (numpy's and Python's RNG states)."""
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same_value(a, b) for a, b in zip(x, y))
    if type(x).__module__ == "numpy" or type(y).__module__ == "numpy":
        import numpy as np

        return bool(np.array_equal(np.asarray(x), np.asarray(y)))
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


def compare_checkpoints(a: Path, b: Path) -> str | None:
    import re

    import torch

    fa = flatten(torch.load(a, map_location="cpu", weights_only=False))
    fb = flatten(torch.load(b, map_location="cpu", weights_only=False))
    if "optimizer.optimizers" in " ".join(fa) and "optimizer.extra.critic" in " ".join(fb):  # MAPPO, redesigned
        fb = {renamed(k): v for k, v in fb.items()}
        steps = fa.pop("optimizer.counters.steps", None)
        epochs = {k: fb.pop(k) for k in [k for k in fb if re.fullmatch(r"optimizer\.schedulers\..*\.last_epoch", k)]}
        if steps is None or any(v != steps for v in epochs.values()):
            return f"MAPPO's LR clock differs: counters.steps {steps} before, schedules' last_epoch {epochs} after"
        for k in [k for k in fb if k.startswith("optimizer.schedulers.") or k.endswith(".initial_lr")]:
            del fb[k]  # LambdaLR's own bookkeeping (base rates, the factor's last values), new with the schedules
    for flat in (fa, fb):
        for key in [k for k in flat if k.startswith("logs.") or k.endswith(".numpy")]:
            # logged file sizes follow the metrics' wall-clock text; numpy's global RNG is never seeded or used by
            # a run (it is saved so that a plugin that uses it resumes exactly), so it differs between any two runs
            del flat[key]
    if set(fa) != set(fb):
        only_before, only_after = sorted(set(fa) - set(fb))[:3], sorted(set(fb) - set(fa))[:3]
        return f"checkpoint keys differ: only before {only_before}, only after {only_after}"
    for key in fa:
        x, y = fa[key], fb[key]
        if _is_tensor(x) or _is_tensor(y):
            if (
                not (_is_tensor(x) and _is_tensor(y))
                or x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x, y)
            ):
                return f"checkpoint tensor {key} differs"
        elif not same_value(x, y):
            return f"checkpoint value {key} differs: {x!r} vs {y!r}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--only", default=None, help="comma-separated config names (default, grpo, ...)")
    ap.add_argument("--keep", default=None, help="keep the runs in this folder")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="palestra-bitwise-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    if not model.exists():
        sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
        from tiny_hf import build_llama

        build_llama(model)
    sides = {}
    try:
        for side, rev in (("before", args.before), ("after", args.after)):
            sides[side] = install(rev, work / side)
        failed = 0
        chosen = configs(only, work / "before" / "src", work / "after" / "src")
        for name, cfg in chosen.items():
            extra = [f"policy.options.path={model}"] if name == "hf_local" else []
            runs = {}
            for side in ("before", "after"):
                out_dir = work / side / "runs"
                out_dir.mkdir(exist_ok=True)
                runs[side] = run(sides[side], name, cfg, args.steps, out_dir, extra)
            problem = compare_metrics(
                runs["before"] / "metrics.jsonl", runs["after"] / "metrics.jsonl"
            ) or compare_checkpoints(runs["before"] / "checkpoint.pt", runs["after"] / "checkpoint.pt")
            lines = len((runs["after"] / "metrics.jsonl").read_text().splitlines())
            verdict = (
                f"DIFFERS: {problem}" if problem else f"identical ({lines} metric lines, checkpoint tensors bitwise)"
            )
            print(f"{name:24s} {verdict}", flush=True)
            failed += problem is not None
    finally:
        for side in sides:
            sh("git", "worktree", "remove", "--force", str(work / side / "src"), cwd=ROOT)
    print(f"{len(chosen) - failed} identical, {failed} differing ({args.before} -> {args.after}, {args.steps} steps)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
