"""Check this machine and a config for training: the toolchain, the kernels, utilisation, the data pipeline, a step.

The troubleshooting checklist as one command. In order, each check ``ok``, ``failed`` (with a one-line reason)
or ``skipped`` (with why, e.g. no GPU):

1. versions: Python, torch (CUDA build? devices), Triton (interpreter mode?), ninja, the C++ compiler, nvcc;
2. kernels: every op on every back end (torch, cpp, cuda, triton), built if needed, against a float64 reference;
3. utilisation: CPU (``/proc/stat``, load average) and, on CUDA, the GPU (NVML or ``nvidia-smi``);
4. data: one batch of the configured environment (reset, steps with dummy completions) and its reward, timed,
   each call under ``train.data_timeout_s``;
5. training: one real training step (the same Trainer as ``palestra train``) with the gradient norm of every
   parameter group, flagged when zero, NaN/inf or exploding; and the process's CPU/GPU use during the step.
   A step the trainer skips (a non-finite reward, loss or gradient) is one failure naming the cause.

``palestra doctor [--config FILE] [key=value ...]`` reads the same config as ``palestra train``. ``--json``
prints one JSON object for scripts. The exit status is 1 when a check failed (a missing GPU is ``skipped``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from palestra.config import Config, ConfigError, load_config
from palestra.hookspecs import hookimpl
from palestra.plugin_manager import get_plugin_manager

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
SECTIONS = {
    "versions": "versions and toolchain",
    "kernels": "kernels: each op and back end against a float64 reference",
    "utilisation": "utilisation",
    "data": "data pipeline: one batch",
    "training": "training: one step, gradient flow per parameter group",
}


@dataclass
class Check:
    """One line of the report. ``data`` holds the numbers behind ``detail`` for ``--json``."""

    section: str
    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a .yaml/.yml/.toml config (default: the built-in task)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--grad-threshold",
        type=float,
        default=1e3,
        metavar="X",
        help="flag a parameter group whose gradient norm exceeds X as exploding (default 1e3)",
    )
    parser.add_argument(
        "--skip", default="", metavar="SECTIONS", help=f"comma-separated sections to skip: {', '.join(SECTIONS)}"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides such as train.batch_size=2")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(SECTIONS)
    if unknown:
        raise ConfigError(f"--skip: unknown section {min(unknown)!r}; choose from {', '.join(SECTIONS)}")
    import torch  # noqa: F401 - imported once up front, so that no check's timing includes it

    checks: list[Check] = []
    steps: list[tuple[str, Callable[[], list[Check]]]] = [
        ("versions", check_versions),
        ("kernels", check_kernels),
        ("utilisation", sample_utilisation),
        ("data", lambda: check_data(config)),
        ("training", lambda: check_training(config, args.grad_threshold)),
    ]
    for section, fn in steps:
        if section in skip:
            continue
        if not args.json:  # progress on stderr: a kernel build can take a minute
            print(f"palestra doctor: checking {SECTIONS[section]} ...", file=sys.stderr, flush=True)
        try:
            checks.extend(fn())
        except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check, not a crashed doctor
            checks.append(Check(section, section, FAILED, one_line(e)))
    report = summarise(checks)
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 1 if report["status"] == FAILED else 0


def summarise(checks: list[Check]) -> dict[str, Any]:
    counts = {s: sum(c.status == s for c in checks) for s in (OK, FAILED, SKIPPED)}
    return {
        "status": FAILED if counts[FAILED] else OK,
        "counts": counts,
        "failed": [f"{c.section}/{c.name}" for c in checks if c.status == FAILED],
        "checks": [asdict(c) for c in checks],
    }


def format_report(report: dict[str, Any]) -> str:
    checks = report["checks"]
    width = max([len(c["name"]) for c in checks] + [4])
    lines: list[str] = []
    for section, title in SECTIONS.items():
        rows = [c for c in checks if c["section"] == section]
        if not rows:
            continue
        lines.append(title)
        lines += [f"  {c['status']:<7}  {c['name']:<{width}}  {c['detail']}".rstrip() for c in rows]
        lines.append("")
    n = report["counts"]
    lines.append(f"palestra doctor: {n[OK]} ok, {n[FAILED]} failed, {n[SKIPPED]} skipped")
    if report["failed"]:
        lines.append("failed: " + ", ".join(report["failed"]))
    return "\n".join(lines)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}" if not getattr(e, "palestra_user_error", False) else text


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def run_tool(args: Sequence[str]) -> str:
    """A tool's ``--version`` output (stdout, else stderr); raises OSError/CalledProcessError."""
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=True)
    return out.stdout or out.stderr


