"""Read a run's ``metrics.jsonl`` and draw it as one PNG dashboard (``palestra plot RUN_DIR``).

The dashboard is a grid of panels, one per group of metrics that the run logged: reward (mean, EMA, each
reward component, held-out eval points, the maximum as a dashed line), policy entropy, KL, clip fraction,
value loss, explained variance, grad norm, update ratio (log scale), response length, tokens/s; every
other numeric metric lands in a panel named after its first path component (``perf/step_s`` -> "perf"),
one curve per key. A key that extends a known metric (``policy/entropy/responder``, as per-agent metrics
are named) is drawn as an extra curve in that metric's panel. Panels without data are left out; a panel whose
curves never changed (a clip fraction of 0, a constant learning rate) is one line of a last "constants" box
instead. Timings and diagnostics fit their y-axis to the bulk of their values and mark outliers at its edge, and
legends sit beside the axes, never over the curves.

matplotlib is imported only when drawing, and only through its object API with the Agg canvas (no pyplot,
no global backend switch), so this works headless and inside other programs.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
DASHBOARD_FILE = "dashboard.png"
_NOT_METRICS = ("step", "time")


class MetricsNotFoundError(FileNotFoundError):
    """The run directory or its metrics file is missing (a user error: one line naming the path)."""

    palestra_user_error = True

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DashboardWriteFailed(OSError):
    """The image could not be written (a full disk, a read-only folder): one line; no partial file is left."""

    palestra_user_error = True


class MetricsFileWarning(UserWarning):
    """Lines of a metrics file that could not be read, so records a plot leaves out: how many, where and why."""


# ---- reading -----------------------------------------------------------------------------------------
def metrics_path(run_dir: str | Path) -> Path:
    """``<run_dir>/metrics.jsonl`` (or ``run_dir`` itself when it names a file); raises when it does not exist."""
    path = Path(run_dir)
    if path.is_file():
        return path
    if not path.exists():
        raise MetricsNotFoundError(f"run directory {str(path)!r} does not exist")
    if not (path / METRICS_FILE).is_file():
        raise MetricsNotFoundError(f"{str(path)!r} has no {METRICS_FILE} (was the run logged with the jsonl logger?)")
    return path / METRICS_FILE


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's ``metrics.jsonl``, in file order, with ``null`` read back as NaN.

    Unreadable lines (not JSON, JSON but not an object, a last line cut short because the run stopped
    mid-write) are dropped with one :class:`MetricsFileWarning` that says how many, where and why: a plot
    must not quietly miss records.
    """
    path = metrics_path(run_dir)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    # the last line is cut short when no newline follows it: the logger writes each record with its newline
    cut_short = bool(lines) and "\n" not in text[len("\n".join(lines)) :]
    records: list[dict[str, Any]] = []
    bad: dict[str, list[int]] = {"not JSON": [], "not a JSON object": [], "cut short": []}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad["cut short" if cut_short and number == len(lines) else "not JSON"].append(number)
            continue
        if not isinstance(record, dict):
            bad["not a JSON object"].append(number)
            continue
        records.append({k: (math.nan if v is None else v) for k, v in record.items()})
    skipped = sorted(n for numbers in bad.values() for n in numbers)
    if skipped:
        why = [f"{len(bad[k])} {k}" for k in ("not JSON", "not a JSON object") if bad[k]]
        if bad["cut short"]:
            why.append("the last line is cut short (the run stopped mid-write)")
        warnings.warn(
            f"{path}: skipped {len(skipped)} unreadable line(s) (first at line {skipped[0]}): {', '.join(why)}; "
            "their records are left out",
            MetricsFileWarning,
            stacklevel=2,
        )
    return records


# ---- planning the panels -----------------------------------------------------------------------------
@dataclass
class Series:
    """One curve: ``values[i]`` was logged at ``steps[i]``; ``style`` is 'line', 'points' or 'hline' (a constant)."""

    label: str
    steps: list[float]
    values: list[float]
    style: str = "line"


@dataclass
class Panel:
    title: str
    series: list[Series] = field(default_factory=list)
    log_y: bool = False
    legend: bool = False  # also with one curve (a group panel, whose title does not name the curve)
    # Timings and diagnostics have outliers (the first step's kernel build, one huge logit norm) that would flatten
    # every other point: their y-range is fitted to the bulk and the outliers are marked at its edge.
    robust: bool = False
    text: list[str] = field(default_factory=list)  # a text panel (the "constants" box): these lines, no axes


@dataclass(frozen=True)
class _Known:
    """A panel for known metric keys: ``keys`` exactly, or any key under ``prefix`` when it is set."""

    title: str
    keys: tuple[str, ...] = ()
    prefix: str | None = None
    log_y: bool = False
    robust: bool = False


