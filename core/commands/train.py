"""Train a policy: resolve the config, load the plugins, build and check the components, run the trainer, report."""

from __future__ import annotations

import argparse

import yaml

from ..config import (
    ComponentSpec,
    Config,
    ConfigError,
    load_config,
    to_plain,
)


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


def run(args: argparse.Namespace) -> int:
    for item in args.overrides:
        if "=" not in item and item.endswith((".yaml", ".yml", ".toml")):
            raise ConfigError(f"{item!r} looks like a config file; pass it as --config {item}")
    config = load_config(args.config, args.overrides)
    from ..trainer import (  # torch is only imported once the config is valid
        Trainer,
        format_before_after,
    )

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
