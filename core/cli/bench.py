"""Benchmark the kernels: op x back end x size, with time, peak memory and ratios to baselines; or, with
``--e2e``, whole training steps: where each step's time goes.

The cases come from ``bench/cases_*.py`` in a source checkout (each defines ``cases(device, quick)``); every
baseline (eager torch, TRL's log-softmax helpers, torchrl's vectorised GAE, a verl-style loop) is measured
in the same run as our back ends, so ratios compare like with like. Results can be written to JSON or CSV.

``--e2e`` builds the trainer from a config (``--config FILE`` and ``key=value`` overrides, as ``palestra train``
takes them), runs one warm-up step and ``--steps`` measured ones, and splits each step into the trainer's
``perf/*_s`` metrics: generate (the rollout: environment and sampling), reward, score (reference log-probs and
advantages), update (forwards, backwards, optimiser steps) and overhead (the rest), which sum to ``perf/step_s``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from palestra.cli import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--ops", default="", help="comma-separated op names to run (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    p.add_argument("--out", default=None, help="write the results to FILE.json or FILE.csv")
    p.add_argument("--bench-dir", default=None, help="the bench/ folder (default: the source checkout's)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds to spend timing each row (at least 3 calls)")
    p.add_argument(
        "--e2e",
        action="store_true",
        help="time whole training steps of a config instead of kernels: generate, reward, score, update, overhead",
    )
    p.add_argument(
        "--config", default=None, metavar="FILE", help="with --e2e: the config to train (default: the built-in task)"
    )
    p.add_argument(
        "--steps", type=int, default=5, help="with --e2e: measured steps, after one warm-up step (default 5)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="with --e2e: dotted config overrides such as train.max_new_tokens=32",
    )


def find_bench_dir(explicit: str | None) -> Path:
    candidates = [Path(explicit)] if explicit else []
    import palestra

    candidates += [Path(palestra.__file__).resolve().parent.parent / "bench", Path.cwd() / "bench"]
    for c in candidates:
        if c.is_dir() and any(c.glob("cases_*.py")):
            return c
    where = explicit or " or ".join(str(c) for c in candidates)
    raise UsageError(f"--bench-dir: no bench/cases_*.py found at {where}; run from a source checkout of palestra")


def load_cases(bench_dir: Path, device: str, quick: bool, ops: set[str]) -> list[dict]:
    cases: list[dict] = []
    for path in sorted(bench_dir.glob("cases_*.py")):
        spec = importlib.util.spec_from_file_location(f"palestra_bench_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise UsageError(f"--bench-dir: {path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        for case in module.cases(device, quick):
            if not ops or case["op"] in ops:
                cases.append(case)
    return cases


# ---- measuring ----------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str, min_time: float) -> float:
    """Median seconds per call, after one warm-up call (which also triggers any lazy build)."""
    fn()
    _sync(device)
    times: list[float] = []
    spent = 0.0
    while len(times) < 3 or (spent < min_time and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)", f.read(), re.M)
    return int(m.group(1)) if m else 0


def peak_memory(fn: Callable[[], object], device: str) -> float | None:
    """Extra bytes at the peak of one call, beyond what was allocated before it (inputs excluded)."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)
    try:  # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _status_kib("VmRSS")
    fn()
    return float(max(0, _status_kib("VmHWM") - base) * 1024)


