"""Train a policy: resolve the config, load the plugins, build and check the components, run the trainer, report.

``--resume RUN_DIR`` continues a run from its newest intact checkpoint with the config saved in it; only the keys
in :data:`RESUMABLE_KEYS` (how long to train, how often to save, log and evaluate, the timeouts, the export) may be
overridden, since anything else would make the continuation a different run. A new run refuses a directory that
holds a run unless ``--overwrite`` (which deletes it first). SIGINT/SIGTERM/SIGHUP save a checkpoint at the next step
boundary and exit 130/143/129 with one line. While the run starts (nothing to save yet) they stop it at once; after
the last step they let the run finish (the final checkpoint, the table, the dashboard, the export) and then exit with
that status; a second signal there stops at once, naming what was not written and the command that writes it. The
handlers stay in place for the whole command (:class:`~palestra.engine.watchdog.StopSignals`).
Under torchrun every rank runs this command; rank 0 prints, plots and writes. With ``train.export: true`` the
trained policy is also written as a transformers folder when training ends (what ``palestra export`` writes;
whether it can be written is checked before training starts).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from palestra.config import ComponentSpec, Config, ConfigError, load_config, parse_override, to_plain, validate_config
from palestra.engine.watchdog import Interrupted, StopSignals

if TYPE_CHECKING:
    from palestra.engine.checkpoint import ResumePoint
    from palestra.engine.run_lock import RunLock
    from palestra.engine.trainer import EvalResult, Trainer, TrainResult
    from palestra.scale.distributed import DistributedContext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a .yaml/.yml/.toml config (default: the built-in task)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start again in a run directory that holds a run, deleting that run's files first",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides such as train.lr=3e-4")


# What `--resume` lets you change: extend the run (train.steps; the LR schedule is recomputed for the new length)
# and how it saves, logs, evaluates, times out and exports. Anything else would continue a different run.
RESUMABLE_KEYS = (
    "train.steps",
    "train.save_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.eval_every",
    "train.step_timeout_s",
    "train.data_timeout_s",
    "train.max_bad_steps",
    "distributed.timeout_s",
    "train.export",
    "train.export_dir",
    "train.export_merge_lora",
)


def resume_config(run_dir: str, overrides: list[str]) -> tuple[Config, ResumePoint]:
    """The config saved in ``run_dir``'s newest intact checkpoint with the allowed overrides applied, and that
    checkpoint (loaded with ``weights_only=True`` and verified, so nothing in it runs).

    The saved config is the run folder's data, not the user's word (:mod:`palestra.config.untrusted`): a value in it
    that would run code or reach outside the folder is refused in one line unless an override passes it again, and
    ``run.name`` / ``run.output_dir`` follow the folder resumed (a copied run is the copy)."""
    from palestra.config import _set_path
    from palestra.config.loading import _format_path
    from palestra.config.untrusted import follow_folder, refuse_untrusted
    from palestra.engine.checkpoint import CheckpointError, resume_point

    point = resume_point(run_dir)
    raw = point.state.get("config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"checkpoint {point.path} holds no config (a dict); it was not written by palestra train")
    raw = follow_folder(copy.deepcopy(raw), Path(run_dir))
    parsed = [parse_override(item) for item in overrides]
    given = {_format_path(keys): value for keys, value in parsed}
    _check_resume_keys(raw, Path(run_dir), given)
    for keys, value in parsed:
        _set_path(raw, keys, value)
    config = validate_config(raw)
    refuse_untrusted(
        config, Path(run_dir), given, source=point.path, command=["palestra", "train", "--resume", run_dir, *overrides]
    )
    if config.train.steps < point.step:
        raise ConfigError(
            f"train.steps: {config.train.steps} is below step {point.step} of {point.path}; a resumed run "
            f"cannot be shortened (pass train.steps={point.step} or more)"
        )
    return config, point


def _check_resume_keys(raw: dict[str, Any], run_dir: Path, given: dict[str, Any]) -> None:
    """One line for an override ``--resume`` does not take: a key outside :data:`RESUMABLE_KEYS` that is not one the
    saved config cannot vouch for (a path, trust_remote_code, a plugin's name, passed again)."""
    from palestra.config.untrusted import check_given

    others = {key: value for key, value in given.items() if key not in RESUMABLE_KEYS}
    if not others:
        return
    bad = check_given(validate_config(copy.deepcopy(raw)), run_dir, others)
    if bad is None:
        return
    key, why = bad
    raise ConfigError(
        f"{key}: cannot be changed with --resume ({why or 'the run continues with its saved config'}); "
        f"allowed: {', '.join(RESUMABLE_KEYS)}, and passing again a path, trust_remote_code or plugin name "
        "the saved config holds"
    )


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
    """The table `palestra train` ends with: held-out reward (and each component) before and after training.

    A component the reward did not report before training shows ``-``; a value that is not finite is never shown
    as a bare ``nan``: a note under the table says what it means.
    """
    rows: list[tuple[str, float | None, float]] = [("reward (total)", before.reward, after.reward)]
    rows += [(k, before.components.get(k), v) for k, v in after.components.items() if "/" not in k]
    width = max(len(r[0]) for r in rows)
    best = f" (max {after.max_score:g})" if after.max_score is not None else ""
    lines = [f"held-out reward on {after.tasks} tasks, greedy{best}:", f"  {'':<{width}}  {'before':>8}  {'after':>8}"]
    lines += [f"  {name:<{width}}  {_cell(b)}  {_cell(a)}" for name, b, a in rows]
    if any(v is not None and not math.isfinite(v) for _, b, a in rows for v in (b, a)):
        lines.append("  (a value above is not finite: the reward's held-out scores could not be averaged)")
    return lines


def _cell(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>8.3f}"


def run(args: argparse.Namespace) -> int:
    for item in args.overrides:
        if "=" not in item and item.endswith((".yaml", ".yml", ".toml")):
            raise ConfigError(f"{item!r} looks like a config file; pass it as --config {item}")
    resume, overwrite = getattr(args, "resume", None), getattr(args, "overwrite", False)
    if resume is not None and args.config is not None:
        raise ConfigError("--resume: the run continues with the config saved in its checkpoint; drop --config")
    if resume is not None and overwrite:
        raise ConfigError("--overwrite starts a run again from scratch; it cannot be combined with --resume")
    # The handlers stay for the whole command, not only the steps: a signal while the models are built, or after the
    # last step (the table, the dashboard, the export), is answered in one line with the signal's exit status too.
    signals = StopSignals()
    with signals:
        signals.immediate = True  # starting: nothing to save yet, and building may take minutes
        try:
            trainer, point, lock, threads_line = _start(args, resume, overwrite, signals)
            signals.immediate = False
        except Interrupted as e:
            if os.environ.get("RANK", "0").strip() in ("", "0"):  # torchrun signals every rank: one line
                print(f"palestra train: {_start_line(e.signum, resume)}", file=sys.stderr)
            return e.exit_code
        resumed_from = point.path if point is not None else None
        point = None  # the loaded state is in the trainer now: let it go
        if threads_line and trainer.dist.is_main:  # said once the run is built: a bad input stays one line
            print(threads_line, file=sys.stderr)
        try:
            return _train_and_report(trainer, resumed_from, resume)
        except Interrupted as e:  # a second signal between two phases: say what the last checkpoint holds
            if e.saved_step is None:
                e.saved_step, e.run_dir = trainer.saved_step, trainer.run_dir
            if trainer.dist.is_main:
                print(f"palestra train: {e.line()}", file=sys.stderr)
            return e.exit_code
        finally:
            if lock is not None:
                lock.release(tidy=True)  # a run that failed and left nothing takes its folder with it


def _start_line(signum: int, resume: str | None) -> str:
    name = signal.Signals(signum).name
    if resume is None:
        return f"stopped by {name} before training started; nothing was saved"
    return (
        f"stopped by {name} before training resumed; {resume} is as it was: "
        f"resume with palestra train --resume {resume}"
    )


def _train_and_report(trainer: Trainer, resumed_from: Path | None, resume: str | None) -> int:
    """Train, then (rank 0) print the result, plot it and export it; the exit status."""
    config = trainer.config
    try:
        main = trainer.dist.is_main
        if main:
            if resumed_from is not None:
                print(f"resuming {resume} from {resumed_from} at step {trainer.step_index} of {config.train.steps}")
            for line in summary(config):
                print(line)
            if trainer.trajectory_line:
                print(trainer.trajectory_line)
            if trainer.dist.enabled:
                print(
                    f"distributed: {trainer.dist.world_size} ranks, {trainer.dist.backend}, "
                    f"{config.distributed.strategy}, {trainer.local_batch_size} tasks per rank"
                )
        try:
            result, code = trainer.train(), 0
        except Exception:
            # A new run that fails at step 0 leaves no run: nothing to resume, nothing to protect, nothing to read
            # in its logs but the error (one that trained steps keeps them for diagnosis; a re-run may take it over)
            if main and resumed_from is None and trainer.saved_step is None and trainer.step_index == 0:
                from palestra.engine import checkpoint as ckpt
                from palestra.types import FileLogger

                logs = [x.path for x in trainer.loggers if isinstance(x, FileLogger) and isinstance(x.path, Path)]
                ckpt.clear_unsaved_run(trainer.run_dir, logs)
            raise
        except Interrupted as e:  # SIGINT/SIGTERM/SIGHUP: a checkpoint saved at a step boundary (or a second signal)
            if main:
                print(f"palestra train: {e.line()}", file=sys.stderr)
            if not e.at_once:
                # No rank leaves before rank 0 has written the checkpoint and said so: torchrun answers the first
                # rank to exit by sending SIGTERM to the others.
                trainer.dist.barrier()
            result, code = None, e.exit_code
    finally:
        trainer.dist.close()
    if result is None or not main:
        # A rank other than 0 that finished training has nothing left to write: it leaves with 0 even after a
        # signal, since torchrun answers a rank that fails by sending SIGTERM to rank 0, still writing the export.
        return end_rank(trainer.dist, code)
    return end_rank(trainer.dist, _finish(trainer, result))


def _finish(trainer: Trainer, result: TrainResult) -> int:
    """The last phase, on rank 0: the result, the table, the dashboard and the export; 0, or the exit status of a
    signal that came during it or after the last step. A first signal lets all of it be written (the run is complete
    but for it), then ends the command with one line; a second one ends it at once, with one line naming what was
    not written and the command that writes it."""
    from palestra.engine.checkpoint import FINAL_NAME

    config, run_dir = trainer.config, result.run_dir
    plots = (run_dir / "metrics.jsonl").exists()
    pending = {}  # what is still to write: the line names it, with the command that writes it later
    if plots:
        pending["dashboard"] = f"the dashboard (palestra plot {run_dir})"
    if config.train.export:
        out = export_path(config, run_dir)
        pending["export"] = f"the export {out} (palestra export {run_dir} --out {out})"
    try:
        print(f"trained {result.steps} steps in {result.seconds:.1f} s; run directory {result.run_dir}")
        for line in format_before_after(result.before, result.after):
            print(line)
        if plots:
            from palestra.cli.dashboard import plot_dashboard

            # Struck off before the line is printed: a signal sent on seeing the line finds it done.
            drawn = plot_dashboard(result.run_dir)
            del pending["dashboard"]
            print(f"plot: {drawn}")
        if config.train.export:
            exported = export_at_end(trainer, result.run_dir)
            del pending["export"]
            print(exported)
    except Interrupted as e:  # a second signal
        missing = f"; not written: {', '.join(pending.values())}" if pending else ""
        return _last_line(
            f"stopped at once by a second {signal.Signals(e.signum).name} after the last step: the run is complete "
            f"and saved in {run_dir} ({FINAL_NAME}, step {result.steps}){missing}",
            e.exit_code,
        )
    received = trainer.stop_signals.received
    if received is None:
        return 0
    return _last_line(
        f"stopped by {signal.Signals(received).name} after the last step, once everything was written: "
        f"the run is complete and saved in {run_dir}",
        128 + received,
    )


def _last_line(line: str, code: int) -> int:
    sys.stdout.flush()  # the table and the paths first, then the line that ends the command
    print(f"palestra train: {line}", file=sys.stderr)
    return code


def export_path(config: Config, run_dir: Path) -> Path:
    """Where ``train.export`` writes: ``train.export_dir``, else ``<run directory>/export``."""
    return Path(config.train.export_dir) if config.train.export_dir is not None else run_dir / "export"


def check_export(config: Config, run_dir: Path, *, overwrite: bool, run_id: str | None) -> None:
    """Before training: one line if ``train.export`` could not write its folder when training ends (transformers
    missing, the folder a file or holding anything but this run's own earlier export)."""
    import importlib.util

    from palestra.cli.export import check_out_dir, is_export_of

    if not config.train.export:
        return
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "train.export: writing a transformers folder needs transformers; pip install 'palestra[hf]' "
            "(or set train.export=false)"
        )
    out = export_path(config, run_dir)
    if overwrite and run_dir.resolve() in out.resolve().parents:
        return  # --overwrite deletes the run directory, and the folder with it
    if run_id is not None and is_export_of(out, run_id):
        return  # a resumed run replaces its own earlier export
    check_out_dir(
        out,
        force=False,
        run_dir=run_dir,
        key="train.export_dir",
        remedy="set train.export_dir to a new folder, or delete that one",
    )