# In dashboard order. Per-agent variants (``<key>/<agent>``) of these keys join their panel.
KNOWN_PANELS: tuple[_Known, ...] = (
    _Known("reward", prefix="reward/"),
    _Known("reward per agent", prefix="reward/agent/"),  # multi-agent: each agent's own turn's reward
    _Known("policy entropy", ("policy/entropy",)),
    _Known("KL to reference", ("policy/kl",)),
    _Known("clip fraction", ("policy/clip_frac",)),
    _Known("value loss", ("value/loss",)),
    _Known("explained variance", ("value/explained_var",)),
    _Known("grad norm", ("grad/norm",), robust=True),
    _Known("update ratio", ("grad/update_ratio",), log_y=True),
    _Known("response length", ("response/length",)),
    _Known("tokens/s", ("perf/tokens_per_s", "perf/gen_tokens_per_s"), robust=True),  # step, and generation alone
    _Known("loss", ("loss",)),
    _Known("learning rate", ("lr",)),
)


def _numeric_columns(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """key -> (steps, values) for every key with at least one finite number, in first-seen key order."""
    columns: dict[str, tuple[list[float], list[float]]] = {}
    for i, record in enumerate(records):
        step = record.get("step", i)
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            step = i
        for key, value in record.items():
            if value is None:
                value = math.nan  # JSON null: a non-finite value, kept as a gap in the curve
            if key in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            steps, values = columns.setdefault(key, ([], []))
            steps.append(float(step))
            values.append(float(value))
    return {k: v for k, v in columns.items() if any(math.isfinite(x) for x in v[1])}


def _belongs(key: str, known: _Known) -> bool:
    if known.prefix is not None:
        return key.startswith(known.prefix)
    return any(key == k or key.startswith(k + "/") for k in known.keys)


def _label(key: str, known: _Known | None) -> str:
    """The legend entry: the key without the part the panel's title already says."""
    if known is not None and known.prefix is not None:
        return key[len(known.prefix) :] or key
    if known is not None:
        for k in known.keys:
            if key.startswith(k + "/"):
                return key[len(k) + 1 :]
        return key.rsplit("/", 1)[-1]  # the key itself (beside its per-agent variants, or a sibling key)
    return key.split("/", 1)[1] if "/" in key else key


def plan_panels(records: Iterable[Mapping[str, Any]]) -> list[Panel]:
    """The dashboard's panels, in order, for these records (no drawing; the tests check this)."""
    columns = _numeric_columns(records)
    known_members: dict[str, list[str]] = {p.title: [] for p in KNOWN_PANELS}
    extra_groups: dict[str, list[str]] = {}
    eval_reward: list[str] = []
    for key in columns:
        if key == "eval/reward" or key.startswith("eval/reward/"):
            eval_reward.append(key)  # held-out reward: points on the reward panel
            continue
        # the most specific panel: reward/agent/<id> goes to "reward per agent", not "reward"
        home = max((p for p in KNOWN_PANELS if _belongs(key, p)), key=lambda p: len(p.prefix or ""), default=None)
        if home is not None:
            known_members[home.title].append(key)
        else:
            extra_groups.setdefault(key.split("/", 1)[0], []).append(key)

    panels: list[Panel] = []
    for known in KNOWN_PANELS:
        keys = known_members[known.title]
        if known.title == "reward":
            keys = keys + eval_reward
        if not keys:
            continue
        panel = Panel(known.title, log_y=known.log_y, robust=known.robust)
        for key in _reward_order(keys) if known.title == "reward" else keys:
            steps, values = columns[key]
            if key in eval_reward:
                panel.series.append(Series("eval" + key[len("eval/reward") :], steps, values, style="points"))
            elif key == "reward/max":
                panel.series.append(Series("max", steps, values, style="hline"))
            else:
                panel.series.append(Series(_label(key, known), steps, values))
        panels.append(panel)
    for group in sorted(extra_groups):
        panel = Panel(group, legend=True, robust=group != "eval")
        for key in extra_groups[group]:
            steps, values = columns[key]
            # held-out evaluation runs every few steps: markers, like the eval points on the reward panel
            panel.series.append(Series(_label(key, None), steps, values, style="points" if group == "eval" else "line"))
        panels.append(panel)
    return fold_constants(panels)


CONSTANT_TITLE = "constants"


def is_constant(series: Series) -> bool:
    """Whether a curve says one number: every finite value equal to within a millionth (a ratio logged as
    1 +- 1e-7 is 1; a flat line and an axis reading "1e-7+1" would take a panel to say it)."""
    finite = [v for v in series.values if math.isfinite(v)]
    if series.style != "line" or not finite:
        return False
    low, high = min(finite), max(finite)
    return high - low <= 1e-6 * max(1.0, abs(low), abs(high))


def fold_constants(panels: list[Panel]) -> list[Panel]:
    """Panels whose every curve is constant leave the grid, each curve becoming one line of a last "constants"
    panel (``clip fraction: 0``, ``learning rate: 1e-05``)."""
    kept: list[Panel] = []
    lines: list[str] = []
    for panel in panels:
        if panel.series and all(is_constant(s) for s in panel.series):
            for s in panel.series:
                value = next(v for v in s.values if math.isfinite(v))
                # an extra group's curve by its key (perf/step_s), a known panel's by its title
                name = f"{panel.title}/{s.label}" if panel.legend else panel.title
                name += f" ({s.label})" if len(panel.series) > 1 and not panel.legend else ""
                lines.append(f"{name}: {value:.4g}")
        else:
            kept.append(panel)
    if lines:
        kept.append(Panel(CONSTANT_TITLE, text=lines))
    return kept


def robust_range(values: Iterable[float], fence: float = 3.0, share: float = 0.01) -> tuple[float, float] | None:
    """The y-range of the bulk of ``values`` when a few outliers would flatten it: the values within ``fence``
    interquartile ranges of the quartiles (Tukey's fences). None, and the whole range is drawn, unless the values
    outside are few (at most ``share`` of them, at least one) and drawing them would at least double the range: a
    step that built the kernels, one huge logit norm, not a heavy tail or a series of a few discrete levels."""
    finite = sorted(v for v in values if math.isfinite(v))
    if len(finite) < 5:
        return None
    q1, q3 = _quantile(finite, 0.25), _quantile(finite, 0.75)
    spread = (q3 - q1) or 1e-3 * max(abs(q1), abs(q3), 1e-12)
    low, high = q1 - fence * spread, q3 + fence * spread
    inside = [v for v in finite if low <= v <= high]
    outside = len(finite) - len(inside)
    if outside == 0 or outside > max(1, int(share * len(finite))):
        return None
    bulk = max(inside) - min(inside)
    if finite[-1] - finite[0] < 2 * bulk:
        return None
    return min(inside), max(inside)


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between the two nearest (numpy's default)."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _reward_order(keys: list[str]) -> list[str]:
    """mean, then EMA, then the components in logged order, then eval points, then the maximum."""
    first = [k for k in ("reward/mean", "reward/ema") if k in keys]
    last = [k for k in keys if k == "reward/max"]
    evals = [k for k in keys if k.startswith("eval/")]
    return first + [k for k in keys if k not in first and k not in last and k not in evals] + evals + last


# ---- drawing -----------------------------------------------------------------------------------------
def plot_dashboard(run_dir: str | Path, out: str | Path | None = None, *, columns: int = 3) -> Path:
    """Draw ``<run_dir>/metrics.jsonl`` as a grid of panels into ``out`` (default ``<run_dir>/dashboard.png``)."""
    path = metrics_path(run_dir)
    run_path = path.parent  # the run directory, also when run_dir named the metrics file itself
    records = read_metrics(path)
    panels = plan_panels(records)
    if not panels:
        raise ValueError(f"{path}: no numeric metrics to plot ({len(records)} record(s))")
    target = Path(out) if out is not None else run_path / DASHBOARD_FILE
    # Drawn into a temporary file beside the target and renamed over it: a full disk or a signal mid-write never
    # leaves half an image where the previous dashboard was.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _sweep_dead_drawings(target)
        draw_panels(panels, tmp, title=run_path.resolve().name, columns=columns, format=target.suffix[1:] or "png")
        os.replace(tmp, target)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and e.filename != str(tmp) else ""
        raise DashboardWriteFailed(f"writing {target} failed: {e.strerror or e}{where}; it was not written") from e
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _sweep_dead_drawings(target: Path) -> None:
    """Remove the ``.NAME.PID.tmp`` files that drawings of ``target`` killed mid-write left (their process is gone)."""
    from palestra.engine.run_lock import left_by_dead

    for stale in left_by_dead(target.parent, f".{target.name}.", ".tmp"):
        if stale.is_file():
            stale.unlink(missing_ok=True)


COLUMN_WIDTH = 6.4  # inches per grid column: the axes, then the legend beside them
LEGEND_ROOM = 1.45  # inches right of each axes for its legend, outside the curves


def draw_panels(panels: list[Panel], out: Path, *, title: str, columns: int = 3, format: str | None = None) -> None:
    """Draw ``panels`` into the image file ``out`` (``format``: png, svg, pdf, ...; None: from ``out``'s suffix)."""
    build_figure(panels, title=title, columns=columns).savefig(out, dpi=100, format=format)


def build_figure(panels: list[Panel], *, title: str, columns: int = 3) -> Any:
    """The dashboard as a matplotlib Figure on an Agg canvas (not yet saved)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = max(1, min(columns, len(panels)))
    nrows = math.ceil(len(panels) / ncols)
    height = 3.4 * nrows + 0.7
    width = COLUMN_WIDTH * ncols
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=14, fontweight="bold", y=1 - 0.15 / height, va="top")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    steps = [x for p in panels for s in p.series for x in s.steps]
    pad = 0.02 * (max(steps) - min(steps)) or 0.5 if steps else 0.5  # room for markers on the first and last step
    span = (min(steps) - pad, max(steps) + pad) if steps else (0.0, 1.0)
    for ax, panel in zip(axes.flat, panels):
        if panel.text:
            _draw_text_panel(ax, panel)
            continue
        _draw_panel(ax, panel)
        ax.set_xlim(*span)  # one step axis for every panel, so events line up down the grid
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    for column in range(ncols):  # under the lowest plot of each column (a text panel has no step axis)
        plots = [axes[r][column] for r in range(nrows) if r * ncols + column < len(panels)]
        plots = [ax for ax, r in zip(plots, range(nrows)) if not panels[r * ncols + column].text]
        if plots:
            plots[-1].set_xlabel("step")
    # Fixed margins rather than constrained layout: as readable for a uniform grid, and half the drawing time.
    left, right = 0.75, LEGEND_ROOM + 0.05
    gap = LEGEND_ROOM + 0.8  # the legend of one panel, then the tick labels of the next
    axes_width = (width - left - right - (ncols - 1) * gap) / ncols
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=0.55 / height,
        top=1 - 0.85 / height,
        wspace=gap / axes_width,
        hspace=0.42,
    )
    return fig


def _draw_text_panel(ax: Any, panel: Panel) -> None:
    ax.set_title(panel.title)
    ax.set_axis_off()
    shown = panel.text if len(panel.text) <= 14 else [*panel.text[:13], f"... and {len(panel.text) - 13} more"]
    ax.text(0.0, 1.0, "\n".join(shown), va="top", ha="left", family="monospace", fontsize=8, transform=ax.transAxes)


def _draw_panel(ax: Any, panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for s in panel.series:
        if s.style == "hline":
            finite = [v for v in s.values if math.isfinite(v)]
            ax.axhline(finite[-1], linestyle="--", color="grey", linewidth=1, label=f"{s.label} ({finite[-1]:.3g})")
        elif s.style == "points":
            ax.plot(s.steps, s.values, linestyle="none", marker="o", markersize=4, label=s.label)
        else:
            # a single logged value would be an invisible line: show it as a marker
            ax.plot(s.steps, s.values, linewidth=1.4, marker="." if len(s.steps) == 1 else None, label=s.label)
    if panel.log_y and any(v > 0 for s in panel.series for v in s.values if math.isfinite(v)):
        ax.set_yscale("log", nonpositive="mask")
    else:  # 1e-4 as "1e-4" above the axis rather than "0.000100" on every tick: keeps the labels inside the margin
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        if panel.robust:
            _fit_to_bulk(ax, panel)
    ax.grid(True, alpha=0.3)
    if panel.legend or len(panel.series) > 1:
        # beside the axes, never over the curves
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _fit_to_bulk(ax: Any, panel: Panel) -> None:
    """Fit the y-axis to the bulk of the values (:func:`robust_range`) and mark each outlier at the edge it lies
    beyond: a triangle at its step, and the count in the corner."""
    values = [v for s in panel.series if s.style == "line" for v in s.values]
    bulk = robust_range(values)
    if bulk is None:
        return
    low, high = bulk
    margin = 0.08 * (high - low) or 0.05 * max(abs(high), 1e-12)
    bottom, top = low - margin, high + margin
    ax.set_ylim(bottom, top)
    above = [(x, v) for s in panel.series if s.style == "line" for x, v in zip(s.steps, s.values) if v > top]
    below = [(x, v) for s in panel.series if s.style == "line" for x, v in zip(s.steps, s.values) if v < bottom]
    for points, edge, marker in ((above, top, "^"), (below, bottom, "v")):
        if points:
            ax.plot(
                [x for x, _ in points],
                [edge] * len(points),
                linestyle="none",
                marker=marker,
                color="crimson",
                markersize=6,
                clip_on=False,
            )
    extremes = ", ".join(f"{v:.3g} at step {x:g}" for x, v in sorted(above + below, key=lambda p: -abs(p[1]))[:2])
    ax.text(
        0.99,
        0.97,
        f"{len(above) + len(below)} off the axis ({extremes})",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=7,
        color="crimson",
    )
