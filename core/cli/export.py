"""Export a trained policy as a transformers folder: ``palestra export RUN_DIR --out DIR``.

The run is rebuilt from the config saved in its checkpoint, the newest intact checkpoint of the run (or
``--checkpoint PATH``) is loaded through the trainer's own loading (so a LoRA run's adapter-only checkpoint lands on
its base model), and the policy writes itself with ``save_pretrained(DIR, merge_lora=...)``: a folder that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load, and that
``policy: {name: hf, options: {path: DIR}}`` trains further. Beside the model files, ``palestra_export.json`` records
where the weights came from (run, checkpoint, step).

The folder is written into a hidden sibling first and renamed into place once complete, so ``DIR`` never holds
half an export. An existing non-empty ``DIR`` is refused unless ``--force`` (then replaced, again by a rename).
``palestra train`` with ``train.export: true`` writes the same folder when training ends (:func:`write_export`).

A destination that cannot be written (a read-only file system, a folder of another user) is one line before the
run is loaded; a disk that fills up while the folder is written is one line, with the hidden folder removed. The
hidden folders of exports that were killed mid-write (their process is gone) are removed by the next export there.
"""

from __future__ import annotations

import argparse
import copy
import errno
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from palestra.config import Config, ConfigError, validate_config
from palestra.models.progress_bars import transformers_bars_off

PROVENANCE = "palestra_export.json"  # what the folder was exported from (read back to recognise our own exports)


EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """An export that cannot be made as asked (no checkpoint, an occupied --out, a policy with no export form).
    One line."""

    palestra_user_error = True


class UnwritableDestination(ValueError):
    """A destination the command could never write (on a read-only file system, in a folder this user may not
    write, under a file). One line, before anything is computed."""

    palestra_user_error = True


class ExportWriteFailed(OSError):
    """Writing the export folder failed (a full disk, a destination that turned read-only): one line; the partial
    folder is removed and an existing export is untouched."""

    palestra_user_error = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by palestra train")
    parser.add_argument(
        "--out", metavar="DIR", required=True, help="the folder to write (created; must not hold files)"
    )
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="export this checkpoint (a path, or one relative to RUN_DIR) instead of the newest one",
    )
    parser.add_argument(
        "--merge-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="LoRA runs: fold the adapters into the weights (the default) or, with --no-merge-lora, "
        "write the base model plus the peft adapter; a note when the policy has no adapters",
    )
    parser.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default=None,
        help="the weights' dtype in the folder (default: the dtype the model was read in: bfloat16 for a GGUF, "
        "the saved dtype of a transformers folder, float32 for the built-in tiny policy)",
    )
    parser.add_argument("--force", action="store_true", help="replace an --out folder that already holds files")
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="a value the checkpoint's config cannot vouch for, passed again (a path outside the run folder, "
        "trust_remote_code, a plugin that is not built in); repeatable",
    )


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.out)
    check_run_dir(run_dir)
    check_out_dir(out, force=args.force, run_dir=run_dir)
    path, state = pick_checkpoint(run_dir, args.checkpoint)
    command = ["palestra", "export", str(run_dir), "--out", str(out)]
    command += ["--checkpoint", args.checkpoint] if args.checkpoint is not None else []
    config = export_config(state, path, run_dir=run_dir, overrides=args.overrides, command=command)
    policy = load_policy(config, run_dir, state, path)
    merge = True if args.merge_lora is None else args.merge_lora
    if args.merge_lora is not None and not any(has_adapters(m) for m in export_targets(policy).values()):
        flag = "--merge-lora" if args.merge_lora else "--no-merge-lora"
        print(
            f"palestra export: note: policy {config.policy.name!r} has no LoRA adapters, so {flag} changes nothing; "
            "the full model is written",
            file=sys.stderr,
        )
    provenance = {
        "run_dir": str(run_dir.resolve()),
        "checkpoint": str(path.resolve()),
        "step": int(state["step"]),
        "run_id": state.get("run_id"),
    }
    write_export(
        policy,
        out,
        policy_name=config.policy.name,
        merge_lora=merge,
        provenance=provenance,
        replace=args.force,
        dtype=args.dtype,
    )
    print(describe_export(out, run=f"{run_dir} step {int(state['step'])}"))
    return 0