def run_cases(cases: list[dict], device: str, min_time: float, echo: Callable[[str], None] = print) -> list[dict]:
    rows: list[dict] = []
    for case in cases:
        echo(f"  {case['op']:<22} {case['size']:<22} {case['impl']:<16}")
        try:
            seconds = time_call(case["fn"], device, min_time)
            peak = peak_memory(case["fn"], device)
            error = None
        except Exception as e:  # noqa: BLE001 - a missing optional baseline (e.g. trl not installed) must not stop the run
            seconds, peak, error = math.nan, None, f"{type(e).__name__}: {e}".splitlines()[0]
        rows.append(
            {
                "op": case["op"],
                "size": case["size"],
                "impl": case["impl"],
                "baseline": bool(case.get("baseline", False)),
                "seconds": seconds,
                "peak_bytes": peak,
                "gbps": (case["bytes"] / seconds / 1e9) if case.get("bytes") and seconds == seconds else None,
                "error": error,
            }
        )
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    """For every row, time of each baseline in the same (op, size) group divided by the row's time."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["size"]), []).append(r)
    for group in groups.values():
        baselines = [b for b in group if b["baseline"] and b["error"] is None]
        for r in group:
            r["speedup_vs"] = {
                b["impl"]: b["seconds"] / r["seconds"]
                for b in baselines
                if b is not r and r["error"] is None and r["seconds"] > 0
            }


# ---- output -----------------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    head = f"{'op':<24} {'size':<22} {'impl':<16} {'time':>10} {'peak mem':>10} {'GB/s':>7}  speed-up vs baselines"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = "failed" if r["error"] else _fmt_time(r["seconds"])
        mem = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}M"
        gbps = "-" if r["gbps"] is None else f"{r['gbps']:.1f}"
        ratios = ", ".join(f"{v:.2f}x {k}" for k, v in r.get("speedup_vs", {}).items())
        if r["error"]:
            ratios = r["error"][:80]
        lines.append(f"{r['op']:<24} {r['size']:<22} {r['impl']:<16} {t:>10} {mem:>10} {gbps:>7}  {ratios}")
    return "\n".join(lines)


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f}ms" if s < 1 else f"{s:.3f}s"


def write_results(rows: list[dict], out: str, meta: dict) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["op", "size", "impl", "baseline", "seconds", "peak_bytes", "gbps", "speedup_vs", "error"])
            for r in rows:
                ratios = ";".join(f"{k}={v:.4g}" for k, v in r.get("speedup_vs", {}).items())
                w.writerow(
                    [
                        r["op"],
                        r["size"],
                        r["impl"],
                        r["baseline"],
                        r["seconds"],
                        r["peak_bytes"],
                        r["gbps"],
                        ratios,
                        r["error"] or "",
                    ]
                )
    else:
        raise UsageError(f"--out: {out!r} must end in .json or .csv")


def run(args: argparse.Namespace) -> int:
    if args.e2e:
        return run_e2e(args)
    for flag, given in (
        ("--config", args.config is not None),
        ("--steps", args.steps != 5),
        ("key=value", bool(args.overrides)),
    ):
        if given:
            raise UsageError(f"{flag}: only with --e2e (the kernel benchmark takes --ops, --quick and --min-time)")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device: {device!r} is not cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda was asked for but torch sees no CUDA device")
    if args.out and Path(args.out).suffix not in (".json", ".csv"):
        raise UsageError(f"--out: {args.out!r} must end in .json or .csv")
    ops = {o.strip() for o in args.ops.split(",") if o.strip()}
    bench_dir = find_bench_dir(args.bench_dir)
    cases = load_cases(bench_dir, device, args.quick, ops)
    if not cases:
        raise UsageError(f"--ops: no benchmark cases match {args.ops!r}")
    print(f"palestra bench: {len(cases)} rows on {device} ({torch.get_num_threads()} threads)", file=sys.stderr)
    rows = run_cases(cases, device, args.min_time, echo=lambda s: print(s, file=sys.stderr))
    print(format_table(rows))
    if args.out:
        meta = {
            "device": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "quick": args.quick,
        }
        write_results(rows, args.out, meta)
        print(f"results written to {args.out}", file=sys.stderr)
    return 0


def _cpu_name() -> str:
    from palestra.kernels.build import cpu_model

    return f"{cpu_model()} x{os.cpu_count()}"


# ---- whole training steps (--e2e) -----------------------------------------------------------------------
STEP_PARTS = ("generate", "reward", "score", "update", "overhead")


def run_e2e(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from palestra.config import load_config
    from palestra.engine.trainer import Trainer

    for flag, given in (
        ("--ops", bool(args.ops)),
        ("--quick", args.quick),
        ("--bench-dir", args.bench_dir is not None),
    ):
        if given:
            raise UsageError(f"{flag}: only for the kernel benchmark, not with --e2e")
    if args.steps < 1:
        raise UsageError(f"--steps: expected at least 1 measured step, got {args.steps}")
    if args.out and Path(args.out).suffix not in (".json", ".csv"):
        raise UsageError(f"--out: {args.out!r} must end in .json or .csv")
    overrides = list(args.overrides) + ([f"train.device={args.device}"] if args.device else [])
    config = load_config(args.config, overrides)
    t = config.train
    print(
        f"palestra bench --e2e: {config.policy.name} policy on {config.environment.name}, {t.batch_size} tasks x "
        f"{t.group_size} completions, max {t.max_new_tokens} new tokens, {config.optimizer.name}; 1 warm-up + "
        f"{args.steps} steps ({torch.get_num_threads()} threads)",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="palestra-bench-") as run_dir:
        trainer = Trainer(config, run_dir=run_dir)
        trainer.step()  # the warm-up: lazy kernel builds, first allocations
        history = [trainer.step() for _ in range(args.steps)]
        device = str(trainer.device)
    rows = step_rows(history, t.batch_size * t.group_size)
    print(format_step_table(rows))
    if args.out:
        meta = {
            "config": args.config or "(built-in)",
            "overrides": overrides,
            "steps": args.steps,
            "device": device if device != "cpu" else _cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        write_step_results(rows, history, args.out, meta)
        print(f"results written to {args.out}", file=sys.stderr)
    return 0


def step_rows(history: list[dict[str, float]], completions: int) -> list[dict]:
    """One row per part of the step (and the whole step): median and mean seconds, and the part's share of the mean
    step (means add up, medians need not). Then completions/s and tokens/s at the median step time."""
    steps = [m["perf/step_s"] for m in history]
    mean_step = statistics.fmean(steps)
    rows = []
    for part in (*STEP_PARTS, "step"):
        values = [m.get(f"perf/{part}_s", 0.0) for m in history]
        mean = statistics.fmean(values)
        rows.append(
            {
                "part": part,
                "median_s": statistics.median(values),
                "mean_s": mean,
                "share": mean / mean_step if mean_step > 0 else math.nan,
            }
        )
    median_step = statistics.median(steps)
    tokens = statistics.fmean(m["response/length"] for m in history) * completions
    rows.append({"part": "completions/s", "value": completions / median_step})
    rows.append({"part": "tokens/s", "value": tokens / median_step})
    return rows


def format_step_table(rows: list[dict]) -> str:
    head = f"{'part':<14} {'median':>10} {'mean':>10} {'share':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "value" in r:
            lines.append(f"{r['part']:<14} {r['value']:>10.1f}")
        else:
            lines.append(
                f"{r['part']:<14} {_fmt_time(r['median_s']):>10} {_fmt_time(r['mean_s']):>10} {r['share']:>7.1%}"
            )
    return "\n".join(lines)


def write_step_results(rows: list[dict], history: list[dict[str, float]], out: str, meta: dict) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        steps = [{k: v for k, v in m.items() if k.startswith("perf/") or k == "response/length"} for m in history]
        path.write_text(json.dumps({"meta": meta, "rows": rows, "steps": steps}, indent=2))
    else:
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["part", "median_s", "mean_s", "share", "value"])
            for r in rows:
                w.writerow(
                    [r["part"], r.get("median_s", ""), r.get("mean_s", ""), r.get("share", ""), r.get("value", "")]
                )
