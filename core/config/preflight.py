"""Checks of a valid config against this machine, made before anything is built or trained.

Validation (:mod:`.validation`) knows only the config: ``train.device: 'gpu'`` is caught there, and
``palestra config show`` reports it. Whether ``cuda`` exists here, whether ``run.output_dir`` can be written,
whether a batch fits in memory and whether a forced kernel back end runs are questions about the machine;
:func:`preflight` asks them, cheapest first, and raises :class:`ConfigError` (one line naming the config key
or environment variable at fault) instead of a traceback at step 1. Native kernels are built here only when
a back end was asked for explicitly (``kernels.backend`` or ``PALESTRA_KERNELS``): ``auto`` builds lazily
and falls back to torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from palestra.errors import ConfigError

from .schema import Config, TrainConfig

__all__ = ["preflight", "resolve_device", "rollout_bytes_floor"]

# Folders whose files are the kernel's views, not storage: a run's checkpoints cannot live there.
KERNEL_FILE_SYSTEMS = (Path("/proc"), Path("/sys"))

# What the rollout holds per token for every row, before any model runs: the sampler preallocates
# ``completion_ids`` (int64), ``completion_mask`` (bool) and ``logprobs`` (float32) as [rows, max_new_tokens],
# beside ``prompt_ids`` (int64) and ``prompt_mask`` (bool) as [rows, prompt width] (palestra.types.Generation,
# palestra.models.sampling).
PROMPT_TOKEN_BYTES = 8 + 1
COMPLETION_TOKEN_BYTES = 8 + 1 + 4


def preflight(config: Config, *, run_dir: str | Path | None = None) -> None:
    """Refuse, with one line naming the culprit, a config this machine cannot run (see the module docstring).

    ``run_dir``: the folder the run writes to when it is not ``run.output_dir/run.name`` (``--resume``)."""
    device = resolve_device(config.train.device)
    if run_dir is None:
        check_output_dir(config.run.output_dir, config.run.name)
    else:
        check_writable_folder(Path(run_dir), f"--resume {str(run_dir)!r}")
    check_rollout_memory(config.train, device)
    check_kernels(config.kernels.backend, device, config.train.device)


# ---- train.device --------------------------------------------------------------------------------------
def resolve_device(spec: str) -> torch.device:
    """The device ``train.device`` (already valid syntax) puts this process on; ConfigError if it is not here.

    As :meth:`palestra.scale.distributed.DistributedContext.from_config`: ``auto`` is CUDA when available, else
    the CPU (never MPS); under torchrun a CUDA run uses ``cuda:<LOCAL_RANK>``."""
    cuda = torch.cuda.is_available()
    if spec == "auto":
        dev = torch.device("cuda" if cuda else "cpu")
    else:
        dev = torch.device(spec)
    if dev.type == "cuda":
        if not cuda:
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
            raise ConfigError(
                f"train.device: {spec!r} needs a CUDA GPU, but CUDA is not available ({why}); use auto or cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            visible = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            raise ConfigError(f"train.device: {spec!r} is not a visible GPU; this machine has {count} ({visible})")
        if _world_size() > 1:
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            if local_rank >= count:
                raise ConfigError(
                    f"train.device: rank LOCAL_RANK={local_rank} needs cuda:{local_rank}, "
                    f"but this machine has {count} GPUs; start at most {count} processes per node"
                )
            dev = torch.device("cuda", local_rank)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "train.device: 'mps' needs Apple's Metal GPU, which this machine or torch build lacks; use auto or cpu"
        )
    return dev


def _world_size() -> int:
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1  # torchrun sets it; a stray value is the distributed set-up's to report


# ---- run.output_dir ------------------------------------------------------------------------------------
def check_output_dir(output_dir: str, name: str) -> None:
    """``run.output_dir`` must be (or be creatable as) a writable folder outside /proc and /sys, and the run's
    folder ``output_dir/name`` must not be a file."""
    check_writable_folder(Path(output_dir), "run.output_dir")
    run = Path(output_dir) / name
    if run.exists() and not run.is_dir():
        raise ConfigError(f"run.name: the run folder {str(run)!r} is a file; choose another run.name or move the file")


def check_writable_folder(path: Path, culprit: str) -> None:
    shown = repr(str(path))
    try:
        resolved = path.resolve()  # a symlink into /proc is still /proc
    except (OSError, RuntimeError):  # a symlink loop: the checks below report the path as it stands
        resolved = path.absolute()
    for fs in KERNEL_FILE_SYSTEMS:
        if resolved == fs or fs in resolved.parents:
            raise ConfigError(
                f"{culprit}: {shown} is under {fs}, the kernel's own file system; choose a folder on a disk"
            )
    if _exists(path) and not path.is_dir():
        raise ConfigError(f"{culprit}: {shown} is a file, not a folder")
    existing = next(p for p in (path, *path.absolute().parents) if _exists(p))
    if not existing.is_dir():
        raise ConfigError(f"{culprit}: {shown} cannot be created: {str(existing)!r} is a file")
    # os.access answers for this user: permission bits for everyone but root, and a read-only mount (EROFS)
    # for root too. Nothing is created here: a refused run leaves no empty folder behind.
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (its nearest existing folder {str(existing)!r} is not writable)"
        raise ConfigError(f"{culprit}: {shown} is not writable by this user{where}")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder above it this user may not enter: the walk up reports that folder
        return False


# ---- train.batch_size in memory ------------------------------------------------------------------------
def rollout_bytes_floor(rows: int, max_new_tokens: int, prompt_tokens: int = 1) -> int:
    """A floor on the memory one rollout takes: its token tensors alone (see the byte counts above).

    The prompt width is not known before the environment is built, so one token stands for it; the real
    peak adds the longer prompts, the policy's logits ([rows, vocab] float32 per decoding step), its KV cache
    and the update's activations. A batch refused on this floor cannot fit; one accepted may still not."""
    return rows * (prompt_tokens * PROMPT_TOKEN_BYTES + max_new_tokens * COMPLETION_TOKEN_BYTES)