# ---- the pieces, also used by palestra train ----------------------------------------------------------------
def check_run_dir(run_dir: Path) -> None:
    """One line unless ``run_dir`` is an existing directory (a checkpoint file is answered with ``--checkpoint``)."""
    if run_dir.is_file():
        raise ExportError(f"RUN_DIR: {str(run_dir)!r} is a file; pass the run directory, and the file as --checkpoint")
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR: run directory {str(run_dir)!r} does not exist")


def check_out_dir(
    out: Path,
    *,
    force: bool,
    run_dir: Path | None = None,
    key: str = "--out",
    remedy: str = "name a new folder, or pass --force to replace it",
) -> None:
    """One line (naming ``key``, suggesting ``remedy``) unless ``out`` can receive an export: absent or empty, or
    (``force``) a folder to replace that is neither the run directory, nor a folder holding it, nor the working
    directory or a parent of it."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{key}: {str(out)!r} is a file; name a folder to create")
    target = out.resolve()
    guarded = {"the working directory": Path.cwd().resolve()}
    if run_dir is not None:
        guarded["the run directory"] = run_dir.resolve()
    for what, folder in guarded.items():
        if target == folder or target in folder.parents:
            holds = "is" if target == folder else "holds"
            raise ExportError(f"{key}: {str(out)!r} {holds} {what}; name a folder of its own")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{key}: {str(out)!r} already holds files; {remedy}")
    # the folder is written beside itself and renamed into place: its parent must take new entries
    check_writable_destination(out, key, what="folder")


def check_writable_destination(path: Path, key: str, *, what: str, remedy: str | None = None) -> None:
    """One line (naming ``key``, suggesting ``remedy``) unless ``path`` (a ``what``: file or folder, existing or not)
    can be created or replaced: the nearest existing folder above it must be a folder, on a file system mounted
    read-write, that this user may write. ``os.access`` answers for root too on a read-only mount (EROFS); a
    read-only mount is named as such."""
    shown = repr(str(path))
    existing = next(p for p in path.absolute().parents if _exists(p))
    if not existing.is_dir():
        raise UnwritableDestination(f"{key}: {shown} cannot be created: {str(existing)!r} is a file")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise UnwritableDestination(
            f"{key}: {shown} cannot be written: {str(existing)!r} is on a read-only file system; "
            f"{remedy or f'name a {what} on a writable one'}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UnwritableDestination(
            f"{key}: {shown} cannot be written: {str(existing)!r} is not writable by this user; "
            f"{remedy or f'name a {what} in a folder you may write'}"
        )


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder this user may not enter: the walk up reports the one above it
        return False


def is_export_of(out: Path, run_id: str) -> bool:
    """True when ``out`` holds an export of run ``run_id`` (its ``palestra_export.json`` says so)."""
    try:
        record = json.loads((out / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("run_id") == run_id


def pick_checkpoint(run_dir: Path, named: str | None) -> tuple[Path, dict[str, Any]]:
    """``(path, state)``: ``named`` (as given, else relative to ``run_dir``) or the run's newest intact checkpoint,
    loaded with ``weights_only=True`` and verified (nothing in it runs). A named checkpoint must be the run's own:
    another run's is refused (the export would carry this run's name)."""
    from palestra.engine import checkpoint as ckpt

    if named is not None:
        path = Path(named)
        if not path.exists() and (run_dir / named).exists():
            path = run_dir / named
        if not path.is_file():
            raise ExportError(f"--checkpoint: {named!r} is not a file (looked as given and inside {run_dir})")
        state = ckpt.load_checkpoint(path)
        _check_own_checkpoint(run_dir, path, state)
        return path, state
    if not ckpt.list_step_checkpoints(run_dir) and not (run_dir / ckpt.FINAL_NAME).is_file():
        raise ExportError(
            f"RUN_DIR: {str(run_dir)!r} holds no checkpoint ({ckpt.FINAL_NAME} or "
            f"{ckpt.CHECKPOINT_DIR}/step-*.pt); a run writes {ckpt.FINAL_NAME} when training ends "
            "and step files every train.save_every steps"
        )
    try:
        point = ckpt.resume_point(run_dir)
    except (ckpt.CheckpointError, FileNotFoundError) as e:  # worded for --resume: say it for this command
        raise ExportError(f"RUN_DIR: {str(e).removeprefix('--resume: ')}") from None
    return point.path, point.state


def _check_own_checkpoint(run_dir: Path, path: Path, state: dict[str, Any]) -> None:
    """One line when ``--checkpoint`` names another run's checkpoint: its run id is not the one in RUN_DIR's
    ``run.json`` (or, without one, it lies outside RUN_DIR). The line says how to export it as its own run."""
    from palestra.engine import checkpoint as ckpt

    owner, theirs = ckpt.read_run_id(run_dir), state.get("run_id")
    if owner is not None and (theirs is None or theirs == owner):
        return
    if owner is None and run_dir.resolve() in path.resolve().parents:
        return
    home = path.parent.parent if path.parent.name == ckpt.CHECKPOINT_DIR else path.parent
    whose = f"of run {theirs}" if isinstance(theirs, str) else "of no recorded run"
    mine = f"run {owner}" if owner is not None else f"a folder without {ckpt.RUN_FILE}, and it lies outside it"
    raise ExportError(
        f"--checkpoint: {str(path)!r} is a checkpoint {whose}, not of {run_dir} ({mine}); export it from its own "
        f"run: palestra export {home} --out DIR --checkpoint {path}"
    )


def export_config(
    state: dict[str, Any], path: Path, *, run_dir: Path, overrides: Sequence[str] = (), command: Sequence[str] = ()
) -> Config:
    """The run's config from its checkpoint, set up to rebuild the policy here: on the CPU (the export computes
    nothing, and the run's GPU may not be this machine's), without loggers (nothing is logged) and without
    ``train.export`` (this command writes ``--out``).

    The saved config is the run folder's data, not the user's word (:mod:`palestra.config.untrusted`): a value that
    would run code or reach outside ``run_dir`` is refused in one line unless ``--set KEY=VALUE`` (``overrides``)
    passes it again; ``command`` is this command line, for that line to repeat."""
    from palestra.config import _set_path, parse_override
    from palestra.config.loading import _format_path
    from palestra.config.untrusted import check_given, follow_folder, refuse_untrusted

    raw = state.get("config")
    if not isinstance(raw, dict):
        raise ExportError(f"checkpoint {path} holds no config; it was not written by palestra train")
    raw = follow_folder(copy.deepcopy(raw), run_dir)
    train = raw.setdefault("train", {})
    if isinstance(train, dict):
        train.update(device="cpu", export=False, export_dir=None)
    raw["loggers"] = []
    parsed = [parse_override(item) for item in overrides]
    given = {_format_path(keys): value for keys, value in parsed}
    try:
        saved = validate_config(copy.deepcopy(raw))
    except ConfigError as e:
        raise ConfigError(f"the config saved in {path} no longer validates: {e}") from None
    if given and (bad := check_given(saved, run_dir, given)) is not None:
        key, why = bad
        raise ConfigError(
            f"--set {key}: {why or 'export takes only the values a checkpoint cannot vouch for'} "
            "(a path outside the run folder, trust_remote_code, a plugin that is not built in)"
        )
    for keys, value in parsed:
        _set_path(raw, keys, value)
    config = validate_config(raw) if given else saved
    refuse_untrusted(config, run_dir, given, source=path, command=list(command), flag="--set")
    return config


def load_policy(config: Config, run_dir: Path, state: dict[str, Any], path: Path) -> Any:
    """The trained policy: the run rebuilt from ``config`` and ``state`` loaded by the trainer itself."""
    from palestra.engine.trainer import Trainer

    trainer = Trainer(config, run_dir=run_dir)
    try:
        trainer.load_state(state, source=path)
    finally:
        trainer.dist.close()
    return trainer.policy


def has_adapters(policy: Any) -> bool:
    """True when the policy trains LoRA adapters over a frozen base (:class:`palestra.types.AdapterPolicy`)."""
    from palestra.types import AdapterPolicy

    return isinstance(policy, AdapterPolicy)


def export_targets(policy: Any) -> dict[str, Any]:
    """``{subfolder: policy}`` to write: ``{"": policy}`` for one model. A multi-agent policy whose agents own
    independent layers is several models, one subfolder per agent (its key); with every layer shared it is one."""
    from palestra.multiagent.sharing import MultiAgentPolicy

    if not isinstance(policy, MultiAgentPolicy):
        return {"": policy}
    if not policy.config.independent_layers:
        return {"": policy.base}
    return dict(policy.views.items())


def write_export(
    policy: Any,
    out: Path,
    *,
    policy_name: str,
    merge_lora: bool,
    provenance: dict[str, Any],
    replace: bool,
    dtype: str | None = None,
) -> Path:
    """Write ``policy`` (every model of it, see :func:`export_targets`) into ``out`` atomically: into a hidden sibling
    folder first, renamed into place when complete; ``replace`` swaps out an existing folder the same way.

    A write that fails for want of space (or on a destination that turned read-only) raises
    :class:`ExportWriteFailed`, one line, with the hidden folder removed. Hidden folders that exports killed
    mid-write left beside ``out`` (their process is gone) are removed first."""
    targets = export_targets(policy)
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_dead_exports(out)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for sub, model in targets.items():
            folder = tmp / sub if sub else tmp
            folder.mkdir(exist_ok=True)
            _save(model, folder, policy_name=policy_name, merge_lora=merge_lora, dtype=dtype)
        record = {
            **provenance,
            "policy": policy_name,
            "merge_lora": merge_lora,
            "dtype": dtype,  # None: each model in the dtype it was read in
            "adapters": any(has_adapters(m) for m in targets.values()),
            "models": sorted(targets) if len(targets) > 1 else None,
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        _repoint_adapters(tmp, out)
        _usual_modes(tmp)
        _swap_into_place(tmp, out, replace=replace)
    except ExportError:
        raise
    except Exception as e:
        failed = _write_failure(e, tmp, out)
        if failed is None:
            raise
        raise failed from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_failure(error: Exception, tmp: Path, out: Path) -> ExportWriteFailed | None:
    """The one line for a write that failed for want of space, or with an ``OSError`` of the destination; None for
    anything else (a bug keeps its traceback). The writers (safetensors, torch) wrap a full disk in their own
    errors, so it is recognised by its ``OSError`` in the chain, its errno's text, or a file system left with no
    room (the partial files fill it)."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and len(chain) < 20:
        chain.append(e)
        e = e.__cause__ or e.__context__
    errnos = {x.errno for x in chain if isinstance(x, OSError)}
    try:
        stat = os.statvfs(tmp if tmp.exists() else out.parent)
        no_room = stat.f_bavail * stat.f_frsize < 1 << 20  # under a MiB left, measured with the partial files in
    except OSError:
        no_room = False
    full = errnos & {errno.ENOSPC, errno.EDQUOT} or os.strerror(errno.ENOSPC) in str(error) or no_room
    shutil.rmtree(tmp, ignore_errors=True)  # before the free space is reported: the partial files are not kept
    if full:
        from palestra.engine.checkpoint import _human

        try:
            free = f"{_human(shutil.disk_usage(out.parent).free)} free on {out.parent}"
        except OSError:
            free = "free space unknown"
        kept = f"{out} keeps its previous content" if out.exists() else f"nothing was written to {out}"
        return ExportWriteFailed(f"disk full: writing the export {out} ran out of space ({free}); {kept}")
    oserror = next((x for x in chain if isinstance(x, OSError)), None)
    if oserror is None:
        return None
    where = f" ({oserror.filename})" if oserror.filename else ""
    return ExportWriteFailed(
        f"writing the export {out} failed: {oserror.strerror or oserror}{where}; nothing was written to {out}"
    )