# ---- 1. versions -------------------------------------------------------------------------------------------
def check_versions() -> list[Check]:
    """Python, torch (and CUDA), triton, ninja, the C++ compiler and nvcc: what the back ends need."""
    checks, devices = _torch_checks()
    return [*checks, _triton_check(devices), _ninja_check(), _compiler_check(), _nvcc_check(devices)]


def _torch_checks() -> tuple[list[Check], list[str]]:
    """Python, torch and the visible CUDA devices (their names, returned too)."""
    import torch

    v = "versions"
    checks = [
        Check(
            v, "python", OK, f"{platform.python_version()} ({sys.executable})", {"version": platform.python_version()}
        )
    ]
    cuda_build = torch.version.cuda
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    checks.append(
        Check(
            v,
            "torch",
            OK,
            f"{torch.__version__}; {'CUDA ' + cuda_build + ' build' if cuda_build else 'CPU build'}; "
            f"{torch.get_num_threads()} threads",
            {"version": torch.__version__, "cuda_build": cuda_build, "threads": torch.get_num_threads()},
        )
    )
    checks.append(cpu_check())
    if devices:
        free_total = [torch.cuda.mem_get_info(i) for i in range(len(devices))]
        detail = "; ".join(
            f"cuda:{i} {name} ({f / 2**30:.1f}/{t / 2**30:.1f} GiB free)"
            for i, (name, (f, t)) in enumerate(zip(devices, free_total))
        )
        checks.append(Check(v, "cuda", OK, detail, {"devices": devices}))
    elif cuda_build:
        checks.append(
            Check(
                v,
                "cuda",
                SKIPPED,
                f"torch is a CUDA {cuda_build} build but no GPU is visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            )
        )
    else:
        checks.append(Check(v, "cuda", SKIPPED, "torch is a CPU build: no CUDA"))
    return checks, devices


# What each kind of CPU means for a bf16 run (train.dtype=bfloat16 or train.precision=bf16); docs/performance.md.
BF16_ON_CPU = {
    "amx": "AMX: bf16 matrix products run on its tile units, the fast path for bf16 on a CPU",
    "avx512_bf16": "no AMX, but avx512_bf16: bf16 runs, at about half the speed of an AMX CPU "
    "(docs/performance.md#cpu-kinds)",
    "emulated": "no AMX and no avx512_bf16: bf16 is converted to float32 for every product, slower than "
    "float32 itself; keep train.dtype=float32 here",
}


def cpu_check() -> Check:
    """The CPU's name and kind (AMX or not): it decides what bf16 costs, and bf16 results differ in their last bits
    from one kind to another, so a bf16 run's figures hold for its kind of CPU."""
    from palestra.kernels.build import cpu_bf16_kind, cpu_model

    kind, model = cpu_bf16_kind(), cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    detail = f"{model}, {cores} cores; {BF16_ON_CPU[kind]}"
    return Check("versions", "cpu", OK, detail, {"model": model, "cores": cores, "bf16": kind})


def _triton_check(devices: list[str]) -> Check:
    v = "versions"
    try:
        import triton

        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        mode = (
            "interpreter mode (TRITON_INTERPRET=1)"
            if interpret
            else ("compiled" if devices else "needs a CUDA device or TRITON_INTERPRET=1")
        )
        return Check(
            v, "triton", OK, f"{triton.__version__}; {mode}", {"version": triton.__version__, "interpret": interpret}
        )
    except Exception as e:  # noqa: BLE001
        return Check(v, "triton", SKIPPED, f"not importable ({one_line(e)}); the triton back end is unavailable")


def _ninja_check() -> Check:
    from torch.utils.cpp_extension import verify_ninja_availability

    try:
        verify_ninja_availability()
        return Check(
            "versions", "ninja", OK, f"{first_line(run_tool(['ninja', '--version']))} ({shutil.which('ninja')})"
        )
    except Exception as e:  # noqa: BLE001
        return Check(
            "versions",
            "ninja",
            FAILED,
            f"not available ({one_line(e)}); the cpp/cuda back ends need it: pip install ninja",
        )


def _compiler_check() -> Check:
    v = "versions"
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return Check(
            v, "compiler", FAILED, f"{cxx!r} not found on PATH; the cpp back end needs a C++17 compiler (set CXX)"
        )
    try:
        from palestra.kernels.build import cpu_simd_level

        return Check(
            v,
            "compiler",
            OK,
            f"{first_line(run_tool([path, '--version']))} ({path}); C++ kernels use the {cpu_simd_level()} loops here",
        )
    except Exception as e:  # noqa: BLE001
        return Check(v, "compiler", FAILED, f"{path} --version failed: {one_line(e)}")


def _nvcc_check(devices: list[str]) -> Check:
    from torch.utils.cpp_extension import CUDA_HOME

    v = "versions"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if nvcc and os.path.exists(nvcc):
        try:
            release = [line for line in run_tool([nvcc, "--version"]).splitlines() if "release" in line]
            return Check(v, "nvcc", OK, f"{(release or ['?'])[-1].strip()} ({nvcc})")
        except Exception as e:  # noqa: BLE001
            return Check(v, "nvcc", FAILED if devices else SKIPPED, f"{nvcc} --version failed: {one_line(e)}")
    return Check(
        v,
        "nvcc",
        FAILED if devices else SKIPPED,
        "not found (CUDA_HOME unset and no nvcc on PATH); the cuda back end needs it",
    )


# ---- 2. kernels --------------------------------------------------------------------------------------------
def kernel_cases(device: Any) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """``(op, run the public op, float64 truth)`` for each op, on tiny inputs (padding and ignore_index included).

    The truths are written out here, independently of palestra.kernels, so the torch back end is checked too.
    """
    import torch

    from palestra import kernels as K

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 13, generator=g).to(device)
    tokens = torch.randint(0, 13, (6,), generator=g).to(device)
    tokens[2] = -100
    rewards = torch.randn(3, 7, generator=g).to(device)
    values = torch.randn(3, 7, generator=g).to(device)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, :2] = False
    mask = mask.to(device)
    flat = torch.randn(12, generator=g).to(device)

    def logprob_entropy() -> Any:
        x = logits.clone().requires_grad_(True)
        logp, ent = K.logprob_entropy(x, tokens, temperature=0.7)
        (grad,) = torch.autograd.grad(logp.sum() + 0.5 * ent.sum(), x)
        return logp, ent, grad

    def logprob_entropy_truth() -> Any:
        x = logits.double().clone().requires_grad_(True)
        logq = torch.log_softmax(x / 0.7, -1)
        keep = tokens != -100
        logp = torch.where(keep, logq.gather(-1, tokens.clamp(min=0)[:, None])[:, 0], 0.0)
        ent = torch.where(keep, -(logq.exp() * logq).sum(-1), 0.0)
        (grad,) = torch.autograd.grad(logp.sum() + 0.5 * ent.sum(), x)
        return logp, ent, grad

    def recursion(weight: float, bootstrap_with_values: bool) -> Any:
        r, v, m = rewards.double(), values.double(), mask
        out = torch.zeros_like(r)
        for b in range(r.shape[0]):
            carry: float | torch.Tensor = 0.0
            next_v: float | torch.Tensor = 0.0
            for t in reversed(range(r.shape[1])):
                if not m[b, t]:
                    continue
                if bootstrap_with_values:  # GAE, gamma 0.9, lambda 0.8
                    carry = r[b, t] + 0.9 * next_v - v[b, t] + 0.9 * 0.8 * carry
                    next_v = v[b, t]
                else:  # discounted return, gamma = weight
                    carry = r[b, t] + weight * carry
                out[b, t] = carry
        return out

    def group_truth() -> Any:
        x = flat.double().reshape(-1, 4)
        return ((x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)).reshape(-1)

    def rloo_truth() -> Any:
        x = flat.double().reshape(-1, 4)
        return (x - (x.sum(-1, keepdim=True) - x) / 3).reshape(-1)

    def normalize() -> Any:
        return K.normalize_rewards(flat, K.RunningMoments(device=device), clip=1.5)

    def normalize_truth() -> Any:
        x = flat.double()
        return ((x - x.mean()) / (x.var(unbiased=False) + 1e-8).sqrt()).clamp(-1.5, 1.5)

    return [
        ("logprob_entropy", logprob_entropy, logprob_entropy_truth),
        ("gae", lambda: K.gae(rewards, values, mask, 0.9, 0.8)[0], lambda: recursion(0.0, True)),
        (
            "discounted_returns",
            lambda: K.discounted_returns(rewards, mask, 0.9, whiten=False),
            lambda: recursion(0.9, False),
        ),
        ("group_advantages", lambda: K.group_advantages(flat, 4), group_truth),
        ("rloo_advantages", lambda: K.rloo_advantages(flat, 4), rloo_truth),
        ("normalize_rewards", normalize, normalize_truth),
    ]


