"""Choosing a back end for each op call.

Every op has up to four implementations: ``torch`` (the plain reference, always there), ``cpp`` (the
JIT-built CPU library), ``cuda`` (the JIT-built CUDA library) and ``triton``. The device of the input
picks one (``AUTO_ORDER``), among the back ends :data:`AUTO_BACKENDS` allows for that op on that device;
``PALESTRA_KERNELS=torch|cpp|cuda|triton`` or :func:`set_backend` (the config key ``kernels.backend``)
forces one.

* Automatic choice never picks a back end that the project's own benchmark shows slower than the torch
  reference for that op (see :data:`AUTO_BACKENDS`).
* Automatic choice degrades gracefully: if a native back end fails to build, one warning names the op
  and the reason, and the next candidate (in the end the torch reference) is used. One cause (a library
  that failed to build, an unwritable ``PALESTRA_CACHE_DIR``) warns once, however many ops it affects.
* A back end asked for explicitly that cannot run is an error, not a silent fallback.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .build import KernelBuildError, KernelCacheError, NativeLibrary

__all__ = [
    "AUTO_BACKENDS",
    "BACKENDS",
    "BackendUnavailable",
    "KernelFallbackWarning",
    "KernelOp",
    "auto_order",
    "check_backend",
    "forced_backend",
    "set_backend",
    "triton_available",
    "warn_fallback",
]

BACKENDS = ("torch", "cpp", "cuda", "triton")
# Automatic preference per device type. Triton on a CPU only runs under its (slow) interpreter, so it is
# never chosen automatically there.
AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpp", "torch")}

# The back ends ``auto`` may use, per (op, device type); AUTO_ORDER gives their order. A pair not listed may
# use every back end of AUTO_ORDER (no benchmark says otherwise: nothing is recorded on a GPU yet).
# The rule: ``auto`` never picks a back end that the project's own benchmark shows slower than the
# reference, Palestra's torch back end (the ``torch`` rows: the same public call, forced to torch, through
# the same wrapper as ``cpp``; bench/cases_advantages.py), in any recorded run: bench/results/cpu.json (run 1,
# table in cpu.txt) and cpu-run2.json (run 2, cpu-run2.txt), 2-core CPU, medians at the benchmark's sizes,
# figures below as run 1 / run 2. Where a recorded run has no torch row yet (ops not re-measured since the
# torch rows were added), its peer implementations stand in for the reference. The peers (TRL-style eager,
# torchrl, verl-style loops) are reported, not the rule; ``sum`` (one read pass over the logits) is a floor.
# tests/kernels/test_auto_dispatch.py checks what ``auto`` picks against those files; re-check this table
# when they are re-recorded. The torch reference is always allowed: it is the last resort.
AUTO_BACKENDS: dict[tuple[str, str], tuple[str, ...]] = {
    # gae B=256 T=1024 (2026-12-02, 2 threads, no torch row): cpp 0.33 / 0.23 ms; peers torchrl-vec 36 / 49 ms
    # (110x / 218x), verl-loop 81 / 84 ms (247x / 375x)
    ("gae", "cpu"): ("cpp", "torch"),
    # discounted_returns B=256 T=1024 (2026-12-02, 2 threads, no torch row): cpp 0.74 / 0.73 ms; peer
    # verl-loop 24 / 27 ms (32x / 38x)
    ("discounted_returns", "cpu"): ("cpp", "torch"),
    # The three group ops below: re-measured 2026-12-03, 1 thread, back ends alternated
    # (python bench/cases_advantages.py --update). B=8192 group=16, medians of single calls.
    # group_advantages[group]: cpp 14.1 / 14.2 us; torch 44.1 / 44.2 us (3.13x / 3.12x);
    # peer torch-eager 95 / 98 us. (This op also serves scale="batch", which the benchmark does not time.)
    ("group_advantages", "cpu"): ("cpp", "torch"),
    # group_advantages[none]: cpp 10.2 / 10.2 us; torch 20.2 / 20.2 us (1.99x / 1.98x);
    # peer torch-eager 8.8 / 8.8 us (cpp 0.86x / 0.86x of it: the kernel alone, torch.ops.palestra.
    # group_advantages, takes ~4.8 us; the public call's argument checks and dispatch add ~5.5 us)
    ("group_advantages[none]", "cpu"): ("cpp", "torch"),
    # rloo_advantages: cpp 8.5 / 8.6 us; torch 25.7 / 25.4 us (3.02x / 2.95x); peer torch-eager 12.3 / 12.3 us
    # (1.45x / 1.44x). (The 2026-12-02 runs, 2 threads, cpp timed with ``set_backend`` in a context manager
    # around every call, not alternated, no torch row, had cpp 41 / 22 us against eager 24 / 25 us.)
    ("rloo_advantages", "cpu"): ("cpp", "torch"),
    # logprob_entropy 4096x32768 fp32 (2026-12-02, 2 threads, no torch row), forward: cpp 44 / 28 ms; peers
    # torch-eager 1.20 / 1.02 s (27x / 37x), trl 1.13 / 0.96 s (26x / 35x). Forward + backward: cpp 128 / 137
    # ms; torch-eager 3.0 / 2.5 s (23x / 18x), trl 3.3 / 2.4 s (26x / 17x)
    ("logprob_entropy", "cpu"): ("cpp", "torch"),
    # normalize_rewards 64K and 1M rewards, S=1 and S=8 segments (2026-12-02, 2 threads, no torch row):
    # cpp 0.047-5.1 / 0.046-3.3 ms; faster than the peers torch-eager at every size (3.2x-11x / 4.4x-11x)
    # and trl-style (2.5x-8.0x / 1.75x-14x)
    ("normalize_rewards", "cpu"): ("cpp", "torch"),
}

_forced: str | None = None
_OPS: dict[str, KernelOp] = {}  # every KernelOp by name, for the compile-time constant lookup below


class BackendUnavailable(KernelBuildError):
    """The back end cannot serve this device (e.g. ``cuda`` for a CPU tensor)."""


class KernelFallbackWarning(RuntimeWarning):
    """``auto`` could not use a native back end and serves the op with the next one (in the end torch).
    Defined here so that the command line prints it as one ``palestra: warning:`` line."""


_warned_causes: set[str] = set()  # the reasons already warned about, in this process


def warn_fallback(message: str, cause: str, *, stacklevel: int = 2) -> None:
    """Warn ``message`` unless ``cause`` was warned about already: one library failure (or one unwritable
    cache folder) affects every op, and the user needs to read about it once."""
    if cause in _warned_causes:
        return
    _warned_causes.add(cause)
    warnings.warn(message, KernelFallbackWarning, stacklevel=stacklevel + 1)


def set_backend(name: str | None) -> None:
    """Force one back end for every op (``None`` or ``"auto"``: choose by device)."""
    global _forced
    if name in (None, "auto"):
        _forced = None
        return
    if name not in BACKENDS:
        raise ValueError(f"kernels.backend: unknown back end {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    _forced = name


def forced_backend() -> str | None:
    """The back end forced by :func:`set_backend`, else by ``PALESTRA_KERNELS``, else ``None``."""
    if _forced is not None:
        return _forced
    env = os.environ.get("PALESTRA_KERNELS", "").strip().lower()
    if env in ("", "auto"):
        return None
    if env not in BACKENDS:
        raise ValueError(f"PALESTRA_KERNELS={env!r} is not a back end; choose one of auto, {', '.join(BACKENDS)}")
    return env


def auto_order(op: str, device_type: str) -> tuple[str, ...]:
    """The back ends ``auto`` tries for ``op`` on ``device_type``, best first: AUTO_ORDER less those
    :data:`AUTO_BACKENDS` does not allow; the torch reference always ends it."""
    order = AUTO_ORDER.get(device_type, ("torch",))
    allowed = AUTO_BACKENDS.get((op, device_type))
    if allowed is not None:
        order = tuple(b for b in order if b in allowed)
    return order if "torch" in order else (*order, "torch")


def triton_available(device: torch.device) -> str | None:
    """``None`` if Triton can run on ``device``, else the reason it cannot."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"triton needs a CUDA device or TRITON_INTERPRET=1 (got a {device.type} tensor)"