def check_rollout_memory(train: TrainConfig, device: torch.device) -> None:
    """Refuse a batch whose rollout cannot fit in ``device``'s free memory, however small the model.

    ``train.auto_micro_batch`` does not help here: it splits the update, while a rollout samples every row of
    this process's batch at once."""
    from palestra.scale.micro_batching import free_memory_bytes

    world = _world_size()
    tasks = -(-train.batch_size // world)  # this process's share (torchrun splits the tasks over ranks)
    rows = tasks * train.group_size
    need = rollout_bytes_floor(rows, train.max_new_tokens)
    try:
        free = free_memory_bytes(device)
    except (OSError, ValueError, RuntimeError):
        return  # no way to ask this machine; the out-of-memory error will have to do
    if need <= free:
        return
    share = f" per rank ({world} ranks)" if world > 1 else ""
    micro = "; train.auto_micro_batch splits the update, not the rollout" if train.auto_micro_batch else ""
    raise ConfigError(
        f"train.batch_size: {train.batch_size} tasks x train.group_size {train.group_size} = {rows} rows{share} "
        f"need at least {_size(need)} for the rollout's token tensors alone (1 prompt token + train.max_new_tokens "
        f"{train.max_new_tokens} per row), more than the {_size(free)} free on {device}; lower train.batch_size "
        f"or train.group_size{micro}"
    )


def _size(n: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# ---- kernels.backend / PALESTRA_KERNELS / PALESTRA_CACHE_DIR -------------------------------------------
def check_kernels(backend: str, device: torch.device, device_spec: str) -> None:
    """An explicitly requested back end must run here (native ones are built now: a build failure is the error);
    ``auto`` only warns, once, when the native kernels will fall back to torch for want of a build cache."""
    from palestra.kernels import dispatch
    from palestra.kernels.build import KernelBuildError, cache_dir_problem

    raw = os.environ.get("PALESTRA_KERNELS", "")
    env = raw.strip().lower()
    if env not in ("", "auto", *dispatch.BACKENDS):
        # An error even when kernels.backend overrides it: a misspelt variable means the user expected something.
        raise ConfigError(
            f"PALESTRA_KERNELS={raw!r}: not a back end; use one of auto, {', '.join(dispatch.BACKENDS)} (or unset it)"
        )
    if backend != "auto":
        requested, source = backend, "kernels.backend"  # the config key wins over the variable (set_backend)
    elif env not in ("", "auto"):
        requested, source = env, "PALESTRA_KERNELS"
    else:
        native = any(b in ("cpp", "cuda") for b in dispatch.AUTO_ORDER.get(device.type, ()))
        problem = cache_dir_problem() if native else None
        if problem:  # the same cause (and so the same single warning) the first kernel call would report
            dispatch.warn_fallback(f"{problem}; the native kernels fall back to torch", problem)
        return
    if requested == "torch":
        return
    culprit = "kernels.backend" if source == "kernels.backend" else f"PALESTRA_KERNELS={requested!r}"
    found = ", which found no CUDA GPU" if device_spec == "auto" and device.type == "cpu" else ""
    on = f"the run is on {device} (train.device={device_spec!r}{found})"
    if requested == "cuda" and device.type != "cuda":
        raise ConfigError(f"{culprit}: the cuda back end runs on CUDA tensors, but {on}; use auto or torch")
    if requested == "cpp" and device.type != "cpu":
        raise ConfigError(f"{culprit}: the cpp back end runs on CPU tensors, but {on}; use auto or torch")
    if requested == "triton":
        reason = dispatch.triton_available(device)
        if reason:
            raise ConfigError(f"{culprit}: the triton back end cannot run here: {reason}; use auto or torch")
    if requested in ("cpp", "cuda"):
        problem = cache_dir_problem()
        if problem:
            raise ConfigError(
                f"{problem}; {source}={requested} builds its kernels there (fix it, or use kernels.backend=auto "
                f"to fall back to torch)"
            )
    try:
        dispatch.check_backend(requested, device)  # builds the native library now: asked for, it must work
    except KernelBuildError as e:
        raise ConfigError(f"{culprit}: the {requested} back end cannot run here: {e}") from None
