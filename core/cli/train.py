"""Train a policy: resolve the config, load the plugins, build and check the components, run the trainer, report.

``--resume RUN_DIR`` continues a run from its newest checkpoint with the config saved in it; only the keys in
:data:`RESUMABLE_KEYS` (how long to train, how often to save, log and evaluate, the timeouts) may be overridden,
since anything else would make the continuation a different run. Under torchrun every rank runs this command;
rank 0 prints and plots.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING

import yaml

from palestra.config import ComponentSpec, Config, ConfigError, load_config, parse_override, to_plain, validate_config

if TYPE_CHECKING:
    from palestra.scale.distributed import DistributedContext
    from palestra.engine.trainer import EvalResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a .yaml/.yml/.toml config (default: the built-in task)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides such as train.lr=3e-4")


# What `--resume` lets you change: extend the run (train.steps; the LR schedule is recomputed for the new length)
# and how it saves, logs, evaluates and times out. Anything else would continue a different run.
RESUMABLE_KEYS = (
    "train.steps", "train.save_every", "train.keep_checkpoints", "train.log_every", "train.eval_every",
    "train.step_timeout_s", "train.data_timeout_s", "train.max_bad_steps", "distributed.timeout_s",
)


def resume_config(run_dir: str, overrides: list[str]) -> tuple[Config, str]:
    """The config saved in ``run_dir``'s newest checkpoint with the allowed overrides applied, and that checkpoint."""
    import torch

    from palestra.engine.checkpoint import find_resume_checkpoint
    from palestra.config import _set_path

    path = find_resume_checkpoint(run_dir)
    raw = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["config"]
    for item in overrides:
        keys, value = parse_override(item)
        dotted = ".".join(str(k) for k in keys)
        if dotted not in RESUMABLE_KEYS:
            raise ConfigError(f"{dotted}: cannot be changed with --resume (the run continues with its saved config); "
                              f"allowed: {', '.join(RESUMABLE_KEYS)}")
        _set_path(raw, keys, value)
    return validate_config(raw), str(path)


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
    resume = getattr(args, "resume", None)
    if resume is not None and args.config is not None:
        raise ConfigError("--resume: the run continues with the config saved in its checkpoint; drop --config")
    checkpoint = None
    if resume is not None:
        config, checkpoint = resume_config(resume, args.overrides)
    else:
        config = load_config(args.config, args.overrides)
    from palestra.engine.trainer import Trainer  # torch is only imported once the config is valid

    # builds and checks every component: a bad one stops here, with one line
    trainer = Trainer(config, run_dir=resume) if resume is not None else Trainer(config)
    try:
        main = trainer.dist.is_main
        if checkpoint is not None:
            trainer.load(checkpoint)
            if main:
                print(f"resuming {resume} from {checkpoint} at step {trainer.step} of {config.train.steps}")
        if main:
            for line in summary(config):
                print(line)
            if trainer.dist.enabled:
                print(f"distributed: {trainer.dist.world_size} ranks, {trainer.dist.backend}, "
                      f"{config.distributed.strategy}, {trainer.local_batch_size} tasks per rank")
        result = trainer.train()
    finally:
        trainer.dist.close()
    if not main:
        return end_rank(trainer.dist, 0)
    print(f"trained {result.steps} steps in {result.seconds:.1f} s; run directory {result.run_dir}")
    for line in format_before_after(result.before, result.after):
        print(line)
    if (result.run_dir / "metrics.jsonl").exists():
        from palestra.cli.dashboard import plot_dashboard

        print(f"plot: {plot_dashboard(result.run_dir)}")
    return end_rank(trainer.dist, 0)


def end_rank(dist: DistributedContext, code: int) -> int:
    """``code`` for a single process; under torchrun, end this rank here with ``os._exit(code)``.

    By now the rank has finished its work, closed its loggers, written what it writes and destroyed its
    process group. What is left is interpreter teardown, and there torch's C++ state occasionally aborts a
    gloo rank ("terminate called without an active exception", SIGABRT; about 1 torchrun job in 50 on the
    2-core VM, on either rank), which fails the whole job after it has succeeded. Ending the rank
    directly leaves nothing to abort.
    """
    if not dist.enabled:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