def max_error(got: Any, want: Any) -> float:
    import torch

    if isinstance(want, torch.Tensor):
        got, want = (got,), (want,)
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"shape {tuple(a.shape)}, expected {tuple(b.shape)}")
        diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
        scale = 1 + b.detach().double().cpu().abs()
        worst = max(worst, float((diff / scale).max()) if diff.numel() else 0.0)
    return worst


def check_kernels(tolerance: float = 1e-4) -> list[Check]:
    """Every op on every back end: ``torch`` and ``cpp`` on the CPU, ``cuda`` and ``triton`` on a GPU (or Triton's
    interpreter on the CPU when TRITON_INTERPRET=1)."""
    import torch

    from palestra.kernels import KernelBuildError, set_backend
    from palestra.kernels.dispatch import (
        BackendUnavailable,
        forced_backend,
        triton_available,
    )

    has_cuda = torch.cuda.is_available()
    plan: list[tuple[str, str | None]] = [("torch", "cpu"), ("cpp", "cpu")]  # (back end, device; None: none fits)
    if has_cuda:
        plan += [("torch", "cuda"), ("cuda", "cuda"), ("triton", "cuda")]
    else:
        plan += [("cuda", None), ("triton", "cpu")]
    checks: list[Check] = []
    previous = forced_backend()
    try:
        for backend, device in plan:
            if device is None:
                checks.append(
                    Check("kernels", f"{backend}", SKIPPED, "no CUDA device (torch.cuda.is_available() is False)")
                )
                continue
            if backend == "triton" and (reason := triton_available(torch.device(device))):
                checks.append(Check("kernels", f"{backend}", SKIPPED, reason))
                continue
            set_backend(backend)
            cases = kernel_cases(torch.device(device))
            for op, fn, truth in cases:
                name = f"{op}/{backend}" + ("" if device == "cpu" or backend == "cuda" else f"@{device}")
                started = time.perf_counter()
                try:
                    err = max_error(fn(), truth())
                except BackendUnavailable as e:
                    checks.append(Check("kernels", name, SKIPPED, e.reason))
                    continue
                except KernelBuildError as e:
                    checks.append(Check("kernels", name, FAILED, f"{backend} build failed: {e.reason}"))
                    continue
                except Exception as e:  # noqa: BLE001
                    checks.append(Check("kernels", name, FAILED, one_line(e)))
                    continue
                seconds = time.perf_counter() - started  # the first op of a native back end includes its build
                status = OK if err <= tolerance else FAILED
                detail = f"max rel. error {err:.1e} (tolerance {tolerance:.0e}); {seconds:.2f} s" + (
                    "" if seconds < 2 else " (includes the build)"
                )
                checks.append(
                    Check("kernels", name, status, detail, {"max_error": err, "seconds": seconds, "device": device})
                )
    finally:
        set_backend(previous)
    return checks