def check_backend(backend: str, device: torch.device) -> None:
    """Raise :class:`KernelBuildError` if ``backend`` cannot serve every op on ``device``, building (and loading)
    its native library if it has one: what a run that forces ``backend`` would meet at its first kernel call.
    The error raised is the library's own when the build failed (it names the op whose source failed)."""
    for op in _OPS.values():
        try:
            op._ready(backend, device)
        except KernelBuildError as e:
            raise e.__cause__ if isinstance(e.__cause__, KernelBuildError) else e from None


@dataclass
class KernelOp:
    """One public op and its implementations, by back end."""

    name: str
    impls: dict[str, Callable] = field(default_factory=dict)
    libraries: dict[str, NativeLibrary] = field(default_factory=dict)
    _chosen: dict[tuple[str, str | None], str] = field(default_factory=dict)

    def __post_init__(self):
        _OPS[self.name] = self

    def register(self, backend: str, library: NativeLibrary | None = None):
        """Decorator: ``@op.register("cpp", CPU_LIBRARY)`` registers the cpp implementation."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown back end {backend!r}")

        def deco(fn: Callable) -> Callable:
            self.impls[backend] = fn
            if library is not None:
                self.libraries[backend] = library
            return fn

        return deco

    def _ready(self, backend: str, device: torch.device) -> None:
        """Raise :class:`KernelBuildError` if ``backend`` cannot run this op on ``device``."""
        if backend not in self.impls:
            raise BackendUnavailable(self.name, f"has no {backend} implementation")
        if backend == "cpp" and device.type != "cpu":
            raise BackendUnavailable(self.name, f"the cpp back end runs on CPU tensors, got {device.type}")
        if backend == "cuda" and device.type != "cuda":
            raise BackendUnavailable(self.name, f"the cuda back end runs on CUDA tensors, got {device.type}")
        if backend == "triton":
            reason = triton_available(device)
            if reason:
                raise BackendUnavailable(self.name, reason)
        lib = self.libraries.get(backend)
        if lib is not None:
            try:
                lib.load()
            except KernelBuildError as e:
                raise KernelBuildError(self.name, f"{backend} back end unavailable: {e.reason}") from e

    def backend_for(self, device: torch.device) -> str:
        """The back end this op uses on ``device`` (building it on first use)."""
        forced = forced_backend()
        key = (device.type, forced)
        chosen = self._chosen.get(key)
        if chosen is not None:
            return chosen
        if forced is not None:
            self._ready(forced, device)  # explicit request: failure is an error
            chosen = forced
        else:
            for backend in auto_order(self.name, device.type):
                try:
                    self._ready(backend, device)
                    chosen = backend
                    break
                except BackendUnavailable:
                    continue
                except KernelBuildError as e:
                    # The library's own error (shared by every op it serves) is the cause; ``e`` names this op.
                    cause = e.__cause__ if isinstance(e.__cause__, KernelBuildError) else e
                    if isinstance(cause, KernelCacheError):
                        warn_fallback(
                            f"{cause.reason}; the native kernels fall back to torch", cause.reason, stacklevel=3
                        )
                    else:
                        warn_fallback(f"{e}; falling back", f"{backend}/{device.type}: {cause.reason}", stacklevel=3)
            assert chosen is not None, "the torch reference is always available"
        self._chosen[key] = chosen
        return chosen

    def __call__(self, device: torch.device | str, backend: str | None = None) -> Callable:
        """The implementation to call: ``backend`` if given (it must work), else the chosen one.

        Safe under ``torch.compile(fullgraph=True)``: the choice is made eagerly at trace time and becomes
        a constant of the graph (Dynamo cannot trace the build's lock)."""
        return self.impls[_backend_name(self.name, str(device), backend)]


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo`` (about 2 s, and
    Triton with it) when Dynamo is not loaded yet: the decorator only sets the marker Dynamo reads when it
    meets the call."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _backend_name(op: str, device: str, backend: str | None) -> str:
    """The back end that serves ``op`` on ``device`` (building it on first use); ``backend`` if given,
    after checking that it can run there."""
    kernel_op, dev = _OPS[op], torch.device(device)
    if backend is None:
        return kernel_op.backend_for(dev)
    kernel_op._ready(backend, dev)
    return backend
