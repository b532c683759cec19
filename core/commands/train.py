"""Train a policy: resolve the config, load the plugins, build and check the components, run the trainer, report."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

import yaml

from ..config import ComponentSpec, Config, ConfigError, load_config, to_plain

if TYPE_CHECKING:
    from ..trainer import EvalResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a .yaml/.yml/.toml config (default: the built-in task)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides such as train.lr=3e-4")


def summary(config: Config) -> list[str]:
    """One line per component: what will be built, and with which options."""
    lines = [f"run: {config.run.name} (seed {config.run.seed}, output {config.run.output_dir}/{config.run.name})"]
    for key in ("environment", "reward", "policy", "optimizer", "generator"):
        spec = getattr(config, key)
        lines.append(f"{key}: {_describe(spec)}" if spec is not None else f"{key}: (none configured)")
    lines.append("loggers: " + (", ".join(_describe(s) for s in config.loggers) or "(none configured)"))
    t = config.train
    lines.append(
        f"train: {t.steps} steps x {t.batch_size} tasks x {t.group_size} completions, lr {t.lr}, "
        f"max_new_tokens {t.max_new_tokens}; kernels: {config.kernels.backend}"
    )
    return lines


def _describe(spec: ComponentSpec) -> str:
    options = to_plain(spec)["options"]
    inline = yaml.safe_dump(options, default_flow_style=True, sort_keys=False, width=10**9).strip()
    return f"{spec.name} {inline}" if options else spec.name


def format_before_after(before: EvalResult, after: EvalResult) -> list[str]:
    """The table `palestra train` ends with: held-out reward (and each component) before and after training."""
    rows = [("reward (total)", before.reward, after.reward)]
    rows += [(k, before.components.get(k, math.nan), v) for k, v in after.components.items() if "/" not in k]
    width = max(len(r[0]) for r in rows)
    best = f" (max {after.max_score:g})" if after.max_score is not None else ""
    lines = [f"held-out reward on {after.tasks} tasks, greedy{best}:", f"  {'':<{width}}  {'before':>8}  {'after':>8}"]
    lines += [f"  {name:<{width}}  {b:>8.3f}  {a:>8.3f}" for name, b, a in rows]
    return lines



def run(args: argparse.Namespace) -> int:
    for item in args.overrides:
        if "=" not in item and item.endswith((".yaml", ".yml", ".toml")):
            raise ConfigError(f"{item!r} looks like a config file; pass it as --config {item}")
    config = load_config(args.config, args.overrides)
    from ..trainer import Trainer  # torch is only imported once the config is valid

    trainer = Trainer(config)  # builds and checks every component: a bad one stops here, with one line
    for line in summary(config):
        print(line)
    result = trainer.train()
    print(f"trained {result.steps} steps in {result.seconds:.1f} s; run directory {result.run_dir}")
    for line in format_before_after(result.before, result.after):
        print(line)
    if (result.run_dir / "metrics.jsonl").exists():
        from ..plotting import plot_dashboard

        print(f"plot: {plot_dashboard(result.run_dir)}")
    return 0