# ---- 3. utilisation ----------------------------------------------------------------------------------------
def cpu_times() -> tuple[float, float] | None:
    """``(busy, total)`` jiffies of all CPUs from /proc/stat; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def gpu_utilisation() -> tuple[list[float], str] | None:
    """Percent busy per GPU, and where the number came from (NVML through torch, else nvidia-smi)."""
    import torch

    with contextlib.suppress(Exception):  # torch.cuda.utilization needs pynvml
        return [float(torch.cuda.utilization(i)) for i in range(torch.cuda.device_count())], "NVML"
    try:
        out = run_tool(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"])
        return [float(x) for x in out.split()], "nvidia-smi"
    except Exception:  # noqa: BLE001
        return None


class UtilisationSampler:
    """Machine CPU use (/proc/stat), this process's CPU time and GPU use, over a block of work."""

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.gpu: list[list[float]] = []
        self.gpu_source: str | None = None
        self._stop = threading.Event()

    @contextmanager
    def measure(self) -> Iterator[dict[str, Any]]:
        import torch

        result: dict[str, Any] = {}
        thread = None
        if torch.cuda.is_available():
            thread = threading.Thread(target=self._poll_gpu, daemon=True)
            thread.start()
        cpu0, proc0, wall0 = cpu_times(), os.times(), time.perf_counter()
        try:
            yield result
        finally:
            wall = time.perf_counter() - wall0
            proc1, cpu1 = os.times(), cpu_times()
            self._stop.set()
            if thread is not None:
                thread.join()
            result["seconds"] = wall
            cpu_s = sum(proc1[:4]) - sum(
                proc0[:4]
            )  # user + system, of this process and its finished children (a build)
            result["process_cores"] = cpu_s / max(wall, 1e-9)
            if cpu0 is not None and cpu1 is not None and cpu1[1] > cpu0[1]:
                result["machine_cpu_percent"] = 100 * (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1])
            if self.gpu:
                per_gpu = list(zip(*self.gpu))
                result["gpu_percent_mean"] = [sum(x) / len(x) for x in per_gpu]
                result["gpu_percent_max"] = [max(x) for x in per_gpu]
                result["gpu_source"] = self.gpu_source

    def _poll_gpu(self) -> None:
        while True:
            sample = gpu_utilisation()
            if sample is None:
                return
            self.gpu.append(sample[0])
            self.gpu_source = sample[1]
            if self._stop.wait(self.period):
                return