def export_at_end(trainer: Trainer, run_dir: Path) -> str:
    """Write the trained policy where ``train.export`` says (a run's own earlier export is replaced); the line
    saying what was written."""
    from palestra.cli.export import ExportError, ExportWriteFailed, describe_export, is_export_of, write_export
    from palestra.engine.checkpoint import FINAL_NAME

    config = trainer.config
    out = export_path(config, run_dir)
    provenance = {
        "run_dir": str(run_dir.resolve()),
        "checkpoint": str((run_dir / FINAL_NAME).resolve()),
        "step": trainer.step_index,
        "run_id": trainer.run_id,
    }
    try:
        write_export(
            trainer.policy,
            out,
            policy_name=config.policy.name,
            merge_lora=config.train.export_merge_lora,
            provenance=provenance,
            replace=is_export_of(out, trainer.run_id),
        )
    except OSError as e:  # a full disk, say: the run itself is saved, so say how to export it again
        what = str(e) if isinstance(e, ExportWriteFailed) else f"writing {out} failed ({e})"
        raise ExportError(
            f"train.export: {what}; the trained run is saved in {run_dir}: "
            f"palestra export {run_dir} --out {out} writes it"
        ) from None
    return describe_export(out, run=f"{run_dir} step {trainer.step_index}")


