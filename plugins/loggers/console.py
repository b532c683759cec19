"""The ``console`` logger: a progress bar over ``train.steps`` on stderr, with the key metrics beside it.

On a terminal it is a tqdm bar whose postfix shows a few metrics (``reward 0.62 ema 0.55 ent 1.9 kl 0.01``).
When stderr is not a terminal (CI, a log file, ``2> run.log``) a redrawn bar would be unreadable, so it
writes one plain line every ``every`` steps instead: ``step 40/200 (20%) 1.3s/step eta 3m28s | reward 0.62 ...``.

``step`` is the number of training steps finished when ``log`` is called; the bar's total is
``config["train"]["steps"]``.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from palestra import hookimpl
from palestra.config import OptionError, check_options, option

RATE_WINDOW = 20  # logged intervals whose median is the step time behind s/step and the ETA

DEFAULT_KEYS = [
    "reward/mean",
    "reward/ema",
    "eval/reward",
    "policy/entropy",
    "policy/kl",
    "policy/clip_frac",
    "value/explained_var",
    "grad/norm",
    "response/length",
    "perf/tokens_per_s",
]

# Short names for the metrics shown by default, so the postfix fits beside the bar; others show their full key.
SHORT_NAMES = {
    "reward/mean": "reward",
    "reward/ema": "ema",
    "eval/reward": "eval",
    "policy/entropy": "ent",
    "policy/kl": "kl",
    "policy/clip_frac": "clip",
    "policy/ratio_mean": "ratio",
    "value/loss": "vloss",
    "value/explained_var": "ev",
    "grad/norm": "gnorm",
    "grad/update_ratio": "upd",
    "response/length": "len",
    "perf/tokens_per_s": "tok/s",
    "perf/step_s": "s/step",
}


@dataclass
class ConsoleOptions:
    keys: list[str] = field(default_factory=lambda: list(DEFAULT_KEYS))  # metrics to show, in order; '*' globs allowed
    every: int = option(10, ge=1)  # plain-line mode: a line on the first step, each multiple of this, and the last
    mode: Literal["auto", "bar", "lines"] = "auto"  # auto: a bar on a terminal, plain lines otherwise

    def __post_init__(self) -> None:
        for i, key in enumerate(self.keys):
            if not isinstance(key, str) or not key.strip():
                raise OptionError(f"keys[{i}]", f"must be a metric name such as 'reward/mean', got {key!r}")


def format_value(value: Any) -> str:
    """Four significant digits, without the exponent noise of ``%g`` for everyday magnitudes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan / inf: shown as they are, that is the news
    if isinstance(value, int):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e3:
        return f"{value:.4g}"
    if 1e3 <= abs(value) < 1e9:
        return f"{value:.0f}"  # tokens/s and the like: 12346, not 1.235e+04
    return f"{value:.3e}"


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def select_metrics(metrics: Mapping[str, Any], keys: list[str]) -> list[tuple[str, Any]]:
    """``(short name, value)`` for each of ``keys`` in ``metrics``, in the order of ``keys`` (globs expand sorted)."""
    chosen: list[str] = []
    for key in keys:
        matches = (
            sorted(k for k in metrics if fnmatch.fnmatchcase(k, key))
            if any(c in key for c in "*?[")
            else [key]
            if key in metrics
            else []
        )
        chosen += [m for m in matches if m not in chosen]
    return [(SHORT_NAMES.get(k, k), metrics[k]) for k in chosen]


def postfix(metrics: Mapping[str, Any], keys: list[str]) -> str:
    return " ".join(f"{name} {format_value(value)}" for name, value in select_metrics(metrics, keys))


class ConsoleLogger:
    """Progress and key metrics on stderr (a tqdm bar on a terminal, plain lines otherwise)."""

    def __init__(self, **options: Any) -> None:
        self.options: ConsoleOptions = check_options(ConsoleOptions, options, where="console")
        self.total: int | None = None
        self._stream: IO[str] | None = None
        self._bar: Any = None  # tqdm.tqdm when drawing a bar
        # (step, monotonic time) of the recent log calls: the rate is their median step time, so a slow start
        # (a kernel build, a model's first compile) neither inflates the ETA for the rest of the run nor hides in it.
        self._seen: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW + 1)
        self._last_line_step: int | None = None
        self._pending: tuple[int, Mapping[str, Any]] | None = None  # the latest log not yet written as a line

    def open(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        train = config.get("train") if isinstance(config, Mapping) else None
        steps = train.get("steps") if isinstance(train, Mapping) else None
        self.total = int(steps) if isinstance(steps, int) and steps > 0 else None
        self._stream = sys.stderr  # looked up now, not at import, so redirections made before the run are honoured
        self._seen.clear()
        self._last_line_step = self._pending = None
        mode = self.options.mode
        use_bar = mode == "bar" or (mode == "auto" and _isatty(self._stream))
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, desc=Path(run_dir).name or None, unit="step", file=self._stream, dynamic_ncols=True
            )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._stream is None:
            raise RuntimeError("console logger: log() was called before open() (or after close())")
        step = int(step)
        if self._bar is not None:
            target = min(step, self.total) if self.total is not None else step
            self._bar.set_postfix_str(postfix(metrics, self.options.keys), refresh=False)
            if target > self._bar.n:
                self._bar.update(target - self._bar.n)  # redraws (rate-limited by tqdm)
            else:
                self._bar.refresh()
            return
        if not self._seen or step > self._seen[-1][0]:
            self._seen.append((step, time.monotonic()))
        due = (
            self._last_line_step is None
            or step // self.options.every != self._last_line_step // self.options.every  # crossed a multiple of every
            or (self.total is not None and step >= self.total)
        )
        if due:
            self._write_line(step, metrics)
        else:
            self._pending = (step, dict(metrics))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._pending is not None:
            self._write_line(*self._pending)  # the final numbers are always shown
        if self._stream is not None:
            self._stream.flush()
        self._stream = None

    def step_time(self) -> float | None:
        """Seconds per step: the median over the last ``RATE_WINDOW`` logged intervals (None before two logs)."""
        seen = list(self._seen)
        rates = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(seen) if s1 > s0]
        return statistics.median(rates) if rates else None

    def _write_line(self, step: int, metrics: Mapping[str, Any]) -> None:
        assert self._stream is not None
        head = f"step {step}"
        if self.total is not None:
            head += f"/{self.total} ({100 * step / self.total:.0f}%)"
        # Only steps this process ran count: a resumed run does not count the steps it skipped.
        per_step = self.step_time()
        if per_step is not None:
            head += f" {per_step:.3g}s/step"
            if self.total is not None and step < self.total:
                head += f" eta {format_duration(per_step * (self.total - step))}"
        tail = postfix(metrics, self.options.keys)
        self._stream.write(head + (f" | {tail}" if tail else "") + "\n")
        self._stream.flush()
        self._last_line_step = step
        self._pending = None


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@hookimpl
def register_loggers(register: Any) -> None:
    register(
        "console",
        ConsoleLogger,
        options=ConsoleOptions,
        description="a progress bar over train.steps with key metrics on stderr (plain lines when not a terminal)",
    )