def describe_utilisation(u: dict[str, Any]) -> str:
    parts = [f"this process (and its child processes) used {u['process_cores']:.2f} of {os.cpu_count()} cores"]
    if "machine_cpu_percent" in u:
        parts.append(f"machine CPU {u['machine_cpu_percent']:.0f}% busy")
    if "gpu_percent_mean" in u:
        parts.append(
            "GPU "
            + ", ".join(f"{m:.0f}% mean/{x:.0f}% max" for m, x in zip(u["gpu_percent_mean"], u["gpu_percent_max"]))
            + f" ({u['gpu_source']})"
        )
    return f"over {u['seconds']:.2f} s: " + "; ".join(parts)


def sample_utilisation(seconds: float = 1.0) -> list[Check]:
    """What the machine is doing before any of our work: other processes competing for the CPU or the GPU."""
    import torch

    checks: list[Check] = []
    with UtilisationSampler().measure() as u:
        time.sleep(seconds)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if "machine_cpu_percent" in u:
        detail = (
            f"{u['machine_cpu_percent']:.0f}% of {os.cpu_count()} cores busy over {u['seconds']:.1f} s"
            " (other processes)"
        )
        if load:
            detail += f"; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        checks.append(Check("utilisation", "cpu", OK, detail, {**u, "load_average": load, "cores": os.cpu_count()}))
    else:
        checks.append(
            Check(
                "utilisation",
                "cpu",
                SKIPPED,
                "no /proc/stat on this system" + (f"; load average {load[0]:.2f}" if load else ""),
            )
        )
    if not torch.cuda.is_available():
        checks.append(Check("utilisation", "gpu", SKIPPED, "no CUDA device"))
    elif "gpu_percent_mean" in u:
        pct = ", ".join(f"cuda:{i} {m:.0f}%" for i, m in enumerate(u["gpu_percent_mean"]))
        checks.append(
            Check(
                "utilisation",
                "gpu",
                OK,
                f"{pct} busy over {u['seconds']:.1f} s (other processes; {u['gpu_source']})",
                u,
            )
        )
    else:
        checks.append(
            Check("utilisation", "gpu", SKIPPED, "neither NVML (pip install nvidia-ml-py) nor nvidia-smi answered")
        )
    return checks