def _start(
    args: argparse.Namespace, resume: str | None, overwrite: bool, signals: StopSignals
) -> tuple[Trainer, ResumePoint | None, RunLock | None, str]:
    """The config (a resumed run's from its checkpoint), a built trainer with the checkpoint loaded, and the run
    directory claimed: locked by this process (rank 0) for the whole run, then a new run refuses one that holds a
    run unless ``--overwrite``, which deletes it first."""
    from palestra.config.preflight import check_output_dir, check_writable_folder
    from palestra.engine import checkpoint as ckpt
    from palestra.engine.run_lock import RunLock

    # Under torchrun only rank 0 writes the run folder, so only rank 0 locks it (RANK is set by torchrun).
    locks = os.environ.get("RANK", "0").strip() in ("", "0")
    lock = None
    point = None
    try:
        if resume is not None:
            # a live run is named before its checkpoint is read (it may be replaced meanwhile) or its log cut
            if locks:
                RunLock.check_free(ckpt.existing_run_dir(resume), key=None)
            ckpt.check_run_folder(resume)  # a link in it: refused before a checkpoint is read through it
            config, point = resume_config(resume, args.overrides)
            run_dir = Path(resume)
            check_writable_folder(run_dir, f"--resume {str(run_dir)!r}")  # its own line, before the lock file
            lock = RunLock.acquire(run_dir, key=None) if locks else None
        else:
            config = load_config(args.config, args.overrides)
            run_dir = Path(config.run.output_dir) / config.run.name
            # A quick answer before a model is built, changing nothing: a live writer is named, a finished run
            # refused; then the lock, and the check again under it (a run may have started and ended meanwhile).
            check_output_dir(config.run.output_dir, config.run.name)  # its own line, before the lock's mkdir
            if locks:  # rank 0 alone: another rank probing would find rank 0's own lock
                RunLock.check_free(run_dir)
            own = ckpt.run_files(config, run_dir)  # the files this config's loggers and export write there
            ckpt.check_new_run_dir(run_dir, overwrite=overwrite, own=own)
            lock = RunLock.acquire(run_dir) if locks else None
            ckpt.check_new_run_dir(run_dir, overwrite=overwrite, own=own)
        trainer, threads_line = _build(args, config, run_dir, point, overwrite, signals)
    except BaseException:
        if lock is not None:
            lock.release(tidy=True)
        raise
    return trainer, point, lock, threads_line


