"""Choosing a back end for each op call.

Every op has up to four implementations: ``torch`` (the plain reference, always there), ``cpp`` (the
JIT-built CPU library), ``cuda`` (the JIT-built CUDA library) and ``triton``. The device of the input
picks one; ``PALESTRA_KERNELS=torch|cpp|cuda|triton`` or :func:`set_backend` (the config key
``kernels.backend``) forces one.

* Automatic choice degrades gracefully: if a native back end fails to build, one warning names the op
  and the reason, and the next candidate (in the end the torch reference) is used.
* A back end asked for explicitly that cannot run is an error, not a silent fallback.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .build import KernelBuildError, NativeLibrary

__all__ = ["BACKENDS", "KernelOp", "set_backend", "forced_backend", "BackendUnavailable", "triton_available"]

BACKENDS = ("torch", "cpp", "cuda", "triton")
# Automatic preference per device type. Triton on a CPU only runs under its (slow) interpreter, so it is
# never chosen automatically there.
AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpp", "torch")}

_forced: str | None = None
_OPS: dict[str, "KernelOp"] = {}  # every KernelOp by name, for the compile-time constant lookup below


class BackendUnavailable(KernelBuildError):
    """The back end cannot serve this device (e.g. ``cuda`` for a CPU tensor)."""


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


@dataclass
class KernelOp:
    """One public op and its implementations, by back end."""

    name: str
    impls: dict[str, Callable] = field(default_factory=dict)
    libraries: dict[str, NativeLibrary] = field(default_factory=dict)
    _chosen: dict[tuple[str, str | None], str] = field(default_factory=dict)
    _warned: set = field(default_factory=set)

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
            for backend in AUTO_ORDER.get(device.type, ("torch",)):
                try:
                    self._ready(backend, device)
                    chosen = backend
                    break
                except BackendUnavailable:
                    continue
                except KernelBuildError as e:
                    if (backend, device.type) not in self._warned:
                        self._warned.add((backend, device.type))
                        warnings.warn(f"{e}; falling back", RuntimeWarning, stacklevel=3)
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