def _sweep_dead_exports(out: Path) -> None:
    """Remove what exports killed mid-write (a SIGKILL, a power cut) left beside ``out``: their hidden
    ``.NAME.export-PID.tmp`` folders, and a ``.NAME.old-PID`` folder once ``out`` is in place. A live process's
    folders (another export, writing now) are left alone."""
    from palestra.engine.run_lock import left_by_dead

    for kind, suffix in (("export-", ".tmp"), ("old-", "")):
        for stale in left_by_dead(out.parent, f".{out.name}.{kind}", suffix):
            if not stale.is_dir():
                continue
            if kind == "old-" and not out.exists():
                continue  # killed between the two renames: this is the previous export, the only one there is
            shutil.rmtree(stale, ignore_errors=True)


def _usual_modes(folder: Path) -> None:
    """Give every file and folder of an export the modes a new file gets here (0644 and 0755 under the usual umask):
    safetensors writes its file 0600, which would keep the weights from everyone but their writer."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _save(policy: Any, folder: Path, *, policy_name: str, merge_lora: bool, dtype: str | None = None) -> None:
    from palestra.types import Exportable

    if not isinstance(policy, Exportable):
        raise ExportError(
            f"policy {policy_name!r} ({type(policy).__name__}) has no save_pretrained(folder, *, "
            "merge_lora): it cannot be exported"
        )
    import torch

    options: dict[str, Any] = {"merge_lora": merge_lora}
    if dtype is not None:
        if "dtype" not in inspect.signature(policy.save_pretrained).parameters:
            raise ExportError(
                f"--dtype: policy {policy_name!r} ({type(policy).__name__}) writes its weights in its own dtype "
                "(its save_pretrained takes no dtype); export without --dtype"
            )
        options["dtype"] = getattr(torch, dtype)
    try:
        with torch.no_grad(), transformers_bars_off():
            policy.save_pretrained(folder, **options)
    except ModuleNotFoundError as e:
        raise ExportError(
            f"exporting policy {policy_name!r} needs the {e.name} package; pip install 'palestra[hf]'"
        ) from None


def _repoint_adapters(tmp: Path, out: Path) -> None:
    """An unmerged LoRA folder names its base model by absolute path (``adapter_config.json``'s
    ``base_model_name_or_path``, which peft's ``AutoPeftModelForCausalLM`` loads the base from): the policy wrote the
    temporary folder's path, which is about to become ``out``."""
    for config in tmp.rglob("adapter_config.json"):
        record = json.loads(config.read_text(encoding="utf-8"))
        base = record.get("base_model_name_or_path")
        if isinstance(base, str) and Path(base) == config.parent.resolve():
            final = out.resolve() / config.parent.relative_to(tmp)
            record["base_model_name_or_path"] = str(final)
            config.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _swap_into_place(tmp: Path, out: Path, *, replace: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` (empty, or replaced) is moved aside first and
    deleted only once the new folder is in place."""
    old = None
    if out.exists():
        if any(out.iterdir()) and not replace:  # appeared since the check: never overwrite files silently
            raise ExportError(f"{out} filled up while the export was written; nothing was replaced")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)  # put the previous folder back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def describe_export(out: Path, *, run: str) -> str:
    """One line: what was written where (the architecture from the written config.json)."""
    record = json.loads((out / PROVENANCE).read_text(encoding="utf-8"))
    subs = record.get("models") or [""]
    archs = []
    for sub in subs:
        config = out / sub / "config.json" if sub else out / "config.json"
        names = json.loads(config.read_text(encoding="utf-8")).get("architectures") if config.is_file() else None
        archs.append(f"{sub}: {', '.join(names or ['?'])}" if sub else ", ".join(names or ["?"]))
    lora = "" if not record["adapters"] else (", LoRA merged" if record["merge_lora"] else ", base + LoRA adapter")
    return f"exported {run} (policy {record['policy']}) to {out}: {'; '.join(archs)}{lora}"