# ---- 4. the data pipeline ----------------------------------------------------------------------------------
class TimedEnvironment:
    """Wraps an environment so that every reset/step runs under the data timeout and is timed."""

    def __init__(self, env: Any, timeout_s: float | None) -> None:
        self.env, self.timeout_s = env, timeout_s
        self.max_turns = env.max_turns
        self.seconds = {"reset": 0.0, "step": 0.0}
        self.steps = 0

    # The wrapped environment's, read and written through, so the wrapper is an Environment too.
    @property
    def agent_ids(self) -> tuple[str, ...]:
        return self.env.agent_ids

    @agent_ids.setter
    def agent_ids(self, value: tuple[str, ...]) -> None:
        self.env.agent_ids = value

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> Any:
        from palestra.engine.watchdog import call_with_timeout

        started = time.perf_counter()
        out = call_with_timeout(
            lambda: self.env.reset(batch_size, seed=seed, group_size=group_size), self.timeout_s, "environment.reset"
        )
        self.seconds["reset"] += time.perf_counter() - started
        return out

    def step(self, actions: Any) -> Any:
        from palestra.engine.watchdog import call_with_timeout

        started = time.perf_counter()
        out = call_with_timeout(lambda: self.env.step(actions), self.timeout_s, "environment.step")
        self.seconds["step"] += time.perf_counter() - started
        self.steps += 1
        return out


def check_data(config: Config) -> list[Check]:
    """One batch (``train.batch_size`` x ``train.group_size`` episodes) with empty completions, and its reward."""
    from palestra.config import build_component
    from palestra.engine.rollout import reward_rows, run_episodes
    from palestra.engine.watchdog import call_with_timeout

    t = config.train
    checks: list[Check] = []
    started = time.perf_counter()
    env = TimedEnvironment(build_component("environment", config.environment, path="environment"), t.data_timeout_s)
    reward = build_component("reward", config.reward, path="reward")
    build_s = time.perf_counter() - started
    episodes = run_episodes(env, lambda obs: [""] * len(obs), t.batch_size, seed=0, group_size=t.group_size)
    rows = len(episodes)
    limit = f"train.data_timeout_s={t.data_timeout_s:g}" if t.data_timeout_s is not None else "no train.data_timeout_s"
    checks.append(
        Check(
            "data",
            f"environment {config.environment.name}",
            OK,
            f"{rows} episodes: reset {env.seconds['reset'] * 1e3:.1f} ms, {env.steps} step(s) "
            f"{env.seconds['step'] * 1e3:.1f} ms "
            f"(build {build_s * 1e3:.0f} ms; {limit})",
            {
                "episodes": rows,
                "reset_s": env.seconds["reset"],
                "step_s": env.seconds["step"],
                "steps": env.steps,
                "build_s": build_s,
            },
        )
    )
    started = time.perf_counter()
    scored = call_with_timeout(lambda: reward(*reward_rows(episodes)), t.data_timeout_s, "reward")
    reward_s = time.perf_counter() - started
    scores = scored.scores.float()
    checks.append(
        Check(
            "data",
            f"reward {config.reward.name}",
            OK,
            f"{rows} rows (empty completions) in {reward_s * 1e3:.1f} ms; mean {float(scores.mean()):.3f}",
            {"rows": rows, "seconds": reward_s, "mean": float(scores.mean())},
        )
    )
    return checks


# ---- 5. one training step ----------------------------------------------------------------------------------
def parameter_group(name: str) -> str:
    """The group a parameter is reported in: its layer (``blocks.3``, ``model.layers.0``), else its module."""
    parts = name.split(".")[:-1] or [name]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts)