def _build(
    args: argparse.Namespace,
    config: Config,
    run_dir: Path,
    point: ResumePoint | None,
    overwrite: bool,
    signals: StopSignals,
) -> tuple[Trainer, str]:
    """The trainer, checked against this machine, with the checkpoint loaded; rank 0 prepares the run directory.
    Also the line that says how many CPU threads the run chose (empty when the user chose)."""
    import torch

    from palestra.config.preflight import preflight  # torch is only imported once the config is valid
    from palestra.engine import checkpoint as ckpt
    from palestra.engine.trainer import Trainer
    from palestra.scale.cpu_threads import apply_threads, choose_threads, leave_cores_to_the_worker

    # what this machine must provide (the device, the kernel back end, a writable folder, memory for a batch)
    preflight(config, run_dir=run_dir if point is not None else None)
    # Threads before anything is built: loading a model is parallel work too. A resumed run takes the count its
    # checkpoint recorded (reductions split by thread: the same count keeps the resume bitwise).
    saved = point.state.get("threads") if point is not None else None
    choice = choose_threads(config.train.threads, torch.get_num_threads(), saved=saved)
    async_section = config.train.async_
    if async_section is not None and async_section.lag and choice.source == "free cores":
        choice = leave_cores_to_the_worker(choice, async_section.threads)
    apply_threads(choice)

    check_export(config, run_dir, overwrite=overwrite, run_id=point.state.get("run_id") if point is not None else None)
    # builds and checks every component: a bad one stops here, with one line
    trainer = Trainer(config, run_dir=run_dir, stop_signals=signals)
    try:
        if config.train.export and trainer.dist.fsdp:
            raise ConfigError(
                "train.export: the policy's weights are sharded across ranks under "
                "distributed.strategy=fsdp; set train.export=false and run palestra export RUN_DIR "
                "--out DIR after training"
            )
        if point is not None:
            trainer.load_state(point.state, source=point.path)
        # Rank 0 alone touches the directory, and only now: under torchrun the other ranks have checked it (above)
        # before the process group formed, so none of them sees this run's own files as another run's.
        if trainer.dist.is_main:
            own = ckpt.run_files(config, run_dir)  # the loggers' files (any name) and the export: only these go
            if overwrite:
                ckpt.clear_run_dir(run_dir, keep=Path(args.config) if args.config else None, own=own)
            elif point is None:  # what an earlier start that saved no checkpoint left (check_new_run_dir let it)
                ckpt.clear_unsaved_run(run_dir, own)
            if point is None or ckpt.read_run_id(run_dir) is None:
                ckpt.write_run_file(run_dir, trainer.run_id, config.run.name)
    except BaseException:
        trainer.dist.close()
        raise
    return trainer, choice.line


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