class GradientRecorder:
    """Each parameter's gradient norm as accumulated by backward, before clipping (the update zeroes grads after
    its optimiser step, so they are read by post-accumulate hooks while they exist)."""

    def __init__(self, named_parameters: Iterator[tuple[str, Any]]) -> None:
        self.norms: dict[str, float] = {}
        self.nonfinite: set[str] = set()
        self.sizes: dict[str, int] = {}
        self.handles = []
        for name, p in named_parameters:
            if not p.requires_grad:
                continue
            self.sizes[name] = p.numel()
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[[Any], None]:
        def record(p: Any) -> None:
            norm = float(p.grad.detach().float().norm())
            self.norms[name] = norm
            if not math.isfinite(norm):
                self.nonfinite.add(name)

        return record

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def groups(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, size in self.sizes.items():
            g = out.setdefault(
                parameter_group(name), {"params": 0, "tensors": 0, "sq": 0.0, "nonfinite": False, "reached": 0}
            )
            g["params"] += size
            g["tensors"] += 1
            if name in self.norms:
                g["reached"] += 1
                g["sq"] += self.norms[name] ** 2
            g["nonfinite"] |= name in self.nonfinite
        return out


class PreparedBatch:
    """A plugin, registered for the doctor's one step, that keeps the batch the update trained on (advantages and
    reference log-probs set), to explain zero gradients."""

    def __init__(self) -> None:
        self.batch: Any = None

    @hookimpl
    def on_update_end(self, batch: Any) -> None:
        self.batch = batch

    @contextmanager
    def registered(self) -> Iterator[None]:
        manager = get_plugin_manager()
        manager.register(self, name="palestra_doctor_prepared_batch")
        try:
            yield
        finally:
            manager.unregister(self)


def check_training(config: Config, threshold: float) -> list[Check]:
    """Build the Trainer exactly as ``palestra train`` does and run one step, recording gradients and utilisation."""

    from palestra.engine.trainer import Trainer

    checks: list[Check] = []
    started = time.perf_counter()
    trainer = Trainer(config)
    build_s = time.perf_counter() - started
    policy = trainer.policy
    recorder = GradientRecorder(policy.named_parameters())
    prepared = PreparedBatch()
    started = time.perf_counter()
    for _, fn, _ in kernel_cases(trainer.device):  # build the step's kernel back end now, not inside the timed step
        with contextlib.suppress(Exception):  # a broken back end fails in the step itself, with its message
            fn()
    warmup_s = time.perf_counter() - started
    try:
        with UtilisationSampler().measure() as u, skip_reasons() as reasons, prepared.registered():
            metrics = trainer.step()
    finally:
        recorder.remove()
    skipped = metrics.get("train/skipped", 0.0) > 0
    cause = skip_cause(reasons)
    checks.append(
        Check(
            "training",
            "step",
            FAILED if skipped else OK,
            f"{config.optimizer.name} on {config.policy.name} ({sum(recorder.sizes.values()):,} trainable parameters), "
            f"{config.train.batch_size}x{config.train.group_size} "
            f"rows: {metrics.get('perf/step_s', u['seconds']):.2f} s "
            f"(build {build_s:.2f} s, kernels {warmup_s:.2f} s)"
            + (
                f"; the step was SKIPPED (no update): {cause}"
                if skipped
                else f"; loss {metrics.get('loss', math.nan):.4g}, reward {metrics.get('reward/mean', math.nan):.3f}, "
                f"grad norm {metrics.get('grad/norm', math.nan):.3g}"
            ),
            {
                "metrics": metrics,
                "build_s": build_s,
                "kernel_warmup_s": warmup_s,
                **({"skipped_because": cause} if skipped else {}),
            },
        )
    )
    checks.append(Check("training", "utilisation", OK, describe_utilisation(u), u))
    checks += gradient_checks(recorder.groups(), skipped, threshold, prepared.batch)
    return checks


def gradient_checks(groups: dict[str, Any], skipped: bool, threshold: float, batch: Any) -> list[Check]:
    """One check per parameter group's gradient after the step, and one for the flow as a whole."""
    import torch

    checks: list[Check] = []
    if skipped:
        # A skipped step applies no gradient (a bad reward stops it before backward; a bad loss or norm zeroes the
        # gradients), so per-group "zero gradients" would be one misleading failure per layer: the step's failure
        # above is the finding. Groups whose gradient was already NaN/inf do locate a bad backward, so name them.
        bad = [name for name, g in groups.items() if g["nonfinite"]]
        where = f"; NaN/inf gradients in {', '.join(bad)}" if bad else ""
        checks.append(
            Check(
                "training",
                "gradient flow",
                SKIPPED,
                f"not checked: the step was skipped (see training/step){where}",
                {"nonfinite_groups": bad},
            )
        )
        return checks
    flat_zero = [name for name, g in groups.items() if g["reached"] == 0 or g["sq"] == 0.0]
    for name, g in groups.items():
        norm = math.sqrt(g["sq"])
        flags = []
        if g["nonfinite"] or not math.isfinite(norm):
            flags.append("NaN/inf gradients")
        elif g["reached"] == 0:
            flags.append("zero gradients (no gradient reached it)")
        elif norm == 0.0:
            flags.append("zero gradients")
        elif norm > threshold:
            flags.append(f"exploding gradients (> {threshold:g})")
        tensors = f"{g['tensors']} tensor" + ("s" if g["tensors"] != 1 else "")
        detail = f"grad norm {norm:.3e} over {g['params']:,} parameters ({tensors})"
        checks.append(
            Check(
                "training",
                f"grads/{name}",
                FAILED if flags else OK,
                detail + ("; " + ", ".join(flags) if flags else ""),
                {"group": name, "grad_norm": norm, "params": g["params"], "tensors": g["tensors"], "flags": flags},
            )
        )
    if groups and len(flat_zero) == len(groups):
        checks.append(Check("training", "gradient flow", FAILED, zero_gradient_hint(batch, torch)))
    return checks


@contextmanager
def skip_reasons() -> Iterator[dict[str, list[str]]]:
    """Why a step was skipped, in the engine's own words: the trainer's NonFiniteStepWarning and the learner's
    log line. Other warnings raised meanwhile are issued again as usual."""
    from palestra.engine.trainer import NonFiniteStepWarning

    reasons: dict[str, list[str]] = {"trainer": [], "learner": []}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons["learner"].append(record.getMessage())

    logger, handler = logging.getLogger("palestra.engine.learner"), Collect(logging.WARNING)
    logger.addHandler(handler)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NonFiniteStepWarning)
            yield reasons
    finally:
        logger.removeHandler(handler)
        for w in caught:
            if issubclass(w.category, NonFiniteStepWarning):
                reasons["trainer"].append(str(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def skip_cause(reasons: dict[str, list[str]]) -> str:
    """The learner's line names the pass and micro-batch of a bad update; the trainer's names a bad reward.
    Their framing ("step 1 skipped: ...", the count in a row) is dropped: the report line already says it."""
    if reasons["learner"]:
        return reasons["learner"][0].partition("skipped the optimiser step: ")[2] or reasons["learner"][0]
    if reasons["trainer"]:
        text = re.sub(r"^step \d+ skipped: ", "", reasons["trainer"][0])
        return re.sub(r" \(\d+ in a row, limit [^)]*\)$", "", text)
    return "a non-finite reward, loss or gradient"


def zero_gradient_hint(batch: Any, torch: Any) -> str:
    """Why every gradient is zero, when the batch says so (all advantages zero is the usual cause)."""
    msg = "every parameter group has zero gradients"
    if batch is None:
        return msg
    adv = batch.advantages
    if adv is not None and float(adv.abs().max()) == 0.0:
        rewards = batch.rewards.float()
        spread = (
            "every reward in the batch is equal"
            if float(rewards.max() - rewards.min()) == 0
            else "rewards are equal within each group"
        )
        return (
            f"{msg}: all advantages are 0 ({spread}, reward {float(rewards.mean()):.3g});"
            " check the reward and the entropy/KL terms"
        )
    return msg
